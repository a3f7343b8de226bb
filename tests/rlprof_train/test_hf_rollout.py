"""The hf rollout's sampling loop samples exactly the tokens transformers ``generate`` samples from the same random
state, while computing less: one prefill per prompt (not per response) and no forward for rows that have ended; with
the trainer's keyed noise, a response's tokens depend on its key and the model only."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlprof_train.data import Example, arithmetic_rows, left_pad
from rlprof_train.models import load_causal_lm, load_tokenizer
from rlprof_train.tiny_model import create_tiny_model
from rlprof_train.workers.rollout import SamplingParams
from rlprof_train.workers.rollout.base import noise_key
from rlprof_train.workers.rollout.decode import KeyedNoise, Sampling, loop_applies, sample
from rlprof_train.workers.rollout.hf import HFRollout, _generate


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return create_tiny_model(tmp_path_factory.mktemp("model"), max_operand=60, sft_steps=40)  # 1-3 digit answers


@pytest.fixture(scope="module")
def prompts(model_dir):
    tokenizer = load_tokenizer(model_dir)
    rows = arithmetic_rows(12, 60, seed=3)
    ids = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
    ids[0] = ids[0][1:]  # prompts of different lengths: left padding in the batch
    return left_pad(ids, tokenizer.pad_token_id)


SETTINGS = [  # (temperature, top_p, top_k, max new tokens)
    (1.0, 1.0, -1, 6),
    (0.7, 0.9, 20, 8),
    (1.3, 1.0, 5, 12),
    (0.6, 0.5, -1, 3),
]


@pytest.mark.parametrize(("temperature", "top_p", "top_k", "length"), SETTINGS)
def test_the_loop_samples_the_tokens_generate_samples_and_leaves_the_same_random_state(
    model_dir, prompts, temperature, top_p, top_k, length
):
    model = load_causal_lm(model_dir).eval()
    tokenizer = load_tokenizer(model_dir)
    settings = Sampling(8, length, temperature, top_p, top_k, tokenizer.eos_token_id, tokenizer.pad_token_id)
    ids, mask = prompts
    assert loop_applies(model)
    torch.manual_seed(11)
    expected, _ = _generate(model, ids, mask, settings, False)
    expected_next = torch.rand(4)
    torch.manual_seed(11)
    got, _ = sample(model, ids, mask, settings)
    assert torch.equal(got, expected)
    assert torch.equal(torch.rand(4), expected_next)  # the same draws were consumed
    ends = {row.index(tokenizer.eos_token_id) if tokenizer.eos_token_id in row else length for row in got.tolist()}
    assert len(ends) > 1, "rows end at different steps: the loop dropped rows from the batch as they ended"


def test_greedy_gives_n_equal_rows_per_prompt_as_generate(model_dir, prompts):
    model = load_causal_lm(model_dir).eval()
    tokenizer = load_tokenizer(model_dir)
    settings = Sampling(3, 5, 0.0, 1.0, -1, tokenizer.eos_token_id, tokenizer.pad_token_id)
    ids, mask = prompts
    got, _ = sample(model, ids, mask, settings)
    assert torch.equal(got, _generate(model, ids, mask, settings, False)[0])
    assert torch.equal(got[0::3], got[1::3])


def test_each_prompt_is_prefilled_once_and_ended_rows_are_not_computed(model_dir, prompts):
    model = load_causal_lm(model_dir).eval()
    tokenizer = load_tokenizer(model_dir)
    rows_seen: list[int] = []
    model.register_forward_pre_hook(lambda _m, _a, kw: rows_seen.append(kw["input_ids"].shape[0]), with_kwargs=True)
    ids, mask = prompts
    torch.manual_seed(0)
    tokens, _ = sample(model, ids, mask, Sampling(8, 6, 1.0, 1.0, -1, tokenizer.eos_token_id, tokenizer.pad_token_id))
    assert rows_seen[0] == ids.shape[0]  # 12 prompts prefilled, not 96 responses
    still_running = [int((~(tokens[:, :step] == tokenizer.eos_token_id).any(1)).sum()) for step in range(1, 6)]
    assert rows_seen[1:] == still_running[: len(rows_seen) - 1]  # each decode step computes the unfinished rows
    assert rows_seen[-1] < 96


@pytest.mark.parametrize(
    ("field", "value"), [("min_p", 0.1), ("suppress_tokens", [5]), ("no_repeat_ngram_size", 2), ("top_k", 50)]
)
def test_the_loop_declines_a_generation_config_asking_for_other_processing(model_dir, field, value):
    model = load_causal_lm(model_dir).eval()
    setattr(model.generation_config, field, value)
    # top_k is the rollout's own setting (rollout.top_k overrides the model's), the others are not the loop's
    assert loop_applies(model) == (field == "top_k")


def test_a_generation_config_asking_for_more_is_sampled_by_generate(model_dir, prompts):
    model = load_causal_lm(model_dir).eval()
    tokenizer = load_tokenizer(model_dir)
    model.generation_config.repetition_penalty = 1.3
    assert not loop_applies(model)
    rollout = HFRollout(lambda: model, tokenizer, zero_stage=1, micro_batch_size=None, device=torch.device("cpu"))
    ids, mask = prompts
    examples = [
        Example(i, tuple(row[m.bool()].tolist()), "x", "0") for i, (row, m) in enumerate(zip(ids, mask, strict=True))
    ]
    sampling = SamplingParams(2, 1.0, 1.0, -1, 4)
    torch.manual_seed(2)
    batch = rollout.generate(examples, sampling)
    settings = Sampling(2, 4, 1.0, 1.0, -1, tokenizer.eos_token_id, tokenizer.pad_token_id)
    torch.manual_seed(2)
    expected, _ = _generate(model, *prompts, settings, False)  # generate applies the penalty
    width = expected.shape[1]
    kept = batch.response_mask[:, :width]
    assert torch.equal(batch.responses[:, :width] * kept, expected * kept)


def test_the_loop_times_each_request_and_the_share_of_row_steps_that_sample_a_token(model_dir, prompts):
    from rlprof_train.workers.rollout.engine_stats import engine_metrics

    model = load_causal_lm(model_dir).eval()
    rollout = HFRollout(
        lambda: model, load_tokenizer(model_dir), zero_stage=1, micro_batch_size=4, device=torch.device("cpu")
    )
    ids, mask = prompts
    examples = [
        Example(i, tuple(row[m.bool()].tolist()), "x", "0") for i, (row, m) in enumerate(zip(ids, mask, strict=True))
    ]
    torch.manual_seed(3)
    batch = rollout.generate(examples, SamplingParams(2, 1.0, 1.0, -1, 8))
    requests = batch.extras["engine_requests"]
    lengths = batch.response_mask.sum(1).tolist()  # [12 prompts x 2], EOS included
    assert len(requests) == 12 and [r.prompt_tokens for r in requests] == [len(e.prompt_ids) for e in examples]
    for chunk in range(3):  # micro-batches of 4 prompts: one first token for each, after the earlier one's end
        own = requests[4 * chunk : 4 * chunk + 4]
        assert len({r.ttft_s for r in own}) == 1
        if chunk:
            assert own[0].ttft_s > max(r.total_s for r in requests[: 4 * chunk])
    for i, request in enumerate(requests):  # the last token is the longest response's
        steps = max(lengths[2 * i : 2 * i + 2])
        spent = request.total_s - request.ttft_s
        assert spent == pytest.approx(request.itl_s * (steps - 1)) if steps > 1 else request.itl_s is None
        assert request.queue_s is None and request.preemptions is None and request.cached_tokens is None
    sampled, row_steps = batch.extras["engine_occupancy"]
    chunk_steps = [max(lengths[8 * c : 8 * c + 8]) for c in range(3)]
    assert sampled == sum(lengths) and row_steps == sum(8 * steps for steps in chunk_steps)
    metrics = engine_metrics(requests, (sampled, row_steps))
    assert metrics["rollout/engine/batch_occupancy"] == pytest.approx(sum(lengths) / row_steps)
    assert metrics["rollout/slowest_response_s"] == max(r.total_s for r in requests)
    assert {"rollout/engine/ttft_ms_p50", "rollout/engine/itl_ms_p99"} <= set(metrics)
    assert not {"queue_time_ms_p50", "num_preemptions", "prefix_cache_hit_rate"} & {
        k.removeprefix("rollout/engine/") for k in metrics
    }  # the hf rollout has no queue, preemption or prefix cache


@pytest.mark.parametrize("pad_id", [0, 2])  # 2: a tokenizer without a pad token pads with EOS
def test_responses_are_cut_after_their_first_eos_and_padded_to_the_response_length(pad_id):
    from rlprof_train.workers.rollout.base import build_rollout_batch

    eos = 2
    generated = [[5, 6, 7, 8, 9, 10], [5, eos, 7, eos], [], [eos], [5, 6], [5, 6, 7, eos, 9]]
    prompts = [Example(i, (9,) * (1 + i % 2), "x", "0") for i in range(3)]
    batch = build_rollout_batch(prompts, generated, SamplingParams(2, 1.0, 1.0, -1, 4), pad_id, eos)
    expected = []
    for ids in generated:  # the rule, written out: up to the length, cut after the first EOS (kept)
        ids = ids[:4]
        ids = ids[: ids.index(eos) + 1] if eos in ids else ids
        expected.append((ids + [pad_id] * 4)[:4])
    assert batch.responses.tolist() == expected
    assert batch.response_mask.tolist() == [
        [1] * min(len(e), 4) + [0] * (4 - min(len(e), 4))
        for e in ([5, 6, 7, 8], [5, eos], [], [eos], [5, 6], [5, 6, 7, eos])
    ]
    assert batch.prompt_length == 2 and batch.attention_mask[:, :2].tolist()[0] == [0, 1]


@pytest.mark.parametrize("penalty", [None, 1.3])  # the loop, or generate for a config asking for more
def test_asked_for_them_the_rollout_returns_each_tokens_log_prob_under_the_distribution_it_was_drawn_from(
    model_dir, prompts, penalty
):
    """What a rollout correction compares with the trainer's log-probs (verl's ``processed_logprobs``): without
    other processing, exactly the actor's full forward at the sampling temperature."""
    from rlprof_train.models import response_log_probs

    model = load_causal_lm(model_dir).eval()
    if penalty:
        model.generation_config.repetition_penalty = penalty
    tokenizer = load_tokenizer(model_dir)
    rollout = HFRollout(lambda: model, tokenizer, 1, None, torch.device("cpu"), log_probs=True)
    ids, mask = prompts
    examples = [
        Example(i, tuple(row[m.bool()].tolist()), "x", "0") for i, (row, m) in enumerate(zip(ids, mask, strict=True))
    ]
    torch.manual_seed(4)
    batch = rollout.generate(examples, SamplingParams(2, 0.7, 1.0, -1, 8))
    sampled = batch.extras["rollout_log_probs"]
    with torch.no_grad():
        actor, _ = response_log_probs(model, batch.input_ids, batch.attention_mask, batch.response_length, 0.7)
    on = batch.response_mask.bool()
    assert (sampled[~on] == 0).all() and (sampled[on] < 0).all()
    if penalty is None:
        torch.testing.assert_close(sampled, actor * batch.response_mask, atol=1e-4, rtol=1e-4)
    else:  # the penalty moved the distribution sampled from away from the model's own
        assert (sampled[on] - actor[on]).abs().max() > 1e-3
    assert (
        "rollout_log_probs"
        not in HFRollout(lambda: model, tokenizer, 1, None, torch.device("cpu"))
        .generate(examples[:2], SamplingParams(2, 0.7, 1.0, -1, 4))
        .extras
    )  # not asked: not computed


