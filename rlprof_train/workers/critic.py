"""The critic: a DeepSpeed engine around the value model; predicts values and runs clipped value updates."""

from __future__ import annotations

from typing import Any

import torch

from rlprof.metrics import MetricAggregator, Reduce
from rlprof_train import algos
from rlprof_train.batch import RolloutBatch, gather_rows, micro_batch, micro_batches
from rlprof_train.models import ValueModel
from rlprof_train.workers.engine import (DistEnv, activation_offload, loss_counts, make_engine, mini_batches,
                                         optimizer_step)


class CriticWorker:
    """Owns the value model's engine. ``cfg`` is the whole trainer config."""

    def __init__(self, cfg: Any, model_path: str, env: DistEnv) -> None:
        self.cfg = cfg.critic
        self.model_cfg = cfg.actor_rollout_ref.model
        self.dynamic = cfg.actor_rollout_ref.actor.use_dynamic_bsz
        self.env = env
        module = ValueModel(model_path, self.model_cfg.dtype, self.model_cfg.enable_gradient_checkpointing)
        self.engine = make_engine(module, self.cfg.optim, zero_stage=self.cfg.zero_stage, offload_optimizer=False,
                                  offload_param=False, grad_clip=self.cfg.grad_clip, dtype=self.model_cfg.dtype,
                                  world_size=env.world_size)

    def _values(self, batch: RolloutBatch) -> torch.Tensor:
        """V of the state before each response token: ``[B, R]``."""
        return self.engine.module.response_values(batch.input_ids, batch.attention_mask, batch.response_length,
                                                  packed=self.model_cfg.use_remove_padding, forward=self.engine)

    @torch.no_grad()
    def compute_values(self, batch: RolloutBatch) -> torch.Tensor:
        packed = self.model_cfg.use_remove_padding
        parts = [(rows, self._values(micro_batch(batch, rows, packed)))
                 for rows in micro_batches(batch, self.dynamic, self.cfg.ppo_micro_batch_size_per_gpu,
                                           self.cfg.ppo_max_token_len_per_gpu, packed)]
        return gather_rows(parts, batch.size, batch.response_length) * batch.response_mask

    def update(self, batch: RolloutBatch, mini_size: int) -> dict[str, float]:
        """Value epochs over ``batch``: one optimizer step per mini-batch of ``mini_size`` responses (this rank)."""
        agg = MetricAggregator()
        for rows in mini_batches(batch.size, mini_size, self.cfg.ppo_epochs, shuffle=True, seed=batch.uid[0]):
            self._update_mini_batch(batch.select(rows), agg)
        return agg.compute()

    def _update_mini_batch(self, mini: RolloutBatch, agg: MetricAggregator) -> None:
        world = self.env.world_size
        counts = loss_counts(mini.response_mask, world)
        mini_loss = 0.0
        packed = self.model_cfg.use_remove_padding
        for rows in micro_batches(mini, self.dynamic, self.cfg.ppo_micro_batch_size_per_gpu,
                                  self.cfg.ppo_max_token_len_per_gpu, packed):
            micro = micro_batch(mini, rows, packed)
            with activation_offload(self.model_cfg.enable_activation_offload):
                vpreds = self._values(micro)
                vf_loss, clipfrac = algos.value_loss(vpreds, micro.returns, micro.values, micro.response_mask,
                                                     cliprange_value=self.cfg.cliprange_value,
                                                     loss_agg_mode=self.cfg.loss_agg_mode, **counts)
                self.engine.backward(vf_loss * world, scale_wrt_gas=False)
            tokens = float(micro.response_mask.sum())
            mini_loss += vf_loss.item()
            agg.add("critic/vf_clipfrac", clipfrac.item(), Reduce.WEIGHTED_MEAN, tokens)
            agg.add("critic/vpred_mean", algos.masked_mean(vpreds.detach(), micro.response_mask).item(),
                    Reduce.WEIGHTED_MEAN, tokens)
        agg.add("critic/vf_loss", mini_loss, Reduce.MEAN)
        optimizer_step(self.engine, "critic", agg)
