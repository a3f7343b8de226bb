"""The reward role: decode each response and score it with the run's reward function, or its reward model."""

from __future__ import annotations

from typing import Any, Optional

import torch

from rlprof.metrics import MetricAggregator, Reduce
from rlprof_train.batch import RolloutBatch
from rlprof_train.reward_functions import RewardFunction
from rlprof_train.workers.reward_model import RewardModel


class RewardWorker:
    """Scores as verl's reward loop picks them: a custom reward function when the config names one, else the reward
    model when ``reward_model.enable``, else the built-in rule reward of each sample's ``data_source``."""

    def __init__(self, reward: RewardFunction, tokenizer: Any, model: Optional[RewardModel] = None) -> None:
        self.reward = reward
        self.tokenizer = tokenizer
        self.model = None if reward.is_custom else model

    def score(self, batch: RolloutBatch) -> tuple[torch.Tensor, MetricAggregator]:
        """``[B, R]`` token-level scores (each response's score on its last real token, 0 elsewhere), and the
        extra numbers a dict-returning reward function gave, as ``reward_extra/{key}`` (mean over responses)."""
        texts = self.decode(batch)
        scores = torch.zeros(batch.response_mask.shape, dtype=torch.float32)
        last = (batch.response_mask.sum(-1) - 1).clamp(min=0)
        metrics = MetricAggregator()
        if self.model is not None:
            prompts = self.tokenizer.batch_decode(batch.input_ids[:, : batch.prompt_length], skip_special_tokens=True)
            scores[torch.arange(batch.size), last] = self.model.score(prompts, texts)
            return scores * batch.response_mask, metrics
        for row, (text, source, truth) in enumerate(zip(texts, batch.data_source, batch.ground_truth, strict=False)):
            score, extra = self.reward(source, text, truth)
            scores[row, last[row]] = score
            for key, value in extra.items():
                metrics.add(f"reward_extra/{key}", value, Reduce.MEAN)
        return scores * batch.response_mask, metrics

    def decode(self, batch: RolloutBatch) -> list[str]:
        pad = self.tokenizer.pad_token_id
        texts: list[str] = self.tokenizer.batch_decode(
            batch.responses * batch.response_mask + pad * (1 - batch.response_mask), skip_special_tokens=True
        )
        return texts
