"""The seed's memory/throughput knobs change cost, not results: packed == padded, token-budget micro-batches ==
fixed ones, gradient checkpointing == plain, each checked on the real model (and the real DeepSpeed actor)."""

from __future__ import annotations

import pytest
import torch

from rlprof.metrics import MetricAggregator
from rlprof_train import algos
from rlprof_train.batch import RolloutBatch, pack, padded_budget_micro_batches, token_budget_micro_batches
from rlprof_train.config.load import load_trainer_config
from rlprof_train.models import ValueModel, load_causal_lm, response_log_probs
from rlprof_train.tiny_model import build_tiny_llama, build_tokenizer

from conftest import world_of_one


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("model")
    tokenizer = build_tokenizer([f"{a}+{b}={a + b}" for a in range(20) for b in range(20)])
    build_tiny_llama(tokenizer, seed=3).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def ragged_batch(seed: int = 0, rows: int = 6, prompt: int = 7, response: int = 9) -> RolloutBatch:
    """Left-padded prompts and right-padded responses of very different lengths."""
    g = torch.Generator().manual_seed(seed)
    prompt_lengths = torch.randint(1, prompt + 1, (rows,), generator=g)
    response_lengths = torch.randint(1, response + 1, (rows,), generator=g)
    prompt_lengths[0], response_lengths[0] = prompt, response  # one row with no padding at all
    ids = torch.randint(4, 250, (rows, prompt + response), generator=g)  # the tokenizer has >= 260 tokens
    mask = torch.zeros_like(ids)
    for r in range(rows):
        mask[r, prompt - prompt_lengths[r] : prompt + response_lengths[r]] = 1
    ids = ids * mask  # pad id 0
    response_mask = mask[:, prompt:]
    return RolloutBatch(
        ids,
        mask,
        response_mask,
        prompt,
        uid=[r // 2 for r in range(rows)],
        data_source=["x"] * rows,
        ground_truth=["0"] * rows,
        old_log_probs=torch.randn(rows, response, generator=g) * 0.1 - 2,
        ref_log_probs=torch.randn(rows, response, generator=g) * 0.1 - 2,
        advantages=torch.randn(rows, response, generator=g) * response_mask,
    )


def test_pack_layout():
    ids = torch.tensor([[0, 5, 6, 7, 0], [8, 9, 1, 2, 3]])
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    layout = pack(ids, mask, response_length=2)  # prompts [5, 6] and [8, 9, 1]; responses [7] and [2, 3]
    assert layout.ids.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3]]
    assert layout.positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]
    assert layout.rows.tolist() == [0, 1, 1] and layout.cols.tolist() == [0, 0, 1]
    assert layout.predicts.tolist() == [1, 5, 6]  # the logit before each response token


def test_packed_log_probs_entropy_and_gradients_equal_padded(model_dir):
    model = load_causal_lm(model_dir)
    batch = ragged_batch()
    results = {}
    for packed in (False, True):
        model.zero_grad()
        lp, entropy = response_log_probs(
            model,
            batch.input_ids,
            batch.attention_mask,
            batch.response_length,
            temperature=0.8,
            with_entropy=True,
            packed=packed,
        )
        loss = algos.policy_loss(batch.old_log_probs, lp, batch.advantages, batch.response_mask).pg_loss
        loss.backward()
        results[packed] = (
            lp.detach(),
            entropy.detach(),
            loss.detach(),
            torch.cat([p.grad.flatten() for p in model.parameters()]),
        )
    for padded_value, packed_value in zip(results[False], results[True], strict=False):
        torch.testing.assert_close(packed_value, padded_value, atol=2e-5, rtol=1e-4)
    assert results[True][0][batch.response_mask == 0].abs().sum() == 0


def test_packed_values_equal_padded(model_dir):
    critic = ValueModel(model_dir)
    torch.nn.init.normal_(critic.value_head.weight)  # a non-zero head, so the comparison means something
    batch = ragged_batch(seed=1)
    padded = critic.response_values(batch.input_ids, batch.attention_mask, batch.response_length)
    packed = critic.response_values(batch.input_ids, batch.attention_mask, batch.response_length, packed=True)
    torch.testing.assert_close(packed, padded, atol=2e-5, rtol=1e-4)
    assert padded.abs().sum() > 0