def test_keyed_noise_is_exponential_and_a_rows_noise_depends_on_its_key_alone():
    """The trainer's noise (``KeyedNoise``): Exp(1) (Kolmogorov-Smirnov distance within the 99.9% bound of its sample
    size), unrelated between neighbouring keys, and a row's draws the same whatever the other rows of its batch or
    which of them still draw."""
    keys = [noise_key(7, row) for row in range(64)]
    cpu = torch.device("cpu")
    noise = KeyedNoise(keys, cpu).draw(range(64), 4096, torch.float32, cpu)  # [64, 4096]
    values = noise.flatten().double().sort().values
    size = values.numel()
    expected = 1 - torch.exp(-values)
    distance = torch.maximum(
        (torch.arange(1, size + 1) / size - expected).abs().max(), (torch.arange(size) / size - expected).abs().max()
    )
    assert distance < 1.95 / size**0.5
    correlation = torch.corrcoef(torch.stack([noise[:-1].flatten(), noise[1:].flatten()]))[0, 1]
    assert abs(correlation) < 4 / noise[1:].numel() ** 0.5
    alone = KeyedNoise(keys[5:6], cpu)
    together = KeyedNoise(keys, cpu)
    for step in range(3):  # rows 0-4 stop drawing after step 0: row 5's draws stay its own
        drawing = range(64) if step == 0 else range(5, 64)
        mine = together.draw(drawing, 100, torch.float32, cpu)[5 - drawing[0]]
        assert torch.equal(alone.draw(range(1), 100, torch.float32, cpu)[0], mine)


