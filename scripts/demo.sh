#!/usr/bin/env bash
# Set up (if needed) and run the demo: the instrumented RL loop on a tiny local model, profiled with the torch
# tool on steps 2-3, then the summary of what it wrote. Extra arguments are OmegaConf overrides for the loop.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
save_path=outputs/demo
rm -rf "$save_path"
.venv/bin/python examples/rl_loop.py global_profiler.tool=torch "global_profiler.steps=[2,3]" \
  "global_profiler.save_path=$save_path" "$@"
.venv/bin/rlprof summary "$save_path"
echo "Open the traces with: .venv/bin/tensorboard --logdir $save_path/torch  (PyTorch Profiler tab)"