def test_token_budget_micro_batches_are_balanced_and_within_budget():
    lengths = [50, 10, 40, 30, 20, 60, 5, 45]
    bins = token_budget_micro_batches(lengths, budget=100)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in b) for b in bins]
    assert all(load <= 100 for load in loads) and len(bins) == 3 and max(loads) - min(loads) <= 25
    with pytest.raises(ValueError, match="exceeds the micro-batch token budget ppo_max_token_len_per_gpu=40"):
        token_budget_micro_batches([50, 10], budget=40)


def test_padded_budget_groups_rows_of_similar_shape_and_trim_removes_their_padding():
    prompts, responses = [2, 6, 2, 6, 3, 5], [9, 1, 8, 2, 9, 1]
    bins = padded_budget_micro_batches(prompts, responses, budget=24)
    assert sorted(i for b in bins for i in b) == list(range(6))
    for b in bins:
        assert len(b) * (max(prompts[i] for i in b) + max(responses[i] for i in b)) <= 24
    assert [1, 3, 5] in bins  # the short responses travel together
    batch = ragged_batch(seed=4)
    trimmed = batch.select([1, 2]).trim_padding()
    assert trimmed.attention_mask[:, 0].any() and trimmed.response_mask[:, -1].any()
    assert trimmed.input_ids.shape[1] < batch.input_ids.shape[1]
    assert int(trimmed.attention_mask.sum()) == int(batch.select([1, 2]).attention_mask.sum())


@pytest.fixture(scope="module")
def dist_env():
    with world_of_one("cpu") as env:
        yield env


def actor_grads(model_dir, env, batch: RolloutBatch, *overrides: str, layer_calls: list | None = None) -> torch.Tensor:
    """The accumulated gradient of the real DeepSpeed actor; ``layer_calls`` receives one entry per forward of the
    first decoder layer (recomputation in backward shows up as extra calls)."""
    from rlprof_train.workers.actor import ActorWorker

    cfg = load_trainer_config(
        [
            "--config-name=demo",
            f"actor_rollout_ref.model.path={model_dir}",
            "actor_rollout_ref.actor.zero_stage=0",
            *overrides,
        ]
    )
    worker = ActorWorker(cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.model, str(model_dir), env)
    if layer_calls is not None:  # count executions (torch suppresses module hooks while recomputing)
        layer = worker.module.model.layers[0]
        forward = layer.forward
        layer.forward = lambda *args, **kwargs: (layer_calls.append(1), forward(*args, **kwargs))[1]
    worker.accumulate_gradients(batch, MetricAggregator())
    return torch.cat([p.grad.flatten() for p in worker.module.parameters()])


