"""The batch that flows through a PPO step, and how it is cut into micro-batches."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, fields, replace
from typing import Any, Optional

import torch

Tensor = torch.Tensor

GENERATION_EXTRAS = frozenset({"engine_requests", "engine_occupancy", "engine_kv_cache_usage", "multi_turn"})
"""``extras`` that describe a generation call (the engine's requests and occupancy, the multi-turn records), not a
row: kept whole by :meth:`RolloutBatch.select`, merged by :func:`merge_generation_extras`. Every other extra is per
row: a tensor or list of ``B`` rows, or a dict of such lists (the reward's numbers per response)."""


@dataclass
class RolloutBatch:
    """Prompts (left-padded to P) and responses (right-padded to R) as one ``[B, P+R]`` sequence per response.

    ``attention_mask`` marks every real token; ``response_mask`` ``[B, R]`` the response tokens the policy sampled,
    which the losses and the per-token statistics cover. They differ only in a multi-turn rollout, whose responses
    also hold the tool replies and chat-template tokens between turns (real, attended to, not the policy's: masked
    out of the losses, as verl's agent loop masks them).

    Filled in phase by phase: rollout (sequences), reward (scores), actor/ref/critic passes (log-probs, values),
    advantage estimation (rewards, advantages, returns). ``uid`` groups the n responses of one prompt.
    """

    input_ids: Tensor
    attention_mask: Tensor
    response_mask: Tensor
    prompt_length: int
    uid: list[int]
    data_source: list[str]
    ground_truth: list[str]
    n: int = 1
    """Responses per prompt (consecutive rows share a prompt)."""
    temperature: float = 1.0
    """The sampling temperature: log-prob passes use it so they match the sampling distribution."""
    token_level_scores: Optional[Tensor] = None
    old_log_probs: Optional[Tensor] = None
    ref_log_probs: Optional[Tensor] = None
    values: Optional[Tensor] = None
    token_level_rewards: Optional[Tensor] = None
    advantages: Optional[Tensor] = None
    returns: Optional[Tensor] = None
    rollout_is_weights: Optional[Tensor] = None
    """The rollout correction's importance weights ``[B, R]`` (decoupled mode; :mod:`rlprof_train.rollout_correction`):
    they multiply the policy loss per token."""
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_length(self) -> int:
        return self.response_mask.shape[1]

    @property
    def responses(self) -> Tensor:
        return self.input_ids[:, self.prompt_length :]

    @property
    def response_attention(self) -> Tensor:
        """``[B, R]``: the response's real tokens (the policy's and, multi-turn, the tool replies between them)."""
        return self.attention_mask[:, self.prompt_length :]

    def prompt_lengths(self) -> Tensor:
        return self.attention_mask[:, : self.prompt_length].sum(-1)

    def response_lengths(self) -> Tensor:
        """Real tokens of each response (tool replies included), as verl counts ``response_length``."""
        return self.response_attention.sum(-1)

    def sequence_lengths(self) -> Tensor:
        """Real tokens (prompt + response) of each sequence."""
        return self.prompt_lengths() + self.response_lengths()

    def last_policy_token(self) -> Tensor:
        """``[B]``: the response position of each row's last sampled token (0 for an empty response): where a
        sequence-level reward is placed."""
        positions = torch.arange(self.response_length, device=self.response_mask.device).expand_as(self.response_mask)
        return (positions * self.response_mask.bool()).amax(-1)

    def trim_padding(self) -> RolloutBatch:
        """The same rows without the prompt columns that are padding in every row (left) and the response columns
        that are padding in every row (right): what a padded forward of this micro-batch really needs."""
        prompt_real = self.attention_mask[:, : self.prompt_length].any(0).nonzero()
        cut_left = int(prompt_real[0]) if len(prompt_real) else self.prompt_length
        response_real = self.response_attention.any(0).nonzero()
        keep_right = int(response_real[-1]) + 1 if len(response_real) else 1
        width = self.input_ids.shape[1]
        trimmed = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Tensor) and value.dim() == 2:
                if value.shape[1] == width:
                    trimmed[f.name] = value[:, cut_left : self.prompt_length + keep_right]
                elif value.shape[1] == self.response_length:
                    trimmed[f.name] = value[:, :keep_right]
        return replace(self, prompt_length=self.prompt_length - cut_left, **trimmed)  # type: ignore[arg-type]

    def select(self, rows: list[int]) -> RolloutBatch:
        """The rows ``rows`` of every per-response field and per-row extra (generation extras are kept whole)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.input_ids.device)

        def pick(value: Any) -> Any:
            if isinstance(value, Tensor):
                return value[index]
            if isinstance(value, list):
                return [value[i] for i in rows]
            if isinstance(value, dict):
                return {key: pick(v) for key, v in value.items()}
            return value

        picked: dict[str, Any] = {f.name: pick(getattr(self, f.name)) for f in fields(self) if f.name != "extras"}
        extras = {k: v if k in GENERATION_EXTRAS else pick(v) for k, v in self.extras.items()}
        return replace(self, **picked, extras=extras)

    def to(self, device: torch.device) -> RolloutBatch:
        """The batch with every tensor (fields and ``extras``) on ``device``: where the step's data crosses to the
        models' device, once (:class:`~rlprof_train.trainer.PPOTrainer`)."""
        moved: dict[str, Any] = {
            f.name: value.to(device) for f in fields(self) if isinstance(value := getattr(self, f.name), Tensor)
        }
        extras = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in self.extras.items()}
        return replace(self, **moved, extras=extras)


