"""A model-based reward: a sequence classifier scores each decoded prompt and response (verl's ``reward_model``)."""

from __future__ import annotations

from typing import Optional

import torch

from rlprof_train.config.schema import RewardModelConfig


class RewardModel:
    """``reward_model.model.path`` loaded with ``AutoModelForSequenceClassification`` and its own tokenizer.

    The input is what verl's discriminative reward model reads: the conversation ``[user: prompt, assistant:
    response]`` through the reward model's chat template (plain ``prompt + response`` when it has none); the score
    is the logit of its last label at the last real token (verl: ``probs[-1]`` without activation).
    """

    def __init__(self, cfg: RewardModelConfig, device: torch.device) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        assert cfg.model.path is not None, "reward_model.enable needs reward_model.model.path (checked in the config)"
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = "right"
        self.model = AutoModelForSequenceClassification.from_pretrained(
            cfg.model.path, trust_remote_code=cfg.model.trust_remote_code
        ).to(device)
        self.model.eval()
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.micro_batch_size = cfg.micro_batch_size_per_gpu
        self.max_length = cfg.max_length
        self.device = device

    def text(self, prompt: str, response: str) -> str:
        """The reward model's input for one sample."""
        if getattr(self.tokenizer, "chat_template", None):
            chat = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
            rendered = str(self.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=False))
            bos = self.tokenizer.bos_token
            return rendered[len(bos) :] if bos and rendered.startswith(bos) else rendered  # the tokenizer adds it
        return prompt + response

    @torch.no_grad()
    def score(self, prompts: list[str], responses: list[str]) -> torch.Tensor:
        """``[B]`` scores on the model's device, ``micro_batch_size_per_gpu`` samples per forward."""
        texts = [self.text(p, r) for p, r in zip(prompts, responses, strict=True)]
        size = self.micro_batch_size or max(len(texts), 1)
        scores = [self._forward(texts[start : start + size]) for start in range(0, len(texts), size)]
        return torch.cat(scores) if scores else torch.zeros(0, device=self.device)

    def _forward(self, texts: list[str]) -> torch.Tensor:
        ids = [self._truncated(self.tokenizer(t)["input_ids"]) for t in texts]
        width = max(len(row) for row in ids)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor([row + [pad] * (width - len(row)) for row in ids], device=self.device)
        mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in ids], device=self.device)
        logits = self.model(input_ids=input_ids, attention_mask=mask).logits  # [b, labels], at the last real token
        result: torch.Tensor = logits[:, -1].float()  # [b]: the last label's logit
        return result

    def _truncated(self, ids: list[int]) -> list[int]:
        return ids[-self.max_length :] if self.max_length and len(ids) > self.max_length else ids


def reward_model(cfg: RewardModelConfig, device: torch.device) -> Optional[RewardModel]:
    """The run's reward model, or None when ``reward_model.enable`` is false."""
    return RewardModel(cfg, device) if cfg.enable else None
