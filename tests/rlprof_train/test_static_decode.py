"""The hf rollout's compiled decode (``rollout.enforce_eager=false``): transformers' static cache and compiled forward
(``torch.compile`` runs on the CPU too), against the eager loop it replaces. From the same random state and weights it
samples the eager loop's tokens and log-probs; its shapes are bucketed so that calls with other prompt lengths or
counts reuse one compiled step; an optimizer's update of the weights is what the next call samples from."""

from __future__ import annotations

import pytest
import torch

from rlprof_train.data import Example, arithmetic_rows, left_pad
from rlprof_train.models import CompiledForward, load_causal_lm, load_tokenizer, response_log_probs
from rlprof_train.tiny_model import create_tiny_model
from rlprof_train.workers.rollout import SamplingParams
from rlprof_train.workers.rollout.base import noise_key
from rlprof_train.workers.rollout.decode import KeyedNoise, Sampling, sample
from rlprof_train.workers.rollout.hf import HFRollout
from rlprof_train.workers.rollout.static_decode import StaticDecoder, bucket, prompt_bucket


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return create_tiny_model(tmp_path_factory.mktemp("model"), max_operand=60, sft_steps=40)  # 1-3 digit answers


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def model(model_dir):
    """One model for the module: its compiled step is traced once per shape, as in a run."""
    return load_causal_lm(model_dir).eval()


@pytest.fixture(scope="module")
def decoder():
    return StaticDecoder(lambda line: None)


def shapes(decoder):
    """(rows, positions) of every shape ``decoder`` compiled, in order."""
    return [(rows, positions) for rows, positions, _dtype in decoder.compiled]


def prompts(tokenizer, count, seed=3, shorten_first=True):
    rows = arithmetic_rows(count, 60, seed=seed)
    ids = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
    if shorten_first:
        ids[0] = ids[0][1:]  # prompts of different lengths: left padding in the batch
    return left_pad(ids, tokenizer.pad_token_id)


def test_buckets_are_powers_of_two_from_16_and_prompt_counts_powers_of_two():
    assert [bucket(s) for s in (1, 16, 17, 33, 100, 128, 129)] == [16, 16, 32, 64, 128, 128, 256]
    assert [prompt_bucket(p) for p in (1, 2, 3, 12, 16, 17)] == [1, 2, 4, 16, 16, 32]


@pytest.mark.slow  # compiles (about 10 s on 2 cores): kept out of the quick loop, as the other compiling tests
@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k", "length"),
    [(1.0, 1.0, -1, 6), (0.7, 0.9, 20, 8), (1.3, 1.0, 5, 12), (0.0, 1.0, -1, 5)],
)
def test_it_samples_the_eager_loops_tokens_and_log_probs_from_the_same_random_state(
    model, tokenizer, decoder, temperature, top_p, top_k, length
):
    ids, mask = prompts(tokenizer, 12)
    settings = Sampling(8, length, temperature, top_p, top_k, tokenizer.eos_token_id, tokenizer.pad_token_id)
    torch.manual_seed(11)
    expected, expected_log_probs = sample(model, ids, mask, settings, with_log_probs=True)
    expected_next = torch.rand(4)
    torch.manual_seed(11)
    got, got_log_probs = decoder.sample(model, ids, mask, settings, with_log_probs=True)
    assert torch.equal(got, expected)
    assert expected_log_probs is not None and got_log_probs is not None
    torch.testing.assert_close(got_log_probs, expected_log_probs, rtol=0, atol=1e-5)
    assert torch.equal(torch.rand(4), expected_next)  # the same draws were consumed
    keys, cpu = [noise_key(5, row) for row in range(12 * 8)], torch.device("cpu")  # the trainer's keyed noise
    compiled, _ = decoder.sample(model, ids, mask, settings, keyed=KeyedNoise(keys, cpu))
    assert torch.equal(compiled, sample(model, ids, mask, settings, keyed=KeyedNoise(keys, cpu))[0])
    if temperature > 0:
        ends = {row.index(tokenizer.eos_token_id) if tokenizer.eos_token_id in row else -1 for row in got.tolist()}
        assert len(ends) > 1, "rows end at different steps: finished rows are padded while the others go on"


@pytest.mark.slow
def test_calls_within_a_bucket_reuse_the_compiled_step_and_a_new_bucket_compiles_once(model, tokenizer, decoder):
    settings = Sampling(8, 6, 1.0, 1.0, -1, tokenizer.eos_token_id, tokenizer.pad_token_id)
    decoder.sample(model, *prompts(tokenizer, 12), settings)  # 16 prompts x 8 rows, bucket(7 + 6) positions
    before = shapes(decoder)
    for count, seed in ((12, 4), (9, 5), (16, 6)):  # other prompts, other counts and widths, the same buckets
        decoder.sample(model, *prompts(tokenizer, count, seed, shorten_first=False), settings)
    assert shapes(decoder) == before
    decoder.sample(model, *prompts(tokenizer, 17), settings)  # 32 prompts: a new shape
    decoder.sample(model, *prompts(tokenizer, 20, seed=8), settings)
    assert shapes(decoder) == [*before, (32 * 8, 16)]