def concat_batches(batches: list[RolloutBatch]) -> RolloutBatch:
    """The rows of ``batches`` in order as one batch: prompts left-padded and responses right-padded to the widest
    (pad token 0, masks 0 there). Generation extras are merged (:func:`merge_generation_extras`); the batches carry
    the same fields and per-row extras."""
    first = batches[0]
    if len(batches) == 1:
        return first
    prompt = max(b.prompt_length for b in batches)
    response = max(b.response_length for b in batches)

    def widen(b: RolloutBatch, value: Tensor) -> Tensor:
        """``value`` of ``b`` at the common width: [B, P+R] sequences, or [B, R] per response token."""
        if value.dim() != 2:
            return value
        if value.shape[1] == b.prompt_length + b.response_length:
            left, right = prompt - b.prompt_length, response - b.response_length
        else:
            left, right = 0, response - b.response_length
        return torch.nn.functional.pad(value, (left, right))

    def join(values: list[Any], owners: list[RolloutBatch]) -> Any:
        if values[0] is None:
            return None
        if isinstance(values[0], Tensor):
            return torch.cat([widen(b, v) for b, v in zip(owners, values, strict=True)])
        if isinstance(values[0], list):
            return [item for v in values for item in v]
        if isinstance(values[0], dict):
            return {key: join([v[key] for v in values], owners) for key in values[0]}
        return values[0]

    joined = {f.name: join([getattr(b, f.name) for b in batches], batches) for f in fields(first)}
    per_row = {k: join([b.extras[k] for b in batches], batches) for k in first.extras if k not in GENERATION_EXTRAS}
    generation = merge_generation_extras([b.extras for b in batches])
    return replace(first, **{**joined, "prompt_length": prompt, "extras": {**per_row, **generation}})


def merge_generation_extras(extras: list[dict[str, Any]]) -> dict[str, Any]:
    """The :data:`GENERATION_EXTRAS` of several generation calls as one: requests, cache readings and multi-turn
    records in order, occupancies summed."""
    merged: dict[str, Any] = {}
    for extra in extras:
        for key in GENERATION_EXTRAS & extra.keys():
            value, held = extra[key], merged.get(key)
            if held is None:
                merged[key] = value
            elif key == "engine_occupancy":
                merged[key] = (held[0] + value[0], held[1] + value[1])
            elif key == "multi_turn":
                merged[key] = {name: held[name] + value[name] for name in held}
            else:
                merged[key] = held + value
    return merged


