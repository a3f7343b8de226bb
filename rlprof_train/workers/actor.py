"""The actor: a DeepSpeed engine around the policy; recomputes rollout log-probs and runs PPO updates."""

from __future__ import annotations

from typing import Any, Optional

import torch

import rlprof
from rlprof.metrics import MetricAggregator, Reduce
from rlprof_train import algos, rollout_correction
from rlprof_train.batch import MicroBatching, RolloutBatch
from rlprof_train.config.schema import ActorConfig, ModelConfig
from rlprof_train.models import CompiledForward, load_causal_lm, response_log_probs
from rlprof_train.rollout_correction import Correction
from rlprof_train.workers.engine import (
    DistEnv,
    activation_offload,
    loss_counts,
    make_engine,
    mini_batches,
    optimizer_step,
    set_learning_rate,
)
from rlprof_train.workers.log_prob import log_prob_pass


class ActorWorker:
    """Owns the policy's engine; reads only ``actor_rollout_ref.actor`` and ``.model``."""

    def __init__(
        self,
        cfg: ActorConfig,
        model: ModelConfig,
        model_path: str,
        env: DistEnv,
        zero_checkpoint: bool = False,
        correction: Optional[Correction] = None,
    ) -> None:
        """``zero_checkpoint``: the run resumes optimizer state saved by a ZeRO engine (see ``zero_stage_to_run``);
        ``correction``: the run's rollout correction, applied by the update in bypass mode (else its importance
        weights come with the batch, ``rollout_is_weights``)."""
        self.cfg = cfg
        self.correction = correction or Correction()
        self.model_cfg = model
        self.env = env
        module = load_causal_lm(
            model_path, model.dtype, model.enable_gradient_checkpointing, lora=model, overrides=model.override_config
        )
        offload = cfg.fsdp_config.offload_policy
        self.engine = make_engine(
            module,
            cfg.optim,
            zero_stage=cfg.zero_stage,
            offload_optimizer=cfg.offload_optimizer or offload,
            offload_param=cfg.offload_param or offload,
            grad_clip=cfg.grad_clip,
            dtype=model.dtype,
            world_size=env.world_size,
            zero_checkpoint=zero_checkpoint,
            overlap_comm=cfg.overlap_comm,
        )
        self.forward_model = CompiledForward(self.engine.module) if model.torch_compile else self.engine
        """What the log-prob and update passes call: the engine, or its module's compiled forward."""
        self.update_batching = MicroBatching(
            cfg.ppo_micro_batch_size_per_gpu,
            cfg.use_dynamic_bsz,
            cfg.ppo_max_token_len_per_gpu,
            model.use_remove_padding,
        )

    @property
    def module(self) -> Any:
        return self.engine.module

    def compute_log_prob(self, batch: RolloutBatch, batching: MicroBatching) -> tuple[torch.Tensor, MetricAggregator]:
        """Log-probs ``[B, R]`` of the sampled responses under the current policy, and ``actor/entropy``."""
        chunked = self.cfg.entropy_from_logits_with_chunking
        log_probs, entropy = log_prob_pass(self.forward_model, batch, batching, chunked)
        metrics = MetricAggregator()
        metrics.add(
            "actor/entropy",
            algos.masked_mean(entropy, batch.response_mask).item(),
            Reduce.WEIGHTED_MEAN,
            float(batch.response_mask.sum()),
        )
        return log_probs, metrics

    def update(self, batch: RolloutBatch, lr: Optional[float] = None) -> MetricAggregator:
        """PPO epochs over ``batch``: one optimizer step per mini-batch of ``ppo_mini_batch_size`` prompts, at the
        learning rate ``lr`` (the step's, :class:`~rlprof_train.lr_schedule.LRSchedule`; None: the optimizer's)."""
        cfg = self.cfg
        metrics = MetricAggregator()
        if lr is not None:
            set_learning_rate(self.engine, lr)
        mini_size = cfg.ppo_mini_batch_size * batch.n // self.env.world_size
        for i, rows in enumerate(mini_batches(batch.size, mini_size, cfg.ppo_epochs, cfg.shuffle, seed=batch.uid[0])):
            with rlprof.mini_batch(i, role="actor"):  # a torch schedule over mini-batches walks these (verl)
                share = self.accumulate_gradients(batch.select(rows), metrics)
                # this rank's share of the loss (normalised by the global counts) times the ranks: the mean over ranks
                # is the whole mini-batch's loss, whatever the ranks (verl sums it over its data-parallel ranks)
                metrics.add("actor/pg_loss", share * self.env.world_size, Reduce.MEAN)
                optimizer_step(self.engine, "actor", metrics)
        return metrics

    def accumulate_gradients(self, mini: RolloutBatch, metrics: MetricAggregator) -> float:
        """Forward/backward every micro-batch of ``mini`` (no optimizer step); returns the mini-batch's loss.

        Losses are normalised by the mini-batch's global token/sequence counts, so the accumulated gradient is the
        same however the mini-batch is cut (fixed micro-batch size or token budget)."""
        counts = loss_counts(mini.response_mask, self.env.world_size)
        return sum(self._micro_step(micro, counts, metrics) for _, micro in self.update_batching.split(mini))

    @rlprof.profiled(role="actor", name="micro_batch_forward_backward")
    def _micro_step(self, micro: RolloutBatch, counts: dict[str, float], metrics: MetricAggregator) -> float:
        cfg = self.cfg
        mask = micro.response_mask
        tokens = float(mask.sum())
        assert micro.advantages is not None, "run the earlier phases first"
        on_policy = micro.old_log_probs is None  # reuse_on_policy_log_probs: old = this forward's, detached
        with activation_offload(self.model_cfg.enable_activation_offload):
            log_probs, entropy = response_log_probs(
                self.forward_model,
                micro.input_ids,
                micro.attention_mask,
                micro.response_length,
                micro.temperature,
                with_entropy=cfg.entropy_coeff != 0 or on_policy,
                chunked_entropy=cfg.entropy_from_logits_with_chunking,
                checkpoint_entropy=cfg.entropy_checkpointing,
                entropy_grad=cfg.entropy_coeff != 0,
                packed=self.update_batching.packed,
            )
            if on_policy:
                assert entropy is not None
                metrics.add(
                    "actor/entropy", algos.masked_mean(entropy.detach(), mask).item(), Reduce.WEIGHTED_MEAN, tokens
                )
            old_log_probs = log_probs.detach() if micro.old_log_probs is None else micro.old_log_probs
            objective = algos.POLICY_LOSSES[cfg.policy_loss.loss_mode]
            is_weights, policy_mask = micro.rollout_is_weights, mask
            if self.correction.bypass:  # the old log-probs are the rollout's: correct against this forward (verl)
                is_weights, policy_mask, corrected = rollout_correction.correct(
                    log_probs.detach(),
                    old_log_probs,
                    mask,
                    self.correction,
                    self.env.sum,
                )
                metrics.merge(corrected)
                if self.correction.loss_type == "reinforce":
                    objective = algos.reinforce_policy_loss
                else:  # PPO's ratio against the rollout's policy is the correction: no weights on top
                    objective, is_weights = algos.policy_loss, None
            result = objective(
                old_log_probs,
                log_probs,
                micro.advantages,
                policy_mask,
                clip_ratio=cfg.clip_ratio,
                clip_ratio_low=cfg.clip_ratio_low,
                clip_ratio_high=cfg.clip_ratio_high,
                clip_ratio_c=cfg.clip_ratio_c,
                loss_agg_mode=cfg.loss_agg_mode,
                is_weights=is_weights,
                **counts,
            )
            loss = result.pg_loss
            if cfg.entropy_coeff != 0:
                assert entropy is not None
                loss = loss - cfg.entropy_coeff * algos.agg_loss(entropy, mask, cfg.loss_agg_mode, **counts)
            if cfg.use_kl_loss:
                assert micro.ref_log_probs is not None, "use_kl_loss needs the reference's log-probs"
                kl = algos.kl_loss(log_probs, micro.ref_log_probs, mask, cfg.kl_loss_type, cfg.loss_agg_mode, **counts)
                loss = loss + cfg.kl_loss_coef * kl
                with torch.no_grad():  # the metric: this micro-batch's token-mean KL estimate
                    kl_mean = algos.masked_mean(
                        algos.kl_penalty(log_probs, micro.ref_log_probs, cfg.kl_loss_type), mask
                    )
                metrics.add("actor/kl_loss", kl_mean.item(), Reduce.WEIGHTED_MEAN, float(mask.sum()))
            # DeepSpeed averages gradients over ranks; the loss is already normalised by the global counts.
            self.engine.backward(loss * self.env.world_size, scale_wrt_gas=False)
        for key, value in (
            ("actor/pg_clipfrac", result.pg_clipfrac),
            ("actor/pg_clipfrac_lower", result.pg_clipfrac_lower),
            ("actor/ppo_kl", result.ppo_kl),
        ):
            metrics.add(key, value.item(), Reduce.WEIGHTED_MEAN, tokens)
        return result.pg_loss.item()
