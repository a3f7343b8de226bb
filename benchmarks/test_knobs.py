"""What each of the seed's memory/throughput knobs buys, measured in one run on a small model on CPU.

Every knob runs in its own process (benchmarks/knob_probe.py) on the same ragged mini-batch; the table (peak memory
above the pre-pass level, tokens/s, token positions computed per real token) is printed and written to
``outputs/benchmarks/knobs.md``. The assertions are the expected directions, as ratios within this one run:
checkpointing lowers peak activation memory, packing raises tokens/s on ragged batches, dynamic batch size cuts
padding waste.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "benchmarks" / "knob_probe.py"
ENTROPY = ("actor_rollout_ref.actor.entropy_coeff=0.01",)
BASELINE = "baseline (padded, 8 rows per micro-batch)"
KNOBS = {
    "baseline (padded, 8 rows per micro-batch)": (),
    "use_remove_padding": ("actor_rollout_ref.model.use_remove_padding=true",),
    "use_dynamic_bsz (padded, 2048-token budget)": ("actor_rollout_ref.actor.use_dynamic_bsz=true",
                                                    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2048"),
    "enable_gradient_checkpointing": ("actor_rollout_ref.model.enable_gradient_checkpointing=true",),
    "entropy bonus (baseline for the two below)": ENTROPY,
    "entropy_checkpointing": (*ENTROPY, "actor_rollout_ref.actor.entropy_checkpointing=true"),
    "entropy_from_logits_with_chunking": (*ENTROPY, "actor_rollout_ref.ref.entropy_from_logits_with_chunking=true"),
}


def probe(name: str, overrides: tuple[str, ...]) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    out = subprocess.run([sys.executable, str(PROBE), name, *overrides], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=900, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def table(results: dict[str, dict]) -> str:
    base = results[BASELINE]
    lines = ["| knob | update: peak MB | tokens/s | log-prob pass: peak MB | tokens/s | positions computed per real token |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        def cell(key: str, fmt: str) -> str:
            return f"{format(r[key], fmt)} ({r[key] / base[key]:.2f}x)"
        lines.append(f"| {name} | {cell('update_peak_mb', '.0f')} | {cell('update_tokens_per_s', '.0f')} | "
                     f"{cell('log_prob_peak_mb', '.0f')} | {cell('log_prob_tokens_per_s', '.0f')} | "
                     f"{r['computed_positions'] / r['real_tokens']:.2f} |")
    return "\n".join(lines)


def test_knobs(benchmark):
    results: dict[str, dict] = {}
    benchmark.pedantic(lambda: results.update({name: probe(name, o) for name, o in KNOBS.items()}), rounds=1, iterations=1)
    text = table(results)
    out = ROOT / "outputs" / "benchmarks"
    out.mkdir(parents=True, exist_ok=True)
    (out / "knobs.md").write_text(text + "\n", encoding="utf-8")
    print("\n" + text)
    benchmark.extra_info["knobs"] = results
    base = results[BASELINE]
    assert results["enable_gradient_checkpointing"]["update_peak_mb"] < base["update_peak_mb"]
    assert results["use_remove_padding"]["update_tokens_per_s"] > base["update_tokens_per_s"]
    assert results["use_dynamic_bsz (padded, 2048-token budget)"]["computed_positions"] < base["computed_positions"]
    entropy = results["entropy bonus (baseline for the two below)"]
    assert results["entropy_from_logits_with_chunking"]["log_prob_peak_mb"] < entropy["log_prob_peak_mb"]