@pytest.mark.slow
def test_dynamic_batch_size_gives_the_fixed_micro_batch_gradient(model_dir, dist_env):
    batch = ragged_batch(seed=2, rows=8)
    fixed = actor_grads(model_dir, dist_env, batch, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3")
    dynamic = actor_grads(
        model_dir,
        dist_env,
        batch,
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=20",
    )
    whole = actor_grads(model_dir, dist_env, batch, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8")
    assert len(token_budget_micro_batches(batch.sequence_lengths().tolist(), 20)) > 3  # really several micro-batches
    torch.testing.assert_close(dynamic, fixed, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(fixed, whole, atol=1e-6, rtol=1e-4)


@pytest.mark.slow
def test_gradient_checkpointing_gives_the_plain_gradient(model_dir, dist_env):
    batch = ragged_batch(seed=3)
    plain = actor_grads(model_dir, dist_env, batch)
    calls_checkpointed, calls_plain = [], []
    checkpointed = actor_grads(
        model_dir,
        dist_env,
        batch,
        "actor_rollout_ref.model.enable_gradient_checkpointing=true",
        "actor_rollout_ref.actor.entropy_checkpointing=true",
        "actor_rollout_ref.actor.entropy_coeff=0.01",
        layer_calls=calls_checkpointed,
    )
    entropy_plain = actor_grads(
        model_dir, dist_env, batch, "actor_rollout_ref.actor.entropy_coeff=0.01", layer_calls=calls_plain
    )
    assert len(calls_checkpointed) == 2 * len(calls_plain) > 0  # checkpointing really recomputed every layer
    torch.testing.assert_close(checkpointed, entropy_plain, atol=1e-6, rtol=1e-4)
    assert not torch.allclose(plain, entropy_plain)  # the entropy term is really in the checkpointed run


@pytest.mark.slow
@pytest.mark.parametrize("entropy_coeff", ["0", "0.01"])
def test_reusing_on_policy_log_probs_gives_the_recomputed_loss_gradient_and_entropy(model_dir, dist_env, entropy_coeff):
    """``reuse_on_policy_log_probs`` skips the old-log-prob pass; on-policy the update is the same math: the same
    loss, gradient, entropy metric and clip fraction (0) as with the old log-probs recomputed beforehand."""
    from dataclasses import replace

    from rlprof_train.batch import MicroBatching
    from rlprof_train.workers.actor import ActorWorker

    batch = ragged_batch(seed=4, rows=8)
    outcomes = []
    for reuse in (False, True):
        cfg = load_trainer_config(
            [
                "--config-name=demo",
                f"actor_rollout_ref.model.path={model_dir}",
                "actor_rollout_ref.actor.zero_stage=0",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
                f"actor_rollout_ref.actor.entropy_coeff={entropy_coeff}",
            ]
        )
        worker = ActorWorker(cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.model, str(model_dir), dist_env)
        metrics = MetricAggregator()
        if reuse:
            mini = replace(batch, old_log_probs=None)
        else:
            old_log_probs, entropy_metrics = worker.compute_log_prob(batch, MicroBatching(5))
            metrics.merge(entropy_metrics)
            mini = replace(batch, old_log_probs=old_log_probs)
        loss = worker.accumulate_gradients(mini, metrics)
        grads = torch.cat([p.grad.flatten() for p in worker.module.parameters()])
        outcomes.append((loss, grads, metrics.compute()))
    (loss, grads, recomputed), (reused_loss, reused_grads, reused) = outcomes
    assert reused_loss == pytest.approx(loss, rel=1e-5, abs=1e-7)
    torch.testing.assert_close(reused_grads, grads, atol=1e-6, rtol=1e-4)
    assert reused["actor/entropy"] == pytest.approx(recomputed["actor/entropy"], rel=1e-5)
    assert reused["actor/pg_clipfrac"] == recomputed["actor/pg_clipfrac"] == 0.0
    assert reused["actor/ppo_kl"] == 0.0 and abs(recomputed["actor/ppo_kl"]) < 1e-6


def test_the_padded_pass_skips_the_last_position_and_the_prompts_head_and_computes_the_same(model_dir):
    """The padded pass runs the model on all positions but the last (which predicts nothing; under causal attention
    no earlier position sees it) and asks for the logits of the R positions that predict the response
    (``logits_to_keep``): log-probs, entropies, loss and gradients equal those of the model on every position with
    the head on all of them."""
    from rlprof_train.models import keeps_logits, position_ids

    model = load_causal_lm(model_dir)
    assert keeps_logits(model)
    batch = ragged_batch(seed=2)
    r = batch.response_length
    fed: list[tuple[int, int]] = []
    hook = model.model.embed_tokens.register_forward_hook(lambda _m, args, _out: fed.append(tuple(args[0].shape)))
    model.zero_grad()
    lp, entropy = response_log_probs(
        model, batch.input_ids, batch.attention_mask, r, temperature=0.7, with_entropy=True
    )
    hook.remove()
    assert fed == [(batch.input_ids.shape[0], batch.input_ids.shape[1] - 1)]
    algos.policy_loss(batch.old_log_probs, lp, batch.advantages, batch.response_mask).pg_loss.backward()
    kept = [lp.detach(), entropy.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])]

    model.zero_grad()
    logits = model(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=position_ids(batch.attention_mask)
    ).logits  # the model on all P+R positions, the head on all of them
    assert logits.shape[1] == batch.input_ids.shape[1]
    logits = logits[:, -r - 1 : -1] / 0.7
    full_lp = torch.log_softmax(logits, -1).gather(-1, batch.input_ids[:, -r:, None])[..., 0] * batch.response_mask
    full_entropy = algos.entropy_from_logits(logits) * batch.response_mask
    algos.policy_loss(batch.old_log_probs, full_lp, batch.advantages, batch.response_mask).pg_loss.backward()
    full = [full_lp.detach(), full_entropy.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])]
    for got, want in zip(kept, full, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_the_critics_padded_pass_skips_the_last_position_and_computes_the_same_values(model_dir):
    """V of the state before each response token needs every position but the last: the values equal those of the
    model on all positions."""
    from rlprof_train.models import position_ids

    critic = ValueModel(model_dir)
    torch.nn.init.normal_(critic.value_head.weight)
    batch = ragged_batch(seed=3)
    r = batch.response_length
    widths: list[int] = []
    critic.body.embed_tokens.register_forward_hook(lambda _m, args, _out: widths.append(args[0].shape[1]))
    values = critic.response_values(batch.input_ids, batch.attention_mask, r)
    full = critic(batch.input_ids, batch.attention_mask, position_ids(batch.attention_mask))
    assert widths == [batch.input_ids.shape[1] - 1, batch.input_ids.shape[1]]
    torch.testing.assert_close(values, full[:, -r - 1 : -1] * batch.response_mask, atol=1e-6, rtol=1e-5)
    assert values.abs().sum() > 0


def test_fixed_micro_batches_group_rows_of_similar_length_and_the_gradient_is_the_same(model_dir):
    """Fixed-size padded micro-batches hold rows of similar length (less padding computed); the accumulated
    gradient and the log-probs equal those of consecutive rows."""
    from rlprof_train.batch import MicroBatching, fixed_micro_batches, gather_rows

    model = load_causal_lm(model_dir)
    batch = ragged_batch(seed=4, rows=12)
    batching = MicroBatching(size=4)
    grouped = batching.rows(batch)
    assert sorted(i for rows in grouped for i in rows) == list(range(12)) and all(len(r) == 4 for r in grouped)

    def padded_cells(groups):
        return sum(batch.select(rows).trim_padding().input_ids.numel() for rows in groups)

    consecutive = fixed_micro_batches(12, 4)
    assert padded_cells(grouped) < padded_cells(consecutive)
    results = []
    for groups in (consecutive, grouped):
        model.zero_grad()
        parts = []
        for rows in groups:
            micro = batch.select(rows).trim_padding()
            lp, _ = response_log_probs(model, micro.input_ids, micro.attention_mask, micro.response_length)
            loss = algos.policy_loss(
                micro.old_log_probs,
                lp,
                micro.advantages,
                micro.response_mask,
                total_tokens=float(batch.response_mask.sum()),
            ).pg_loss
            loss.backward()
            parts.append((rows, lp.detach()))
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        results.append((gather_rows(parts, 12, batch.response_length), grads))
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(results[1][1], results[0][1], atol=1e-6, rtol=1e-5)


def optimizer_run(engine, batches: list[RolloutBatch], scales: list[float]) -> tuple[torch.Tensor, list[float]]:
    """One optimizer step per scale (two micro-batches of loss x scale each): the parameters after the last step
    and the gradient norm DeepSpeed reports at each."""
    norms = []
    for scale in scales:
        for batch in batches:
            lp, _ = response_log_probs(engine, batch.input_ids, batch.attention_mask, batch.response_length)
            engine.backward(-(lp * batch.advantages[:, None]).sum() * scale, scale_wrt_gas=False)
        engine.step()
        norms.append(float(engine.get_global_grad_norm()))
    return torch.cat([p.detach().flatten() for p in engine.module.parameters()]), norms


def test_zero_1_on_one_fp32_process_runs_as_stage_0_with_zero_1s_updates_and_gradient_norms(model_dir, dist_env):
    """What a one-process float32 run with ``zero_stage=1`` ran until now (a DeepSpeed ZeRO-1 engine) and what it
    runs now (stage 0, the optimizer clipping): the same parameters (bit for bit while nothing is clipped) and the
    same reported gradient norms, over a step below the clip and two above it."""
    import deepspeed

    from rlprof_train.config.schema import OptimConfig
    from rlprof_train.workers.engine import deepspeed_config, make_engine

    optim = OptimConfig(lr=1e-3, weight_decay=0.01, fused=False)
    batches = [ragged_batch(seed=7), ragged_batch(seed=8)]
    ours = make_engine(
        load_causal_lm(model_dir), optim, zero_stage=1, offload_optimizer=False, offload_param=False,
        grad_clip=1.0, dtype="float32", world_size=1,
    )  # fmt: skip
    module = load_causal_lm(model_dir)
    zero1, *_ = deepspeed.initialize(
        model=module,
        optimizer=torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.01, foreach=False),
        config=deepspeed_config(1, False, False, 1.0, "float32", 1, hidden_size=module.config.hidden_size),
    )
    assert (ours.zero_optimization_stage(), zero1.zero_optimization_stage()) == (0, 1)

    first = [optimizer_run(engine, batches, [1e-3]) for engine in (ours, zero1)]
    assert first[0][1][0] < 1.0  # not clipped
    assert torch.equal(first[0][0], first[1][0]) and first[0][1] == pytest.approx(first[1][1], rel=1e-6)
    later = [optimizer_run(engine, batches, [1.0, 3.0]) for engine in (ours, zero1)]
    assert min(later[0][1]) > 1.0  # clipped
    torch.testing.assert_close(later[0][0], later[1][0], atol=1e-6, rtol=1e-5)
    assert later[0][1] == pytest.approx(later[1][1], rel=1e-5)


