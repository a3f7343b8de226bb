"""LoRA against full fine-tuning: step time and whole-process peak memory of the same GRPO run.

A 4-layer, 1024-wide Llama (about 42M parameters, the arithmetic tokenizer) trained 4 steps by the demo's GRPO, once
with full fine-tuning and once with rank-8 adapters on every linear layer, alternately, each in a fresh process
(``PAIRS`` pairs). Step time: the median ``timing_s/step`` of steps 2-4; memory: the peak resident set of the
trainer's process tree (``ru_maxrss`` of a wrapper's children). The table goes to stdout and
``outputs/benchmarks/lora.md``.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.long  # about 3 minutes on 2 cores: left out of scripts/test.sh, run with -m long

ROOT = Path(__file__).resolve().parents[1]
PAIRS = 2
STEPS = 4
LORA = (
    "actor_rollout_ref.model.lora_rank=8",
    "actor_rollout_ref.model.lora_alpha=16",
    "actor_rollout_ref.model.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head]",
)
PROBE = (
    "import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
    "print('PEAK', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(r.returncode)"
)


def wide_model(folder: Path) -> Path:
    from rlprof_train.tiny_model import build_tiny_llama, build_tokenizer, task_corpus

    tokenizer = build_tokenizer(task_corpus("arithmetic", 0))
    build_tiny_llama(tokenizer, hidden=1024, layers=4, heads=8).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def run(folder: Path, model: Path, *overrides: str) -> tuple[float, float]:
    """(median s/step of steps 2..STEPS, peak RSS in MiB) of one run."""
    command = [
        sys.executable,
        "-c",
        PROBE,
        sys.executable,
        "-m",
        "rlprof_train.main_ppo",
        "--config-name=demo",
        f"actor_rollout_ref.model.path={model}",
        f"trainer.total_training_steps={STEPS}",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        f"trainer.log_dir={folder / 'logs'}",
        f"trainer.default_local_dir={folder / 'ckpt'}",
        'trainer.logger=["file"]',
        *overrides,
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [json.loads(line) for line in (folder / "logs" / "metrics.jsonl").read_text().splitlines()]
    step_time = statistics.median(r["timing_s/step"] for r in rows if r["step"] >= 2)
    return step_time, int(result.stderr.rsplit("PEAK", 1)[1].split()[0]) / 1024


def test_lora_against_full_fine_tuning(tmp_path):
    model = wide_model(tmp_path / "wide")
    full, lora = [], []
    for pair in range(PAIRS):  # alternate the order: full first, then LoRA first
        order = [("full", ()), ("lora", LORA)] if pair % 2 == 0 else [("lora", LORA), ("full", ())]
        for name, overrides in order:
            (full if name == "full" else lora).append(run(tmp_path / f"{name}{pair}", model, *overrides))
    ratios = [f[0] / lo[0] for f, lo in zip(full, lora, strict=True)]

    def row(name: str, runs: list[tuple[float, float]]) -> str:
        return f"| {name} | {', '.join(f'{t:.3f}' for t, _ in runs)} | {', '.join(f'{m:.0f}' for _, m in runs)} |"

    table = "\n".join(
        [
            "| run | s/step (median of steps 2-4, per pair) | peak RSS MiB (per pair) |",
            "|---|---|---|",
            row("full fine-tuning", full),
            row("LoRA rank 8", lora),
            f"| full / LoRA step time | {', '.join(f'{r:.2f}x' for r in ratios)} | |",
        ]
    )
    print(f"\nLoRA against full fine-tuning, 42M-parameter Llama, {STEPS} GRPO steps:\n{table}")
    out = ROOT / "outputs" / "benchmarks"
    out.mkdir(parents=True, exist_ok=True)
    (out / "lora.md").write_text(table + "\n")
    assert max(m for _, m in lora) < min(m for _, m in full)  # gradients and Adam moments of the base weights saved
