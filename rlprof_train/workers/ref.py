"""The reference policy: a frozen copy of the initial model (no optimizer, no engine: it only runs forward)."""

from __future__ import annotations

from typing import Any

import torch

from rlprof_train import algos
from rlprof_train.batch import RolloutBatch, gather_rows, micro_batch, micro_batches
from rlprof_train.models import load_causal_lm, response_log_probs


class RefWorker:
    """Log-probs of the sampled responses under the initial policy. ``cfg`` is ``actor_rollout_ref``."""

    def __init__(self, cfg: Any, model_path: str) -> None:
        self.cfg = cfg
        self.model = load_causal_lm(model_path, cfg.model.dtype).eval().requires_grad_(False)

    @torch.no_grad()
    def compute_ref_log_prob(self, batch: RolloutBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """Reference log-probs ``[B, R]`` and ``ref/entropy`` (chunked with ``ref.entropy_from_logits_with_chunking``)."""
        log_probs, entropies = [], []
        packed = self.cfg.model.use_remove_padding
        for rows in micro_batches(batch, self.cfg.actor.use_dynamic_bsz, self.cfg.ref.log_prob_micro_batch_size_per_gpu,
                                  self.cfg.actor.ppo_max_token_len_per_gpu, packed):
            micro = micro_batch(batch, rows, packed)
            lp, entropy = response_log_probs(self.model, micro.input_ids, micro.attention_mask, micro.response_length,
                                             self.cfg.rollout.temperature, with_entropy=True,
                                             chunked_entropy=self.cfg.ref.entropy_from_logits_with_chunking,
                                             packed=self.cfg.model.use_remove_padding)
            log_probs.append((rows, lp))
            entropies.append((rows, entropy))
        entropy = gather_rows(entropies, batch.size, batch.response_length)
        return gather_rows(log_probs, batch.size, batch.response_length), {"ref/entropy": algos.masked_mean(entropy, batch.response_mask).item()}
