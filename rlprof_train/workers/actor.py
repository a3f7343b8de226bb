"""The actor: a DeepSpeed engine around the policy; recomputes rollout log-probs and runs PPO updates."""

from __future__ import annotations

from typing import Any

import torch

import rlprof
from rlprof.metrics import MetricAggregator, Reduce
from rlprof_train import algos
from rlprof_train.batch import RolloutBatch, gather_rows, micro_batch, micro_batches
from rlprof_train.models import load_causal_lm, response_log_probs
from rlprof_train.workers.engine import (DistEnv, activation_offload, loss_counts, make_engine, mini_batches,
                                         optimizer_step)


class ActorWorker:
    """Owns the policy's engine. ``cfg`` is ``actor_rollout_ref``."""

    def __init__(self, cfg: Any, model_path: str, env: DistEnv) -> None:
        self.cfg = cfg
        self.actor_cfg = cfg.actor
        self.env = env
        model = load_causal_lm(model_path, cfg.model.dtype, cfg.model.enable_gradient_checkpointing)
        offload = self.actor_cfg.fsdp_config.offload_policy
        self.engine = make_engine(
            model, self.actor_cfg.optim, zero_stage=self.actor_cfg.zero_stage,
            offload_optimizer=self.actor_cfg.offload_optimizer or offload,
            offload_param=self.actor_cfg.offload_param or offload, grad_clip=self.actor_cfg.grad_clip,
            dtype=cfg.model.dtype, world_size=env.world_size)
        self.temperature = cfg.rollout.temperature

    @property
    def module(self) -> Any:
        return self.engine.module

    def _log_probs(self, batch: RolloutBatch, with_entropy: bool) -> tuple[torch.Tensor, Any]:
        return response_log_probs(
            self.engine, batch.input_ids, batch.attention_mask, batch.response_length, self.temperature,
            with_entropy=with_entropy, chunked_entropy=self.cfg.ref.entropy_from_logits_with_chunking,
            checkpoint_entropy=self.actor_cfg.entropy_checkpointing, packed=self.cfg.model.use_remove_padding)

    @torch.no_grad()
    def compute_log_prob(self, batch: RolloutBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """Log-probs ``[B, R]`` of the sampled responses under the current policy, and ``actor/entropy``."""
        log_probs, entropies = [], []
        packed = self.cfg.model.use_remove_padding
        for rows in micro_batches(batch, self.actor_cfg.use_dynamic_bsz, self.cfg.rollout.log_prob_micro_batch_size_per_gpu,
                                  self.actor_cfg.ppo_max_token_len_per_gpu, packed):
            lp, entropy = self._log_probs(micro_batch(batch, rows, packed), with_entropy=True)
            log_probs.append((rows, lp))
            entropies.append((rows, entropy))
        out = gather_rows(log_probs, batch.size, batch.response_length)
        entropy = gather_rows(entropies, batch.size, batch.response_length)
        return out, {"actor/entropy": algos.masked_mean(entropy, batch.response_mask).item()}

    def update(self, batch: RolloutBatch, n: int) -> dict[str, float]:
        """PPO epochs over ``batch``: one optimizer step per mini-batch of ``ppo_mini_batch_size`` prompts."""
        cfg = self.actor_cfg
        agg = MetricAggregator()
        mini_size = cfg.ppo_mini_batch_size * n // self.env.world_size
        for rows in mini_batches(batch.size, mini_size, cfg.ppo_epochs, cfg.shuffle, seed=batch.uid[0]):
            agg.add("actor/pg_loss", self.accumulate_gradients(batch.select(rows), agg), Reduce.MEAN)
            optimizer_step(self.engine, "actor", agg)
        return agg.compute()

    def accumulate_gradients(self, mini: RolloutBatch, agg: MetricAggregator) -> float:
        """Forward/backward every micro-batch of ``mini`` (no optimizer step); returns the mini-batch's loss.

        Losses are normalised by the mini-batch's global token/sequence counts, so the accumulated gradient is the
        same however the mini-batch is cut (fixed micro-batch size or token budget)."""
        cfg = self.actor_cfg
        counts = loss_counts(mini.response_mask, self.env.world_size)
        packed = self.cfg.model.use_remove_padding
        return sum(self._micro_step(micro_batch(mini, rows, packed), counts, agg)
                   for rows in micro_batches(mini, cfg.use_dynamic_bsz, cfg.ppo_micro_batch_size_per_gpu,
                                             cfg.ppo_max_token_len_per_gpu, packed))

    @rlprof.profiled(role="actor", name="micro_batch_forward_backward")
    def _micro_step(self, micro: RolloutBatch, counts: dict, agg: MetricAggregator) -> float:
        cfg = self.actor_cfg
        mask = micro.response_mask
        with activation_offload(self.cfg.model.enable_activation_offload):
            log_probs, entropy = self._log_probs(micro, with_entropy=cfg.entropy_coeff != 0)
            result = algos.policy_loss(
                micro.old_log_probs, log_probs, micro.advantages, mask, clip_ratio=cfg.clip_ratio,
                clip_ratio_low=cfg.clip_ratio_low, clip_ratio_high=cfg.clip_ratio_high, clip_ratio_c=cfg.clip_ratio_c,
                loss_agg_mode=cfg.loss_agg_mode, **counts)
            loss = result.pg_loss
            if entropy is not None:
                loss = loss - cfg.entropy_coeff * algos.agg_loss(entropy, mask, cfg.loss_agg_mode, **counts)
            if cfg.use_kl_loss:
                kl = algos.kl_loss(log_probs, micro.ref_log_probs, mask, cfg.kl_loss_type, cfg.loss_agg_mode, **counts)
                loss = loss + cfg.kl_loss_coef * kl
                with torch.no_grad():  # the metric: this micro-batch's token-mean KL estimate
                    kl_mean = algos.masked_mean(algos.kl_penalty(log_probs, micro.ref_log_probs, cfg.kl_loss_type), mask)
                agg.add("actor/kl_loss", kl_mean.item(), Reduce.WEIGHTED_MEAN, float(mask.sum()))
            # DeepSpeed averages gradients over ranks; the loss is already normalised by the global counts.
            self.engine.backward(loss * self.env.world_size, scale_wrt_gas=False)
        tokens = float(mask.sum())
        for key, value in (("actor/pg_clipfrac", result.pg_clipfrac), ("actor/pg_clipfrac_lower", result.pg_clipfrac_lower),
                           ("actor/ppo_kl", result.ppo_kl)):
            agg.add(key, value.item(), Reduce.WEIGHTED_MEAN, tokens)
        return result.pg_loss.item()
