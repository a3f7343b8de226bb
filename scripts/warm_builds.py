"""The test command's one-time builds, made at once while its checks run (ruff, mypy, the docs site: one core
each): the embedded models of the demo's and the tool demo's tasks (a single-threaded process each, one to two
minutes on our machines, for the same bytes everywhere) and, on the CPU, DeepSpeed's JIT-compiled ops the trainer
loads (its shared-memory collective and CPU Adam, into torch's extensions folder). Without it the first tests that
need each build it, one after another, while the other core idles.

    .venv/bin/python scripts/warm_builds.py
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlprof_train.config.load import load_trainer_config  # noqa: E402
from rlprof_train.prepare import EMBEDDED_MODEL_DIR  # noqa: E402
from rlprof_train.tiny_model import ensure_tiny_model  # noqa: E402

CONFIGS = ("demo", "tool_demo")
"""The bundled configs whose embedded models the tests train."""
DEEPSPEED_OPS = ("ShareMemCommBuilder", "CPUAdamBuilder")
"""DeepSpeed's ops a CPU run builds on first use: ``init_distributed``'s collective, the offloaded optimizer's Adam."""


def build_model(config: str) -> str:
    data = load_trainer_config([f"--config-name={config}"]).data
    return str(ensure_tiny_model(ROOT / EMBEDDED_MODEL_DIR, data.task_max_operand, data.task))


def build_deepspeed_ops() -> str:
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        return "DeepSpeed ops: built by the first run on this accelerator"
    for name in DEEPSPEED_OPS:
        builder = accelerator.create_op_builder(name)
        if builder is not None and builder.is_compatible():
            builder.load(verbose=False)
    return f"DeepSpeed ops: {', '.join(DEEPSPEED_OPS)}"


def main() -> None:
    with ThreadPoolExecutor(len(CONFIGS) + 1) as pool:
        jobs = [pool.submit(build_model, config) for config in CONFIGS] + [pool.submit(build_deepspeed_ops)]
        for job in jobs:
            print(f"warm: {job.result()}", flush=True)


if __name__ == "__main__":
    main()