def test_the_fused_adamw_kernel_gives_the_loops_update(model_dir, dist_env):
    """``optim.fused`` (the default) runs torch's fused AdamW kernel: after three clipped and unclipped steps the
    parameters equal those of torch's loop over the tensors (``optim.fused=false``) up to float rounding."""
    from rlprof_train.config.schema import OptimConfig
    from rlprof_train.workers.engine import make_engine

    defaults = load_trainer_config(["--config-name=demo"])
    assert defaults.actor_rollout_ref.actor.optim.fused and defaults.critic.optim.fused
    batches = [ragged_batch(seed=7), ragged_batch(seed=8)]
    results = []
    for fused in (True, False):
        engine = make_engine(
            load_causal_lm(model_dir), OptimConfig(lr=1e-3, weight_decay=0.01, fused=fused), zero_stage=0,
            offload_optimizer=False, offload_param=False, grad_clip=1.0, dtype="float32", world_size=1,
        )  # fmt: skip
        assert engine.optimizer.defaults["fused"] is fused
        results.append(optimizer_run(engine, batches, [1e-3, 1.0, 3.0]))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-6, rtol=1e-5)
    assert results[0][1] == pytest.approx(results[1][1], rel=1e-5)


def test_a_checkpoint_saved_by_zero_resumes_into_a_zero_engine(model_dir, dist_env, tmp_path):
    """Optimizer state saved by a ZeRO engine (one-process runs before ZeRO 1/2 ran as stage 0 there) loads only into
    ZeRO: a worker resuming such a checkpoint keeps ``zero_stage=1`` and gets the saved parameters; a stage-0
    engine's checkpoint holds no ZeRO state."""
    import deepspeed

    from rlprof_train import checkpoint
    from rlprof_train.workers.actor import ActorWorker
    from rlprof_train.workers.engine import deepspeed_config

    module = load_causal_lm(model_dir)
    zero1, *_ = deepspeed.initialize(
        model=module,
        optimizer=torch.optim.AdamW(module.parameters(), lr=1e-3),
        config=deepspeed_config(1, False, False, 1.0, "float32", 1, hidden_size=module.config.hidden_size),
    )
    trained, _ = optimizer_run(zero1, [ragged_batch(seed=7)], [1.0])
    saved = checkpoint.save(tmp_path / "zero", 1, {"actor": zero1}, {"kl_coef": 0.1}, True, lambda: None, None, {})
    assert checkpoint.saved_by_zero(saved, "actor") and not checkpoint.saved_by_zero(None, "actor")

    cfg = load_trainer_config(["--config-name=demo", f"actor_rollout_ref.model.path={model_dir}"])
    actor, model = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.model
    fresh = ActorWorker(actor, model, str(model_dir), dist_env)
    assert fresh.engine.zero_optimization_stage() == 0
    with pytest.raises(checkpoint.CheckpointError, match="the actor state does not load"):
        checkpoint.load(saved, {"actor": fresh.engine})
    stage0 = checkpoint.save(tmp_path / "stage0", 1, {"actor": fresh.engine}, {}, True, lambda: None, None, {})
    assert not checkpoint.saved_by_zero(stage0, "actor")

    resumed = ActorWorker(actor, model, str(model_dir), dist_env, zero_checkpoint=True)
    assert resumed.engine.zero_optimization_stage() == 1
    checkpoint.load(saved, {"actor": resumed.engine})
    assert torch.equal(torch.cat([p.detach().flatten() for p in resumed.module.parameters()]), trained)