def test_a_responses_tokens_depend_on_its_prompts_key_not_on_the_batch_chunk_or_random_state(model_dir, prompts):
    """What makes a run's samples independent of its world size and pool split: prompt ``p`` of a round gets the
    same responses sampled with all the prompts, one at a time (micro-batches of 1), or among others in another
    order, whatever torch's random state; another round's seed gives other responses."""
    model = load_causal_lm(model_dir).eval()
    tokenizer = load_tokenizer(model_dir)
    ids, mask = prompts
    examples = [
        Example(i, tuple(row[m.bool()].tolist()), "x", "0") for i, (row, m) in enumerate(zip(ids, mask, strict=True))
    ]
    sampling = SamplingParams(4, 1.0, 1.0, -1, 10, seed=noise_key(1, 5))

    def responses(rollout: HFRollout, chosen: list[Example], sampling: SamplingParams) -> dict[tuple[int, int], list]:
        batch = rollout.generate(chosen, sampling)
        rows = (batch.responses * batch.response_mask).tolist()
        return {(e.index, j): rows[i * sampling.n + j] for i, e in enumerate(chosen) for j in range(sampling.n)}

    whole = HFRollout(lambda: model, tokenizer, 1, None, torch.device("cpu"))
    torch.manual_seed(1)
    together = responses(whole, examples, sampling)
    torch.manual_seed(2)
    one_by_one = responses(HFRollout(lambda: model, tokenizer, 1, 1, torch.device("cpu")), examples, sampling)
    torch.manual_seed(3)
    others = responses(whole, examples[::-3], sampling)
    assert one_by_one == together
    assert others == {key: together[key] for key in others}
    assert len({tuple(together[(0, j)]) for j in range(4)}) > 1  # a prompt's n responses differ
    another_round = responses(whole, examples, dataclasses.replace(sampling, seed=noise_key(1, 6)))
    assert sum(another_round[key] != together[key] for key in together) > len(together) // 2
