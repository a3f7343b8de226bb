#!/usr/bin/env bash
# Set up (if needed) and run the demo: GRPO on the built-in arithmetic task with the embedded tiny model (built
# locally, no downloads) on DeepSpeed, steps 2-3 profiled with torch.profiler (operators and memory), metrics on the
# console and in metrics.jsonl, then the run's report (rlprof report) and its HTML page.
# Extra arguments are trainer overrides, e.g. algorithm.adv_estimator=gae actor_rollout_ref.rollout.n=1
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
rm -rf outputs/demo
.venv/bin/python -m rlprof_train.main_ppo --config-name demo \
  trainer.experiment_name=demo trainer.log_dir=outputs/demo/logs trainer.default_local_dir=outputs/demo/checkpoints \
  'trainer.logger=["console","file","tensorboard"]' \
  global_profiler.tool=torch "global_profiler.steps=[2,3]" global_profiler.profile_continuous_steps=true \
  "global_profiler.global_tool_config.torch.contents=[cpu,memory]" \
  global_profiler.save_path=outputs/demo/profile "$@"
.venv/bin/rlprof report outputs/demo --html outputs/demo/report.html
echo "Report page: outputs/demo/report.html (opens offline); curves and traces: .venv/bin/rlprof view outputs/demo"
