"""The reward role: decode each response and score it with the function chosen for its data_source."""

from __future__ import annotations

import torch

from rlprof_train.batch import RolloutBatch
from rlprof_train.reward import RewardFn


class RewardWorker:
    def __init__(self, compute_score: RewardFn, tokenizer: object) -> None:
        self.compute_score = compute_score
        self.tokenizer = tokenizer

    def score(self, batch: RolloutBatch) -> torch.Tensor:
        """``[B, R]`` token-level scores: each response's score on its last real token, 0 elsewhere."""
        texts = self.tokenizer.batch_decode(batch.responses * batch.response_mask + self.tokenizer.pad_token_id
                                            * (1 - batch.response_mask), skip_special_tokens=True)
        scores = torch.zeros(batch.response_mask.shape, dtype=torch.float32)
        last = (batch.response_mask.sum(-1) - 1).clamp(min=0)
        for row, (text, source, truth) in enumerate(zip(texts, batch.data_source, batch.ground_truth)):
            scores[row, last[row]] = float(self.compute_score(source, text, truth))
        return scores * batch.response_mask