def fixed_micro_batches(count: int, size: int) -> list[list[int]]:
    """Consecutive rows in micro-batches of ``size`` (the last may be smaller)."""
    return [list(range(start, min(start + size, count))) for start in range(0, count, size)]


def length_grouped_micro_batches(prompt_lengths: list[int], response_lengths: list[int], size: int) -> list[list[int]]:
    """Micro-batches of ``size`` rows (the last may be smaller), rows of similar length together: rows sorted by
    response then prompt length are cut into consecutive runs, so a padded micro-batch, trimmed to its own longest
    prompt and response, computes little padding. The same rows per micro-batch count as
    :func:`fixed_micro_batches`; accumulated gradients do not depend on which rows share a micro-batch."""
    order = sorted(range(len(prompt_lengths)), key=lambda i: (response_lengths[i], prompt_lengths[i]))
    return [sorted(order[start : start + size]) for start in range(0, len(order), size)]


def token_budget_micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Micro-batches of packed rows whose total length stays within ``budget``, balanced: the fewest bins that fit,
    filled longest-first into the currently lightest bin. A row longer than the budget is an error."""
    if not lengths:
        return []
    _check_budget(max(lengths), budget)
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins = -(-sum(lengths) // budget)
    while True:
        loads = [0] * bins
        members: list[list[int]] = [[] for _ in range(bins)]
        for i in order:
            target = min(range(bins), key=loads.__getitem__)
            if loads[target] + lengths[i] > budget:
                break
            loads[target] += lengths[i]
            members[target].append(i)
        else:
            return [sorted(m) for m in members if m]
        bins += 1


def padded_budget_micro_batches(prompt_lengths: list[int], response_lengths: list[int], budget: int) -> list[list[int]]:
    """Micro-batches of padded rows whose padded size, rows × (longest prompt + longest response) after trimming,
    stays within ``budget``: rows sorted by response then prompt length are cut into consecutive runs, so rows of
    similar shape share a micro-batch and little of what is computed is padding."""
    if not prompt_lengths:
        return []
    _check_budget(max(p + r for p, r in zip(prompt_lengths, response_lengths, strict=False)), budget)
    bins: list[list[int]] = []
    current: list[int] = []
    widest_prompt = widest_response = 0
    for i in sorted(range(len(prompt_lengths)), key=lambda i: (response_lengths[i], prompt_lengths[i])):
        prompt, response = max(widest_prompt, prompt_lengths[i]), max(widest_response, response_lengths[i])
        if current and (len(current) + 1) * (prompt + response) > budget:
            bins.append(sorted(current))
            current, prompt, response = [], prompt_lengths[i], response_lengths[i]
        current.append(i)
        widest_prompt, widest_response = prompt, response
    return [*bins, sorted(current)]


def _check_budget(longest: int, budget: int) -> None:
    if longest > budget:
        raise ValueError(
            f"a sequence of {longest} tokens exceeds the micro-batch token budget "
            f"ppo_max_token_len_per_gpu={budget}; raise it to at least {longest}"
        )


@dataclass(frozen=True)
class MicroBatching:
    """How a pass cuts a batch into micro-batches: ``size`` rows each (rows of similar length together when padded),
    or by ``token_budget`` tokens when ``dynamic`` (costed as packed rows when ``packed``, else as trimmed padded
    rows). ``packed``: the pass runs on packed rows (``use_remove_padding``); padded micro-batches are trimmed to
    their own width."""

    size: Optional[int]
    """None only with ``dynamic`` (the config check makes sure)."""
    dynamic: bool = False
    token_budget: int = 16384
    packed: bool = False

    def rows(self, batch: RolloutBatch) -> list[list[int]]:
        """The row groups of ``batch``."""
        if not self.dynamic:
            assert self.size is not None, "a micro-batch size or a token budget"
            if self.packed:  # a packed micro-batch computes no padding whichever rows it holds
                return fixed_micro_batches(batch.size, self.size)
            return length_grouped_micro_batches(
                batch.prompt_lengths().tolist(), batch.response_lengths().tolist(), self.size
            )
        if self.packed:
            return token_budget_micro_batches(batch.sequence_lengths().tolist(), self.token_budget)
        return padded_budget_micro_batches(
            batch.prompt_lengths().tolist(), batch.response_lengths().tolist(), self.token_budget
        )

    def split(self, batch: RolloutBatch) -> Iterator[tuple[list[int], RolloutBatch]]:
        """Every micro-batch of ``batch`` with its row indices: the one loop every pass runs."""
        for rows in self.rows(batch):
            micro = batch.select(rows)
            yield rows, micro if self.packed else micro.trim_padding()


def gather_rows(parts: list[tuple[list[int], torch.Tensor]], size: int, width: int) -> torch.Tensor:
    """Reassemble per-micro-batch ``[rows, w]`` results (w <= width, trimmed micro-batches) into ``[size, width]``
    in the batch's row order, zero-filled on the right, on the parts' device."""
    device = parts[0][1].device
    out = torch.zeros((size, width), dtype=parts[0][1].dtype, device=device)
    for rows, values in parts:
        out[torch.tensor(rows, device=device), : values.shape[1]] = values
    return out


@dataclass(frozen=True)
class Packed:
    """Rows packed into one sequence without padding.

    ``ids``/``positions``: ``[1, T]`` (positions restart at 0 for each row, which is how the model tells the rows
    apart and attends block-causally); ``rows``/``cols``: the ``[B, R]`` slot of each real response token;
    ``predicts``: the packed index of the logit that predicts it (the token before it).
    """

    ids: Tensor
    positions: Tensor
    rows: Tensor
    cols: Tensor
    predicts: Tensor

    def unpack(self, values: Tensor, batch: int, response_length: int) -> Tensor:
        """Scatter one value per real response token into a zero-padded ``[B, R]`` tensor."""
        out = values.new_zeros((batch, response_length))
        out[self.rows, self.cols] = values
        return out


def pack(input_ids: Tensor, attention_mask: Tensor, response_length: int) -> Packed:
    """Pack the real tokens of left-padded prompts + right-padded responses (``[B, P+R]``) into one row.

    Computed on the tensors' device in a few whole-batch operations (no per-row host round trip): with
    ``real = attention_mask.bool()``, the packed tokens are ``input_ids[real]`` (row-major: row by row, in order);
    row ``b`` starts at ``starts[b] = Σ_{b' < b} len(b')``; a response token's slot is ``(b, i - n_prompt[b])`` for
    its position ``i`` in the row's real tokens, and the logit that predicts it is at packed index ``k - 1`` for its
    own index ``k``."""
    real = attention_mask.bool()  # [B, P+R]
    prompt_length = input_ids.shape[1] - response_length
    is_response = real.clone()
    is_response[:, :prompt_length] = False
    lengths = real.sum(-1)  # [B]
    n_prompt = real[:, :prompt_length].sum(-1)  # [B]
    ids = input_ids[real]  # [T]
    row_of = torch.repeat_interleave(torch.arange(len(lengths), device=ids.device), lengths)  # [T]
    starts = lengths.cumsum(0) - lengths  # [B]
    positions = torch.arange(len(ids), device=ids.device) - starts[row_of]  # [T]: 0 at each row's first token
    response = is_response[real]  # [T]
    rows = row_of[response]  # [N]
    return Packed(
        ids[None],
        positions[None],
        rows,
        positions[response] - n_prompt[rows],
        response.nonzero().squeeze(1) - 1,
    )
