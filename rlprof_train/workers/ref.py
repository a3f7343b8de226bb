"""The reference policy: a frozen copy of the initial model (no optimizer, no engine: it only runs forward), or,
when the policy trains LoRA adapters, the policy's own module with its adapters disabled (the base model: no
second copy)."""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch

from rlprof.metrics import MetricAggregator, Reduce
from rlprof_train import algos
from rlprof_train.batch import MicroBatching, RolloutBatch
from rlprof_train.config.schema import ModelConfig, RefConfig
from rlprof_train.models import CompiledForward, load_causal_lm
from rlprof_train.workers.log_prob import log_prob_pass


class RefWorker:
    """Log-probs of the sampled responses under the initial policy; reads only ``actor_rollout_ref.ref`` and
    ``.model``. ``lora_policy``: the actor's engine, whose PEFT module gives the base model with
    ``disable_adapter()`` (used instead of loading a copy when ``model.lora_rank > 0``)."""

    def __init__(
        self,
        cfg: RefConfig,
        model: ModelConfig,
        model_path: str,
        device: torch.device,
        lora_policy: Optional[Any] = None,
    ) -> None:
        """``device``: where the copy is made (the policy's device)."""
        self.cfg = cfg
        self.lora_policy = lora_policy
        self.model = (
            lora_policy
            if lora_policy is not None
            else load_causal_lm(model_path, model.dtype, device=device, overrides=model.override_config)
            .eval()
            .requires_grad_(False)
        )
        module = lora_policy.module if lora_policy is not None else self.model
        self.forward_model = CompiledForward(module) if model.torch_compile else self.model
        """What the log-prob pass calls: the model (or the actor's engine), or the module's compiled forward."""
        self.batching = MicroBatching(
            cfg.log_prob_micro_batch_size_per_gpu,
            cfg.log_prob_use_dynamic_bsz,
            cfg.log_prob_max_token_len_per_gpu,
            model.use_remove_padding,
        )

    def compute_ref_log_prob(self, batch: RolloutBatch) -> tuple[torch.Tensor, MetricAggregator]:
        """Reference log-probs ``[B, R]`` and ``ref/entropy`` (chunked: ``ref.entropy_from_logits_with_chunking``)."""
        base = self.lora_policy.module.disable_adapter() if self.lora_policy is not None else contextlib.nullcontext()
        with base:
            log_probs, entropy = log_prob_pass(
                self.forward_model, batch, self.batching, self.cfg.entropy_from_logits_with_chunking
            )
        metrics = MetricAggregator()
        metrics.add(
            "ref/entropy",
            algos.masked_mean(entropy, batch.response_mask).item(),
            Reduce.WEIGHTED_MEAN,
            float(batch.response_mask.sum()),
        )
        return log_probs, metrics
