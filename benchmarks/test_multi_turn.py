"""Multi-turn rollout speed against the single-turn rollout on the same prompts, model and backend (hf), measured in
one run, alternating the two.

The embedded calculator model's first turn is a tool call; the single-turn rollout stops there (its response is the
call). The multi-turn rollout then runs the calls, appends the replies and generates the answers: one more turn of
the batch. That turn costs a prefill over the whole conversation (no KV cache is kept between turns), the few answer
tokens, the tool calls (the calculator's own time is negligible) and the loop's own work (parsing, the tools'
lifecycle, tokenising the replies). Stated targets: the extra turn costs at most 1.5x the single-turn rollout
(ratio <= 2.5), and the loop's own work outside generation is at most a quarter of the multi-turn rollout."""

from __future__ import annotations

import statistics
import time

import torch

from rlprof_train.agent.tool_config import task_tools
from rlprof_train.config.schema import MultiTurnConfig
from rlprof_train.data import build_examples, calculator_rows
from rlprof_train.models import load_causal_lm, load_tokenizer
from rlprof_train.prepare import EMBEDDED_MODEL_DIR
from rlprof_train.tiny_model import ensure_tiny_model
from rlprof_train.workers.rollout.base import SamplingParams
from rlprof_train.workers.rollout.hf import HFRollout
from rlprof_train.workers.rollout.multi_turn import MultiTurnRollout

PROMPTS, SAMPLES, LENGTH, ROUNDS = 16, 8, 48, 5


def test_an_extra_turn_costs_at_most_one_and_a_half_single_turn_rollouts(speed_target):
    model_dir = ensure_tiny_model(EMBEDDED_MODEL_DIR, 9, "calculator")
    tokenizer = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir).eval()
    prompts, _ = build_examples(
        calculator_rows(PROMPTS, 9, 0),
        tokenizer,
        prompt_key="prompt",
        max_prompt_length=16,
        truncation="error",
        use_template="auto",
        source_name="benchmark",
    )
    sampling = SamplingParams(SAMPLES, 1.0, 1.0, -1, LENGTH)
    single = HFRollout(lambda: model, tokenizer, 0, None, torch.device("cpu"))
    multi = MultiTurnRollout(
        single, task_tools("calculator"), MultiTurnConfig(enable=True, max_assistant_turns=2), tokenizer
    )

    def timed(rollout):
        torch.manual_seed(0)
        start = time.perf_counter()
        batch = rollout.generate(prompts, sampling)
        return time.perf_counter() - start, batch

    timed(single), timed(multi)  # warm-up
    singles, multis, turns, generating = [], [], [], []
    for _ in range(ROUNDS):
        seconds, _ = timed(single)
        singles.append(seconds)
        seconds, batch = timed(multi)
        multis.append(seconds)
        records, (split,) = batch.extras["multi_turn"]["trajectories"], batch.extras["multi_turn"]["splits"]
        generating.append(split.generating_s / split.total_s)
        turns.append(statistics.mean((r.turns - 1 + 1) // 2 for r in records))  # generation turns per trajectory
    multi.close()
    ratios = [m / s for m, s in zip(multis, singles, strict=True)]
    extra_turns = statistics.mean(turns) - 1
    per_turn = (min(multis) - min(singles)) / max(extra_turns, 1e-9)
    print(
        f"\nmulti-turn vs single-turn, {PROMPTS} prompts x {SAMPLES}: single {min(singles) * 1e3:.0f} ms, multi "
        f"{min(multis) * 1e3:.0f} ms (best of {ROUNDS}), ratio {min(multis) / min(singles):.2f} "
        f"(per round {min(ratios):.2f}-{max(ratios):.2f}); {statistics.mean(turns):.2f} generation turns per "
        f"trajectory: {per_turn * 1e3:.0f} ms per extra turn of the batch; generating "
        f"{min(generating):.0%}-{max(generating):.0%} of the multi-turn rollout"
    )
    assert extra_turns > 0.5, "the model should call the tool and answer in most trajectories"
    multi_over_single = min(multis) / min(singles)
    speed_target(
        multi_over_single <= 2.5, f"multi-turn {multi_over_single:.2f}x a single-turn rollout (target <= 2.5x)"
    )
    share = statistics.median(generating)
    speed_target(share >= 0.75, f"generating {share:.0%} of the multi-turn rollout (target >= 75%)")
