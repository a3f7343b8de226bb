#!/usr/bin/env bash
# The GPU evidence kit: prove every CUDA-only path of rlprof on a GPU machine with no network, in one short run.
#
#   bash scripts/gpu_kit.sh prepare                 # here (CPU, package registries reachable): wheels -> .gpu_kit/
#   bash scripts/gpu_kit.sh run [--out DIR]         # there (CUDA, Python 3.12, no network): install, test, summarize
#   bash scripts/gpu_kit.sh run --dry-run           # anywhere: list what run would execute
#
# prepare downloads the cp312 manylinux wheels the GPU machine lacks (see ../shared/docs/PLATFORM.md, "The lent GPU
# machine": it has torch, transformers, tensorboard, rich, psutil, pytest, pandas; not omegaconf, nvtx, deepspeed,
# msgspec, ijson, plotly) and builds DeepSpeed's wheel from its sdist (its ops compile just in time there); the folder
# stays under 64 MiB. run installs them with pip --no-index --target, then, within 8 minutes: pytest -m gpu (memory
# snapshots per window with role tags, the OOM snapshot, cudaProfilerApi around windows, the DeepSpeed trainer on
# CUDA with torch_memory and with torch tracing CUDA kernels, MFU against the device's peak), rlprof report and
# rlprof memory on what the trainer wrote, and a summary small enough to copy back: junit.xml, report.json,
# snapshot.json, files.txt (sizes of everything written), summary.txt.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KIT="$ROOT/.gpu_kit"
LIMIT_MIB=64
RUN_BUDGET_S=480
PY_VERSION=3.12
PLATFORM=manylinux_2_17_x86_64
WHEELS=(  # name==version as in .venv, so the GPU machine runs what the tests ran here
  omegaconf==2.4.0 nvtx==0.2.17 msgspec==0.23.0 ijson==3.6.0 plotly==7.1.0 narwhals==2.29.0
  hjson==3.1.0 ninja==1.13.2 py-cpuinfo==9.0.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0
  typing-inspection==0.4.5 typing_extensions==4.16.0 msgpack==1.2.4 einops==0.8.2
)
DEEPSPEED=deepspeed==0.19.8
PYTHON="${PYTHON:-$( [[ -x "$ROOT/.venv/bin/python" ]] && echo "$ROOT/.venv/bin/python" || echo python3 )}"

die() { echo "gpu_kit: $*" >&2; exit 2; }

prepare() {
  local pip="$ROOT/.venv/bin/pip"
  [[ -x "$pip" ]] || pip="python3 -m pip"
  rm -rf "$KIT" && mkdir -p "$KIT/wheels"
  $pip download --quiet --no-deps --only-binary=:all: --python-version "$PY_VERSION" --platform "$PLATFORM" \
    --implementation cp --dest "$KIT/wheels" "${WHEELS[@]}"
  $pip wheel --quiet --no-deps --no-build-isolation --wheel-dir "$KIT/wheels" "$DEEPSPEED"
  local mib
  mib=$(du -sm "$KIT" | cut -f1)
  ls -1 "$KIT/wheels"
  echo "gpu_kit: $(ls "$KIT/wheels" | wc -l) wheels in $KIT: ${mib} MiB (limit ${LIMIT_MIB} MiB)"
  (( mib < LIMIT_MIB )) || die "the kit is ${mib} MiB, over the ${LIMIT_MIB} MiB a device call can carry"
}

# The steps of run, one per line: "seconds|description|command" (commands run from the repository root with
# PYTHONPATH set to the installed wheels and the repository, python3 standing for $PYTHON: .venv/bin/python where it
# exists, else python3; $OUT and $WORK are the summary and scratch folders).
steps() {
  cat <<'EOF'
300|pytest -m gpu: every CUDA-only path|python3 -m pytest -m gpu tests -p no:cacheprovider -q -rs --junitxml="$OUT/junit.xml" --basetemp="$WORK/pytest"
90|trainer on CUDA, torch_memory on step 2|python3 -m rlprof_train.main_ppo --config-name demo trainer.device=cuda trainer.total_training_steps=3 trainer.test_freq=-1 trainer.val_before_train=false 'trainer.logger=["file"]' trainer.log_dir="$WORK/run/logs" trainer.default_local_dir="$WORK/run/ckpt" global_profiler.tool=torch_memory 'global_profiler.steps=[2]' global_profiler.save_path="$WORK/run/profile"
30|rlprof report on that run|python3 -m rlprof.cli report "$WORK/run/logs" --format json > "$OUT/report.json"
30|rlprof memory on its snapshot|python3 -m rlprof.cli memory "$(find "$WORK/run/profile" -name '*.pickle' | head -1)" --format json > "$OUT/snapshot.json"
EOF
}

run() {
  local out="$ROOT/outputs/gpu_kit" dry=0
  while (( $# )); do
    case "$1" in
      --out) out="$2"; shift 2 ;;
      --dry-run) dry=1; shift ;;
      *) die "run: unknown option $1 (allowed: --out DIR, --dry-run)" ;;
    esac
  done
  if (( dry )); then
    echo "gpu_kit run would, with a ${RUN_BUDGET_S} s budget:"
    echo "  $PYTHON -m pip install --no-index --no-deps --target $KIT/site $KIT/wheels/*.whl"
    while IFS='|' read -r seconds what command; do
      echo "  [${seconds} s] ${what}: ${command}"
    done < <(steps)
    echo "  then write $out/{junit.xml,report.json,snapshot.json,files.txt,summary.txt}"
    return 0
  fi
  "$PYTHON" -c 'import torch' 2>/dev/null || die "run: $PYTHON cannot import torch (set PYTHON to one that can)"
  "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
    || die "run: no CUDA device here (torch.cuda.is_available() is False); run it on a GPU machine, or --dry-run"
  [[ -d "$KIT/wheels" ]] || die "run: no $KIT/wheels; run 'bash scripts/gpu_kit.sh prepare' on a networked machine first"
  local started=$SECONDS
  export OUT="$out" WORK="${TMPDIR:-/tmp}/rlprof_gpu_kit"
  rm -rf "$WORK" && mkdir -p "$OUT" "$WORK"
  "$PYTHON" -m pip install --quiet --no-index --no-deps --target "$KIT/site" "$KIT"/wheels/*.whl
  export PYTHONPATH="$KIT/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  local summary="$OUT/summary.txt"
  {
    echo "gpu_kit on $(hostname) at $(date -u +%FT%TZ)"
    "$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'
  } > "$summary"
  while IFS='|' read -r seconds what command; do
    local left=$(( RUN_BUDGET_S - (SECONDS - started) ))
    if (( left < 10 )); then
      echo "SKIPPED (budget spent): $what" >> "$summary"
      continue
    fi
    (( seconds < left )) || seconds=$left
    local t0=$SECONDS status=0
    (cd "$ROOT" && PYTHON="$PYTHON" timeout "$seconds" bash -c "${command//python3/\$PYTHON}") > "$WORK/step.log" 2>&1 \
      || status=$?
    echo "exit $status after $(( SECONDS - t0 )) s: $what" >> "$summary"
    tail -n 15 "$WORK/step.log" | sed 's/^/    /' >> "$summary"
  done < <(steps)
  find "$WORK" -type f -printf '%s\t%P\n' | sort -k2 > "$OUT/files.txt"
  echo "total $(( SECONDS - started )) s" >> "$summary"
  cat "$summary"
}

case "${1:-}" in
  prepare) prepare ;;
  run) shift; run "$@" ;;
  *) die "usage: bash scripts/gpu_kit.sh prepare | run [--out DIR] [--dry-run]" ;;
esac
