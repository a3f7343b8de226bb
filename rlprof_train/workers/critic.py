"""The critic: a DeepSpeed engine around the value model; predicts values and runs clipped value updates."""

from __future__ import annotations

from typing import Optional

import torch

import rlprof
from rlprof.metrics import MetricAggregator, Reduce
from rlprof_train import algos
from rlprof_train.batch import MicroBatching, RolloutBatch, gather_rows
from rlprof_train.config.schema import CriticConfig, ModelConfig
from rlprof_train.models import ValueModel
from rlprof_train.workers.engine import (
    DistEnv,
    activation_offload,
    loss_counts,
    make_engine,
    mini_batches,
    optimizer_step,
    set_learning_rate,
)


class CriticWorker:
    """Owns the value model's engine; reads only ``critic`` (its ``model`` block: packing, checkpointing, activation
    offload, as verl's critic has them) and the policy's dtype."""

    def __init__(
        self, cfg: CriticConfig, model: ModelConfig, model_path: str, env: DistEnv, zero_checkpoint: bool = False
    ) -> None:
        """``zero_checkpoint``: the run resumes optimizer state saved by a ZeRO engine (see ``zero_stage_to_run``)."""
        self.cfg = cfg
        self.model_cfg = model
        self.env = env
        module = ValueModel(model_path, model.dtype, cfg.model.enable_gradient_checkpointing)
        self.engine = make_engine(
            module,
            cfg.optim,
            zero_stage=cfg.zero_stage,
            offload_optimizer=cfg.offload_optimizer,
            offload_param=cfg.offload_param,
            grad_clip=cfg.grad_clip,
            dtype=model.dtype,
            world_size=env.world_size,
            zero_checkpoint=zero_checkpoint,
            overlap_comm=cfg.overlap_comm,
        )
        packed = cfg.model.use_remove_padding
        self.forward_batching = MicroBatching(
            cfg.forward_micro_batch_size_per_gpu, cfg.use_dynamic_bsz, cfg.forward_max_token_len_per_gpu, packed
        )
        self.update_batching = MicroBatching(
            cfg.ppo_micro_batch_size_per_gpu, cfg.use_dynamic_bsz, cfg.ppo_max_token_len_per_gpu, packed
        )

    def _values(self, micro: RolloutBatch, packed: bool) -> torch.Tensor:
        """V of the state before each response token: ``[B, R]``."""
        values: torch.Tensor = self.engine.module.response_values(
            micro.input_ids, micro.attention_mask, micro.response_length, packed=packed, forward=self.engine
        )
        return values

    @torch.no_grad()
    def compute_values(self, batch: RolloutBatch) -> torch.Tensor:
        parts = [
            (rows, self._values(micro, self.forward_batching.packed))
            for rows, micro in self.forward_batching.split(batch)
        ]
        return gather_rows(parts, batch.size, batch.response_length) * batch.response_mask

    def update(self, batch: RolloutBatch, lr: Optional[float] = None) -> MetricAggregator:
        """Value epochs over ``batch``: one optimizer step per mini-batch of ``ppo_mini_batch_size`` prompts, at the
        learning rate ``lr`` (the step's; None: the optimizer's)."""
        metrics = MetricAggregator()
        if lr is not None:
            set_learning_rate(self.engine, lr)
        mini_size = self.cfg.ppo_mini_batch_size * batch.n // self.env.world_size
        batches = mini_batches(batch.size, mini_size, self.cfg.ppo_epochs, shuffle=True, seed=batch.uid[0])
        for i, rows in enumerate(batches):
            with rlprof.mini_batch(i, role="critic"):  # a torch schedule over mini-batches walks these (verl)
                self._update_mini_batch(batch.select(rows), metrics)
        return metrics

    def _update_mini_batch(self, mini: RolloutBatch, metrics: MetricAggregator) -> None:
        world = self.env.world_size
        counts = loss_counts(mini.response_mask, world)
        mini_loss = 0.0
        for _, micro in self.update_batching.split(mini):
            assert micro.returns is not None and micro.values is not None, "run the earlier phases first"
            with activation_offload(self.cfg.model.enable_activation_offload):
                vpreds = self._values(micro, self.update_batching.packed)
                vf_loss, clipfrac = algos.value_loss(
                    vpreds,
                    micro.returns,
                    micro.values,
                    micro.response_mask,
                    cliprange_value=self.cfg.cliprange_value,
                    loss_agg_mode=self.cfg.loss_agg_mode,
                    **counts,
                )
                self.engine.backward(vf_loss * world, scale_wrt_gas=False)
            tokens = float(micro.response_mask.sum())
            mini_loss += vf_loss.item()
            metrics.add("critic/vf_clipfrac", clipfrac.item(), Reduce.WEIGHTED_MEAN, tokens)
            metrics.add(
                "critic/vpred_mean",
                algos.masked_mean(vpreds.detach(), micro.response_mask).item(),
                Reduce.WEIGHTED_MEAN,
                tokens,
            )
        # this rank's share of the mini-batch's loss (normalised by the global counts) times the ranks: the mean over
        # ranks is then the whole mini-batch's loss (verl sums such a loss over its data-parallel ranks)
        metrics.add("critic/vf_loss", mini_loss * world, Reduce.MEAN)
        optimizer_step(self.engine, "critic", metrics)
