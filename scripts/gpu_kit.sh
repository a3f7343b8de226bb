#!/usr/bin/env bash
# The GPU evidence kit: prove every CUDA-only path of rlprof and the trainer on a GPU machine with no network, in
# one short run.
#
#   bash scripts/gpu_kit.sh prepare                 # here (CPU, package registries reachable): wheels -> .gpu_kit/
#   bash scripts/gpu_kit.sh run [--out DIR]         # there (CUDA, Python 3.12, no network): install, test, summarize
#   bash scripts/gpu_kit.sh run --dry-run           # anywhere: list what run would execute
#   bash scripts/gpu_kit.sh run --part speed        # there: the fast paths' evidence (speed-1b: the 1B comparison; speed-each: each path alone)
#   bash scripts/gpu_kit.sh run --part async        # there: the one-step-off trainer on the device, and against the synchronous one
#
# prepare downloads the cp312 manylinux wheels the GPU machine lacks (see ../shared/docs/PLATFORM.md, "The lent GPU
# machine": it has torch, transformers, peft, tensorboard, rich, psutil, pytest, pandas, pyarrow; not omegaconf, nvtx,
# deepspeed, msgspec, ijson, plotly, TRL) and builds DeepSpeed's wheel from its sdist (its ops compile just in time
# there); the folder stays under 64 MiB. run installs them with pip --no-index --target, then, within 8 minutes:
# pytest -m gpu (snapshots per window with role tags, the OOM snapshot, cudaProfilerApi around windows, the trainer
# on the device in every configuration: GRPO, GAE, remove padding, dynamic batches, ReMax, entropy checkpointing,
# LoRA, a reward model, multi-turn tools, bf16, ZeRO 1 and 3, activation offload), the trainer on a 155M-parameter
# Llama for 5 steps with the torch tool on one step and a checkpoint, rlprof report and rlprof memory, the checkpoint
# resumed on the GPU under torchrun and on the CPU, and the GPU benchmarks (against TRL's GRPOTrainer; a recorded
# window against the bare torch tool). Each step has its own time limit; the summary says per step what passed, with
# the figures: summary.txt, junit.xml, report.json, snapshot.json and two CUDA snapshots (a window's, an OOM's).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KIT="$ROOT/.gpu_kit"
LIMIT_MIB=64
RUN_BUDGET_S=${GPU_KIT_BUDGET_S:-}  # seconds for all steps; empty: the part's (kit 480, the speed parts 540)
PY_VERSION=3.12
PLATFORM=manylinux_2_17_x86_64
WHEELS=(  # name==version as in .venv, so the GPU machine runs what the tests ran here
  omegaconf==2.4.0 nvtx==0.2.17 msgspec==0.23.0 ijson==3.6.0 plotly==7.1.0 narwhals==2.29.0
  hjson==3.1.0 ninja==1.13.2 py-cpuinfo==9.0.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0
  typing-inspection==0.4.5 typing_extensions==4.16.0 msgpack==1.2.4 einops==0.8.2
  trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19  # the GPU benchmark's peer
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
# exists, else python3; $OUT and $WORK are the summary and scratch folders, $MODEL the 155M Llama, $TRAIN the
# trainer's command with the run's folders, $SHOW scripts/gpu_kit_show.py, which prints a step's figures).
steps() {
  cat <<'EOF'
260|pytest -m gpu tests: every CUDA-only path, the trainer on the device in every configuration, its faults (Ctrl-C, SIGTERM, bf16 overflow)|python3 -m pytest -m gpu tests -k "not static_decode and not compiled_rollout and not fast_paths and not pools_sharing" -p no:cacheprovider -q -rs --durations=8 --junitxml="$OUT/junit.xml" --basetemp="$WORK/pytest"
25|a 155M-parameter Llama from the embedded tokenizer|python3 benchmarks/llama_shapes.py 155m "$MODEL"
75|the trainer on CUDA: the 155M Llama, 32 prompts x 8, 64 new tokens, 5 steps, the torch tool (cpu+cuda) on step 3, a checkpoint at step 5|python3 -m $TRAIN data.max_response_length=64 trainer.total_training_steps=5 trainer.save_freq=5 global_profiler.tool=torch 'global_profiler.steps=[3]' 'global_profiler.global_tool_config.torch.contents=[cpu,cuda]' global_profiler.save_path="$WORK/run/profile" && python3 $SHOW steps "$WORK/run/logs/metrics.jsonl"
20|rlprof report on that run: kernel time per range|python3 -m rlprof.cli report "$WORK/run/logs" --format json > "$OUT/report.json" && python3 $SHOW report "$OUT/report.json"
20|rlprof memory on a CUDA snapshot of the trainer (pytest's torch_memory run)|snap="$(find "$WORK/pytest" -path '*torch_memory/step2/*' -name '*.pickle' | head -1)" && cp "$snap" "$OUT/trainer_step2_snapshot.pickle" && python3 -m rlprof.cli memory "$snap" --format json > "$OUT/snapshot.json" && python3 -m rlprof.cli memory "$snap" | head -40 && cp "$(find "$WORK/pytest" -name 'oom_*.pickle' | head -1)" "$OUT/oom_snapshot.pickle"
90|the GPU's checkpoint resumed on the GPU (torchrun --nproc_per_node 1, trainer.n_gpus_per_node=1) and on the CPU|python3 -m torch.distributed.run --standalone --nproc_per_node 1 -m $TRAIN trainer.n_gpus_per_node=1 trainer.total_training_steps=6 trainer.save_freq=6 data.max_response_length=16 'trainer.resume_allow_changes=[data.max_response_length]' && python3 -m $TRAIN trainer.device=cpu data.train_batch_size=4 actor_rollout_ref.actor.ppo_mini_batch_size=4 actor_rollout_ref.rollout.n=2 data.max_response_length=4 trainer.total_training_steps=7 trainer.save_freq=-1 'trainer.resume_allow_changes=[data.train_batch_size,actor_rollout_ref.actor.ppo_mini_batch_size,actor_rollout_ref.rollout.n,data.max_response_length]' && python3 $SHOW steps "$WORK/run/logs/metrics.jsonl" --last 6,7
240|GPU benchmarks: against TRL's GRPOTrainer at equal work, a recorded window against the bare torch tool|python3 -m pytest -m gpu benchmarks -k "not fast_path and not one_step_off" -p no:cacheprovider -q -s -rs --basetemp="$WORK/bench"; cat outputs/benchmarks/gpu_*.md
EOF
}

# The steps of run --part speed (issue 48's evidence, about 8 minutes): the compiled decode on the device, then the
# fast paths against TRL's fastest setting at 155M; --part speed-1b: the same comparison at TinyLlama's 1B shape.
speed_steps() {
  cat <<'EOF'
120|the fast paths on the device: CUDA graphs replay on the weights an optimizer step updated; the trainer with the compiled decode, the compiled training forward and bf16 keeps every tensor there|python3 -m pytest -m gpu tests/rlprof_train/test_static_decode.py tests/rlprof_train/test_device_placement.py -k "static_decode or compiled_rollout or fast_paths" -p no:cacheprovider -q -rs --basetemp="$WORK/pytest"
420|the fast paths against TRL's fastest setting at 155M: ratio, rollout time, MFU, compile time|python3 -m pytest -m gpu benchmarks/test_gpu.py -k "fast_paths and 155m" -p no:cacheprovider -q -s -rs --basetemp="$WORK/bench"; cat outputs/benchmarks/gpu_fast_155m.md
EOF
}

speed_1b_steps() {
  cat <<'EOF'
500|the fast paths against TRL's fastest setting at TinyLlama's 1B shape|python3 -m pytest -m gpu benchmarks/test_gpu.py -k "fast_paths and 1b" -p no:cacheprovider -q -s -rs --basetemp="$WORK/bench"; cat outputs/benchmarks/gpu_fast_1b.md
EOF
}

# --part speed-each: each fast path on its own over the eager baseline at 155M (what it gains and costs in memory).
speed_each_steps() {
  cat <<'EOF'
500|each fast path on its own at 155M: step, rollout, update time and peak memory over the eager fp32 baseline|python3 -m pytest -m gpu benchmarks/test_gpu.py -k "each_fast_path" -p no:cacheprovider -q -s -rs --basetemp="$WORK/bench"; cat outputs/benchmarks/gpu_each_fast_path.md
EOF
}

# --part async (issue 59's GPU evidence): the one-step-off trainer with its pools on the device (sharing one GPU, or
# a GPU each), then against the synchronous trainer on the same GPUs.
async_steps() {
  cat <<'EOF'
240|both asynchronous trainers on the device (one-step-off, fully async): a trainer and a rollout process (sharing one GPU, or on one each), the torch tool on step 2: staleness, weight syncs, both pools' kernels|python3 -m pytest -m gpu tests/rlprof_train/test_one_step_off.py -k "pools_sharing" -p no:cacheprovider -q -rs --basetemp="$WORK/pytest"
380|one-step-off against the synchronous trainer on the same GPUs: 155M, 32 x 8, up to 64 new tokens, alternated pairs|python3 -m pytest -m gpu benchmarks/test_gpu.py -k "one_step_off" -p no:cacheprovider -q -s -rs --basetemp="$WORK/bench"; cat outputs/benchmarks/gpu_one_step_off.md
EOF
}

run() {
  local out="$ROOT/outputs/gpu_kit" dry=0 part=kit
  while (( $# )); do
    case "$1" in
      --out) out="$2"; shift 2 ;;
      --dry-run) dry=1; shift ;;
      --part) part="$2"; shift 2 ;;
      *) die "run: unknown option $1 (allowed: --out DIR, --dry-run, --part kit|speed|speed-1b|speed-each|async)" ;;
    esac
  done
  local list
  case "$part" in
    kit) list=steps; RUN_BUDGET_S=${RUN_BUDGET_S:-480} ;;
    speed) list=speed_steps; RUN_BUDGET_S=${RUN_BUDGET_S:-540} ;;
    speed-1b) list=speed_1b_steps; RUN_BUDGET_S=${RUN_BUDGET_S:-540} ;;
    speed-each) list=speed_each_steps; RUN_BUDGET_S=${RUN_BUDGET_S:-540} ;;
    async) list=async_steps; RUN_BUDGET_S=${RUN_BUDGET_S:-540} ;;
    *) die "run: --part $part is not a part (allowed: kit, speed, speed-1b, speed-each, async)" ;;
  esac
  export OUT="$out" WORK="${TMPDIR:-/tmp}/rlprof_gpu_kit" MODEL="$ROOT/outputs/models/llama-155m" PYTHONUNBUFFERED=1
  export SHOW="scripts/gpu_kit_show.py" TRAIN="rlprof_train.main_ppo --config-name demo trainer.device=cuda \
actor_rollout_ref.model.path=$MODEL trainer.test_freq=-1 trainer.val_before_train=false trainer.logger=[file] \
trainer.log_dir=$WORK/run/logs trainer.default_local_dir=$WORK/run/ckpt"
  if (( dry )); then
    echo "gpu_kit run would, with a ${RUN_BUDGET_S} s budget:"
    echo "  $PYTHON -m pip install --no-index --no-deps --target $KIT/site $KIT/wheels/*.whl"
    echo "  with TRAIN=$TRAIN"
    while IFS='|' read -r seconds what command; do
      echo "  [${seconds} s] ${what}: ${command}"
    done < <($list)
    echo "  then write $out/{summary.txt,junit.xml,report.json,snapshot.json,files.txt} and two CUDA snapshots"
    return 0
  fi
  "$PYTHON" -c 'import torch' 2>/dev/null || die "run: $PYTHON cannot import torch (set PYTHON to one that can)"
  "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
    || die "run: no CUDA device here (torch.cuda.is_available() is False); run it on a GPU machine, or --dry-run"
  [[ -d "$KIT/wheels" ]] || die "run: no $KIT/wheels; run 'bash scripts/gpu_kit.sh prepare' on a networked machine first"
  local started=$SECONDS
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
      echo "SKIPPED (the ${RUN_BUDGET_S} s budget is spent): $what" >> "$summary"
      continue
    fi
    (( seconds < left )) || seconds=$left
    local t0=$SECONDS status=0
    (cd "$ROOT" && PYTHON="$PYTHON" timeout "$seconds" bash -c "${command//python3/\$PYTHON}") > "$WORK/step.log" 2>&1 \
      || status=$?
    echo "$( (( status == 0 )) && echo PASS || echo "FAIL (exit $status)") after $(( SECONDS - t0 )) s: $what" >> "$summary"
    grep -vE "^(Loading weights|Writing model)|it/s]$" "$WORK/step.log" | tail -n 40 | cut -c1-400 | sed 's/^/    /' >> "$summary"
  done < <($list)
  find "$WORK" -type f -printf '%s\t%P\n' | sort -k2 > "$OUT/files.txt"
  echo "total $(( SECONDS - started )) s" >> "$summary"
  cat "$summary"
}

case "${1:-}" in
  prepare) prepare ;;
  run) shift; run "$@" ;;
  *) die "usage: bash scripts/gpu_kit.sh prepare | run [--out DIR] [--dry-run] [--part kit|speed|speed-1b|speed-each|async]" ;;
esac
