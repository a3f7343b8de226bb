"""What each of the seed's memory/throughput knobs buys, measured in one run on a small model on CPU.

Every knob runs in its own process (benchmarks/knob_probe.py) on the same ragged mini-batch, on the model shape where
its effect lives (gradient checkpointing on an activation-heavy model, the rest on an LM-head-heavy one); the table
(peak memory above the pre-pass level, tokens/s, token positions computed per real token) is printed and written to
``outputs/benchmarks/knobs.md``. Asserted, as ratios within this one run, are the directions that are stable on a
2-core machine: gradient checkpointing lowers the update's peak memory (by 20% at least), packing computes no padding,
dynamic batch size lowers the log-prob pass's peak (by 20% at least), entropy chunking lowers it too (on a miss
that pair is probed again, up to twice, and each side's lowest peak compared: noise only raises peaks). Tokens/s are
reported, not asserted: they move by about 15% between runs here, as much as packing gains on this batch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.long  # about 3 minutes on 2 cores: left out of scripts/test.sh, run with -m long

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "benchmarks" / "knob_probe.py"
ENTROPY = ("actor_rollout_ref.actor.entropy_coeff=0.01",)
BASELINE = "baseline (padded, 8 rows per micro-batch)"
DEEP_BASELINE = "deep model: baseline"
ENTROPY_BASELINE = "entropy bonus (baseline for the two below)"
KNOBS = {  # name -> (model shape, overrides); each group is compared with its own baseline
    BASELINE: ("head", ()),
    "use_remove_padding": ("head", ("actor_rollout_ref.model.use_remove_padding=true",)),
    "use_dynamic_bsz (padded, 2048-token budget)": (
        "head",
        ("actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2048"),
    ),
    ENTROPY_BASELINE: ("head", ENTROPY),
    "entropy_checkpointing": ("head", (*ENTROPY, "actor_rollout_ref.actor.entropy_checkpointing=true")),
    "entropy_from_logits_with_chunking": (
        "head",
        (  # the probe's log-prob pass is the actor's (old log-probs): its own key, as verl's
            *ENTROPY,
            "actor_rollout_ref.actor.entropy_from_logits_with_chunking=true",
            "actor_rollout_ref.ref.entropy_from_logits_with_chunking=true",
        ),
    ),
    DEEP_BASELINE: ("deep", ()),
    "deep model: enable_gradient_checkpointing": (
        "deep",
        ("actor_rollout_ref.model.enable_gradient_checkpointing=true",),
    ),
}


def probe(name: str, shape: str, overrides: tuple[str, ...]) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    out = subprocess.run(
        [sys.executable, str(PROBE), name, shape, *overrides],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=900,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def table(results: dict[str, dict]) -> str:
    lines = [
        "| knob | update: peak MB | tokens/s | log-prob pass: peak MB | tokens/s | positions computed per real token |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        base = results[DEEP_BASELINE if r["shape"] == "deep" else BASELINE]

        def cell(key: str, fmt: str, r: dict = r, base: dict = base) -> str:
            return f"{format(r[key], fmt)} ({r[key] / base[key]:.2f}x)"

        lines.append(
            f"| {name} | {cell('update_peak_mb', '.0f')} | {cell('update_tokens_per_s', '.0f')} | "
            f"{cell('log_prob_peak_mb', '.0f')} | {cell('log_prob_tokens_per_s', '.0f')} | "
            f"{r['computed_positions'] / r['real_tokens']:.2f} |"
        )
    return "\n".join(lines)


def test_knobs(benchmark):
    results: dict[str, dict] = {}
    benchmark.pedantic(
        lambda: results.update({name: probe(name, *spec) for name, spec in KNOBS.items()}), rounds=1, iterations=1
    )
    text = table(results)
    out = ROOT / "outputs" / "benchmarks"
    out.mkdir(parents=True, exist_ok=True)
    (out / "knobs.md").write_text(text + "\n", encoding="utf-8")
    print("\n" + text)
    benchmark.extra_info["knobs"] = results
    base = results[BASELINE]
    deep_checkpointed = results["deep model: enable_gradient_checkpointing"]
    assert deep_checkpointed["update_peak_mb"] < 0.8 * results[DEEP_BASELINE]["update_peak_mb"]
    packed = results["use_remove_padding"]
    assert packed["computed_positions"] == packed["real_tokens"] < base["computed_positions"]
    # fixed-size micro-batches already group rows by length (about the same padding); the token budget keeps long
    # sequences out of one micro-batch: a lower log-prob peak
    assert results["use_dynamic_bsz (padded, 2048-token budget)"]["log_prob_peak_mb"] < 0.8 * base["log_prob_peak_mb"]
    assert lower_log_prob_peak(results, "entropy_from_logits_with_chunking", ENTROPY_BASELINE)


def lower_log_prob_peak(results: dict[str, dict], knob: str, baseline: str, retries: int = 2) -> bool:
    """Whether ``knob``'s log-prob peak is below ``baseline``'s. Noise only raises a peak (the allocator's state, a
    page fault more), so on a miss the pair is probed again, alternately, up to ``retries`` times, and each side's
    lowest peak is compared (a fresh clone once measured chunking 346 MB against 335 MB, where the runs before gave
    274 against 323)."""
    peaks = {name: [results[name]["log_prob_peak_mb"]] for name in (knob, baseline)}
    for _ in range(retries):
        if min(peaks[knob]) < min(peaks[baseline]):
            break
        for name in (baseline, knob):
            peaks[name].append(probe(name, *KNOBS[name])["log_prob_peak_mb"])
    print(f"log-prob peak, {knob}: {peaks[knob]} MB against {baseline}: {peaks[baseline]} MB")
    return min(peaks[knob]) < min(peaks[baseline])
