#!/usr/bin/env bash
# Set up (if needed) and run the demo: GRPO on the built-in arithmetic task with the embedded tiny model (built
# locally, no downloads) on DeepSpeed, steps 2-3 profiled with torch.profiler, metrics on the console and in
# metrics.jsonl. Extra arguments are trainer overrides, e.g. algorithm.adv_estimator=gae actor_rollout_ref.rollout.n=1
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
rm -rf outputs/demo
.venv/bin/python -m rlprof_train.main_ppo \
  trainer.experiment_name=demo trainer.log_dir=outputs/demo/logs trainer.default_local_dir=outputs/demo/checkpoints \
  'trainer.logger=["console","file","tensorboard"]' \
  global_profiler.tool=torch "global_profiler.steps=[2,3]" global_profiler.save_path=outputs/demo/profile "$@"
.venv/bin/rlprof summary outputs/demo/profile
echo "Metrics: outputs/demo/logs/metrics.jsonl; curves: .venv/bin/tensorboard --logdir tensorboard_log"
echo "Trace:   .venv/bin/tensorboard --logdir outputs/demo/profile/torch  (PyTorch Profiler tab)"
