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
        """``[B, R]`` token-level scores (each response's score on its last sampled token, 0 elsewhere), and the
        extra numbers a dict-returning reward function gave, as ``reward_extra/{key}`` (mean over responses).

        A multi-turn batch's rows carry ``extras["reward_extra_info"]`` (turns, tool rewards: verl's
        ``extra_info`` keys), passed to the reward function as ``extra_info``; the response text then holds every
        turn and tool reply, as verl decodes it."""
        texts = self.decode(batch)
        extra_infos = batch.extras.get("reward_extra_info", [None] * batch.size)
        metrics = MetricAggregator()
        if self.model is not None:
            prompts = self.tokenizer.batch_decode(
                batch.input_ids[:, : batch.prompt_length].tolist(), skip_special_tokens=True
            )
            per_response = self.model.score(prompts, texts)
        else:
            values = []
            for text, source, truth, extra_info in zip(
                texts, batch.data_source, batch.ground_truth, extra_infos, strict=False
            ):
                score, extra = self.reward(source, text, truth, extra_info)
                values.append(score)
                for key, value in extra.items():
                    metrics.add(f"reward_extra/{key}", value, Reduce.MEAN)
            per_response = torch.tensor(values, dtype=torch.float32)
        mask = batch.response_mask
        scores = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        scores[torch.arange(batch.size, device=mask.device), batch.last_policy_token()] = per_response.to(mask.device)
        return scores * mask, metrics

    def decode(self, batch: RolloutBatch) -> list[str]:
        pad, real = self.tokenizer.pad_token_id, batch.response_attention
        texts: list[str] = self.tokenizer.batch_decode(
            (batch.responses * real + pad * (1 - real)).tolist(), skip_special_tokens=True
        )
        return texts