@pytest.mark.long  # CI time: in the test command's long runs
def test_more_shapes_than_torchs_recompile_limit_compile_beside_the_training_graphs(model_dir, tokenizer):
    """torch's recompile limit (8) counts every graph of the model class's forward: the compiled training passes'
    (with and without gradients) and each decode shape's. A run with validation and multi-turn contexts passes it, and
    a ``fullgraph`` compile past it fails. Here one training graph (the no-gradient one: a backward's compile costs
    more) and eight decode shapes."""
    model = load_causal_lm(model_dir).eval()
    with torch.no_grad():
        CompiledForward(model)(input_ids=torch.randint(0, 50, (2, 8)))
    lines: list[str] = []
    decoder = StaticDecoder(lines.append)
    for count in (1, 2, 4, 8):
        for length in (4, 20):  # 16 and 32 positions
            settings = Sampling(1, length, 1.0, 1.0, -1, tokenizer.eos_token_id, tokenizer.pad_token_id)
            decoder.sample(model, *prompts(tokenizer, count), settings, steps=3)
    assert shapes(decoder) == [(rows, positions) for rows in (1, 2, 4, 8) for positions in (16, 32)]
    assert len(lines) == 8 and lines[-1].startswith("rollout: compiled the decode step for 8 rows x 32 positions in ")
    assert torch._dynamo.config.recompile_limit == 64 and decoder.max_shapes == 32  # the documented figures


@pytest.mark.slow
def test_past_its_most_shapes_a_new_shape_decodes_eagerly_with_the_same_tokens_said_once(model, tokenizer):
    lines: list[str] = []
    decoder = StaticDecoder(lines.append, max_shapes=1)
    settings = Sampling(4, 6, 1.0, 1.0, -1, tokenizer.eos_token_id, tokenizer.pad_token_id)
    decoder.sample(model, *prompts(tokenizer, 4), settings)
    for count in (8, 16):  # new shapes: 8 and 16 prompts
        ids, mask = prompts(tokenizer, count)
        torch.manual_seed(5)
        expected, _ = sample(model, ids, mask, settings)
        torch.manual_seed(5)
        got, _ = decoder.sample(model, ids, mask, settings)
        assert torch.equal(got, expected)
    assert shapes(decoder) == [(16, 16)]
    assert lines[1:] == [
        "rollout: 1 decode shapes are compiled (the most kept); 32 rows x 16 positions and any other new shape "
        "decode eagerly"
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
        ),
    ],
)
def test_after_an_optimizer_step_it_samples_from_the_new_weights_as_the_eager_loop_does(model_dir, tokenizer, device):
    """On a GPU the compiled step is a CUDA graph: it must replay on the weights the optimizer updated in place."""
    model = load_causal_lm(model_dir, device=torch.device(device))
    decoder = StaticDecoder(lambda line: None)
    ids, mask = (t.to(device) for t in prompts(tokenizer, 12))
    greedy = Sampling(1, 6, 0.0, 1.0, -1, tokenizer.eos_token_id, tokenizer.pad_token_id)
    model.eval()
    before = decoder.sample(model, ids, mask, greedy)[0]
    assert torch.equal(before, sample(model, ids, mask, greedy)[0])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
    model.train()
    sequences = torch.cat([ids, before], dim=1)
    full_mask = torch.cat([mask, (before != tokenizer.pad_token_id).long()], dim=1)
    for _ in range(3):  # make the greedy answers less likely, in place (as the trainer's optimizer does)
        log_probs, _ = response_log_probs(model, sequences, full_mask, before.shape[1])
        optimizer.zero_grad()
        log_probs.sum().backward()
        optimizer.step()
    model.eval()
    after = decoder.sample(model, ids, mask, greedy)[0]
    assert not torch.equal(after, before)
    assert torch.equal(after, sample(model, ids, mask, greedy)[0])


@pytest.mark.slow  # builds its model (about 20 s)
def test_a_model_the_loop_does_not_sample_is_sampled_by_generate_uncompiled(model_dir, tokenizer):
    """A generation config asking for more (a repetition penalty) goes to ``generate``, eagerly: nothing to compile,
    said once, and the same samples as the eager rollout's."""
    model = load_causal_lm(model_dir).eval()
    model.generation_config.repetition_penalty = 1.3
    lines: list[str] = []
    device = torch.device("cpu")
    compiled = HFRollout(lambda: model, tokenizer, 1, None, device, compiled=True, log=lines.append)
    eager = HFRollout(lambda: model, tokenizer, 1, None, device)
    ids, mask = prompts(tokenizer, 6)
    rows = zip(ids, mask, strict=True)
    examples = [Example(i, tuple(row[m.bool()].tolist()), "x", "0") for i, (row, m) in enumerate(rows)]
    sampling = SamplingParams(2, 1.0, 1.0, -1, 4)
    assert not compiled.warm_up(examples, sampling)
    assert lines == [
        "rollout: enforce_eager=false compiles nothing: the model's generation config asks for more than the loop "
        "does, so generate samples it, eagerly"
    ]
    torch.manual_seed(2)
    got = compiled.generate(examples, sampling)
    torch.manual_seed(2)
    assert torch.equal(got.input_ids, eager.generate(examples, sampling).input_ids)
