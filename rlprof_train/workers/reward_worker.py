"""The reward role: decode each response and score it with the run's reward function, or its reward model; with
verl's DAPO reward manager, also DAPO's overlong penalty."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from rlprof.metrics import MetricAggregator, Reduce
from rlprof_train.batch import RolloutBatch
from rlprof_train.config.schema import OverlongBufferConfig
from rlprof_train.reward_functions import RewardFunction
from rlprof_train.workers.reward_model import RewardModel


@dataclass
class Scores:
    """What the reward gave a batch."""

    token_level: torch.Tensor
    """``[B, R]``: each response's reward on its last sampled token, 0 elsewhere."""
    per_response: dict[str, list[float]] = field(default_factory=dict)
    """The reward's other numbers per response (verl's ``reward_extra_info``: ``acc``, a dict reward's keys, DAPO's
    ``overlong_reward``); booleans as 1.0 / 0.0, NaN where a response's reward did not give the key."""
    metrics: MetricAggregator = field(default_factory=MetricAggregator)
    """``reward_extra/{key}``: the mean of each of them over the responses."""


def overlong_penalty(response_length: int, buffer: OverlongBufferConfig, max_resp_len: int) -> float:
    """DAPO's overlong reward shaping (verl's ``DAPORewardManager``), for a response of ``L`` real tokens::

        min(-(L - (max_resp_len - len)) / len · penalty_factor, 0)

    0 up to ``max_resp_len - len`` tokens, then falling linearly to ``-penalty_factor`` at ``max_resp_len``."""
    expected = max_resp_len - buffer.len
    return min(-(response_length - expected) / buffer.len * buffer.penalty_factor, 0.0)


class RewardWorker:
    """Scores as verl's reward loop picks them: a custom reward function when the config names one, else the reward
    model when ``reward_model.enable``, else the built-in rule reward of each sample's ``data_source``.

    ``dapo``: verl's DAPO reward manager, whose buffer (when enabled) penalises over-long responses and which
    records a float reward as ``acc`` too; a reward model's scores pass as they are (as verl's managers return
    ``rm_scores``)."""

    def __init__(
        self,
        reward: RewardFunction,
        tokenizer: Any,
        model: Optional[RewardModel] = None,
        dapo: Optional[tuple[OverlongBufferConfig, int]] = None,
    ) -> None:
        """``dapo``: (the overlong buffer, the ``max_resp_len`` it ends at) of verl's DAPO manager; None: naive."""
        self.reward = reward
        self.tokenizer = tokenizer
        self.model = None if reward.is_custom else model
        self.dapo = dapo

    def score(self, batch: RolloutBatch) -> Scores:
        """The batch's scores.

        A multi-turn batch's rows carry ``extras["reward_extra_info"]`` (turns, tool rewards: verl's
        ``extra_info`` keys), passed to the reward function as ``extra_info``; the response text then holds every
        turn and tool reply, as verl decodes it."""
        texts = self.decode(batch)
        if self.model is not None:
            prompts = self.tokenizer.batch_decode(
                batch.input_ids[:, : batch.prompt_length].tolist(), skip_special_tokens=True
            )
            return Scores(self._place(self.model.score(prompts, texts), batch))
        extra_infos = batch.extras.get("reward_extra_info", [None] * batch.size)
        lengths = batch.response_lengths().tolist()
        rewards: list[float] = []
        extras: list[dict[str, float]] = []
        metrics = MetricAggregator()
        for row, (text, source, truth, extra_info) in enumerate(
            zip(texts, batch.data_source, batch.ground_truth, extra_infos, strict=False)
        ):
            score, extra = self.reward(source, text, truth, extra_info)
            if self.dapo is not None and not extra:  # verl's DAPO manager: a number is also the accuracy
                extra = {"acc": score}
            if self.dapo is not None and self.dapo[0].enable:
                buffer, max_resp_len = self.dapo
                penalty = overlong_penalty(lengths[row], buffer, max_resp_len)
                score += penalty
                if buffer.log:
                    extra = {**extra, "overlong_reward": penalty, "overlong": float(penalty < 0)}
            rewards.append(score)
            extras.append(extra)
            for key, value in extra.items():
                metrics.add(f"reward_extra/{key}", value, Reduce.MEAN)
        keys = sorted({key for extra in extras for key in extra})
        per_response = {key: [extra.get(key, float("nan")) for extra in extras] for key in keys}
        return Scores(self._place(torch.tensor(rewards, dtype=torch.float32), batch), per_response, metrics)

    @staticmethod
    def _place(per_response: torch.Tensor, batch: RolloutBatch) -> torch.Tensor:
        """``[B, R]``: each response's reward on its last sampled token."""
        mask = batch.response_mask
        scores = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        scores[torch.arange(batch.size, device=mask.device), batch.last_policy_token()] = per_response.to(mask.device)
        return scores * mask

    def decode(self, batch: RolloutBatch) -> list[str]:
        pad, real = self.tokenizer.pad_token_id, batch.response_attention
        texts: list[str] = self.tokenizer.batch_decode(
            (batch.responses * real + pad * (1 - real)).tolist(), skip_special_tokens=True
        )
        return texts
