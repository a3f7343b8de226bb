"""Prompts: a built-in procedural task, or verl-format parquet/JSONL files; tokenised, length-checked, batched in
a deterministic order that a resumed run reproduces.

A verl-format row has ``prompt`` (a string, or chat messages ``[{"role": ..., "content": ...}]``), ``data_source``
(which reward function scores it) and ``reward_model: {ground_truth: ...}``. Chat messages go through the
tokenizer's chat template when it has one (``data.apply_chat_template``); otherwise their contents are joined
with newlines. Prompts longer than ``data.max_prompt_length`` follow ``data.truncation``: ``error`` (the default:
name the row and stop), ``left`` (keep the end), ``right`` (keep the start) or ``filter`` (drop the row, counted
in the log).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Optional

import torch

ARITHMETIC_SOURCE = "rlprof/arithmetic"
REVERSE_SOURCE = "rlprof/reverse"
CALCULATOR_SOURCE = "rlprof/calculator"


@dataclass(frozen=True)
class Example:
    """One prompt: its token ids (unpadded), where it came from and what a correct answer is."""

    index: int
    prompt_ids: tuple[int, ...]
    data_source: str
    ground_truth: str
    tools_kwargs: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    """Multi-turn: per tool name, the ``create_kwargs`` (and verl's other ``*_kwargs``) of this prompt's tool
    instances (verl's ``extra_info.tools_kwargs``)."""


def arithmetic_rows(count: int, max_operand: int, seed: int) -> list[dict[str, Any]]:
    """``count`` prompts ``"a+b="`` with operands in ``0..max_operand`` (answer: the sum)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        rows.append(
            {"prompt": f"{a}+{b}=", "data_source": ARITHMETIC_SOURCE, "reward_model": {"ground_truth": str(a + b)}}
        )
    return rows


def reverse_rows(count: int, max_digits: int, seed: int) -> list[dict[str, Any]]:
    """``count`` prompts ``"Reverse the digits: 31415 ->"`` with 1..``max_digits`` digits (answer: ``"51413"``).

    Responses are as long as the input (plus EOS): a batch mixes short and long ones, as an RL batch of a real task
    does, and generation is a large share of the step."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, max(max_digits, 1))))
        rows.append(
            {
                "prompt": f"Reverse the digits: {digits} ->",
                "data_source": REVERSE_SOURCE,
                "reward_model": {"ground_truth": digits[::-1]},
            }
        )
    return rows


def calculator_rows(count: int, max_operand: int, seed: int) -> list[dict[str, Any]]:
    """``count`` prompts ``"a*b="`` with operands in ``0..max_operand`` (answer: the product), for a multi-turn
    rollout with the built-in ``calculator`` tool: the policy is to call it with the product's expression and answer
    with its reply (the embedded model is warm-started on noisy demonstrations of that)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        rows.append(
            {"prompt": f"{a}*{b}=", "data_source": CALCULATOR_SOURCE, "reward_model": {"ground_truth": str(a * b)}}
        )
    return rows


BUILTIN_TASKS = {"arithmetic": arithmetic_rows, "reverse": reverse_rows, "calculator": calculator_rows}


def read_rows(files: Any) -> list[dict[str, Any]]:
    """Rows of one or more ``.parquet`` / ``.jsonl`` / ``.json`` files; a malformed line is named by file and line."""
    paths = [files] if isinstance(files, (str, Path)) else list(files)
    rows: list[dict[str, Any]] = []
    for path in map(Path, paths):
        if not path.exists():
            raise FileNotFoundError(f"data file {path} does not exist")
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            rows.extend(pq.read_table(path).to_pylist())
        elif path.suffix in (".jsonl", ".json"):
            rows.extend(_read_json_rows(path))
        else:
            raise ValueError(f"data file {path}: unsupported format {path.suffix!r}; use .parquet, .jsonl or .json")
    return rows


def _read_json_rows(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as handle:
        text = handle.read()
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"data file {path}, line {exc.lineno}: not valid JSON ({exc.msg})") from None
    else:
        rows = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"data file {path}, line {number}: not valid JSON ({exc.msg} at column {exc.colno}): {line[:80]!r}"
                ) from None
    for number, row in enumerate(rows, start=1):
        if not isinstance(row, dict):
            raise ValueError(f"data file {path}, row {number}: expected an object with a prompt, got {row!r:.80}")
    return list(rows)


class RuleRewards(NamedTuple):
    """The built-in rewards as the data check asks for them: the reward of a data source (None: none), and the
    sources (``fnmatch`` patterns) to name."""

    reward_of: Callable[[str], Any]
    sources: Sequence[str]


def check_data_files(files: Any, prompt_key: str, setting: str, rule_rewards: Optional[RuleRewards] = None) -> None:
    """Fail early when a data file is missing, of an unknown format, malformed, has no ``prompt_key`` column or
    (``rule_rewards``: the built-in rewards, which compare with the ground truth) no ``reward_model.ground_truth`` at
    all or a ``data_source`` none of them scores."""
    paths = [files] if isinstance(files, (str, Path)) else list(files)
    for path in map(Path, paths):
        if not path.exists():
            raise ValueError(f"{setting}: {path} does not exist")
        if path.suffix not in (".parquet", ".jsonl", ".json"):
            raise ValueError(f"{setting}: {path} has unsupported format {path.suffix!r}; use .parquet, .jsonl or .json")
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            columns = pq.read_schema(path).names
            wanted = [c for c in ("reward_model", "data_source") if c in columns]
            rows = pq.read_table(path, columns=wanted).to_pylist() if wanted else []
        else:
            rows = read_rows(path)
            columns = sorted({key for row in rows for key in row})
        if prompt_key not in columns:
            raise ValueError(
                f"{setting}: {path} has no {prompt_key!r} column (data.prompt_key); "
                f"columns: {', '.join(columns) or 'none'}"
            )
        if rule_rewards is None:
            continue
        if not any(_ground_truth(row) is not None for row in rows):
            raise ValueError(
                f"{setting}: {path} has no reward_model.ground_truth in any row, and the built-in rewards "
                "compare each response with it (every reward would be 0); add it, or set "
                "custom_reward_function.path to a function that needs none"
            )
        sources = {str(row.get("data_source", "unknown")) for row in rows}
        unrewarded = sorted(source for source in sources if rule_rewards.reward_of(source) is None)
        if unrewarded:
            raise ValueError(
                f"{setting}: {path} has rows of data_source {', '.join(map(repr, unrewarded))}, which no built-in "
                f"reward scores (those that exist: {', '.join(rule_rewards.sources)}); set "
                "custom_reward_function.path to a function that scores them"
            )


def _ground_truth(row: dict[str, Any]) -> Any:
    reward_model = row.get("reward_model")
    return reward_model.get("ground_truth") if isinstance(reward_model, dict) else None


def prompt_text(prompt: Any, tokenizer: Any, use_template: Any, tools: Optional[list[dict[str, Any]]] = None) -> str:
    """The text to tokenise for a prompt cell (string or chat messages); ``tools``: the OpenAI function schemas a
    multi-turn rollout offers, rendered by the chat template where it renders them."""
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, Sequence) or not all(isinstance(m, dict) and "content" in m for m in prompt):
        raise ValueError(f"prompt {prompt!r} is neither a string nor a list of chat messages with 'content'")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if use_template is True and not has_template:
        raise ValueError("data.apply_chat_template=true but the tokenizer has no chat template")
    if has_template and use_template in (True, "auto"):
        return str(tokenizer.apply_chat_template(list(prompt), tools=tools, tokenize=False, add_generation_prompt=True))
    return "\n".join(m["content"] for m in prompt)


def build_examples(
    rows: list[dict[str, Any]],
    tokenizer: Any,
    *,
    prompt_key: str,
    max_prompt_length: int,
    truncation: str,
    use_template: Any,
    source_name: str,
    tools: Optional[list[dict[str, Any]]] = None,
) -> tuple[list[Example], int]:
    """Tokenised examples and the number of rows dropped by ``truncation=filter``; ``tools``: the schemas of a
    multi-turn rollout's tools, for the chat template."""
    examples: list[Example] = []
    dropped = 0
    for i, row in enumerate(rows):
        if prompt_key not in row:
            raise ValueError(
                f"{source_name} row {i} has no {prompt_key!r} column (data.prompt_key); "
                f"columns: {', '.join(sorted(row))}"
            )
        text = prompt_text(row[prompt_key], tokenizer, use_template, tools)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > max_prompt_length:
            if truncation == "error":
                raise ValueError(
                    f"{source_name} row {i}: the prompt has {len(ids)} tokens, more than "
                    f"data.max_prompt_length={max_prompt_length}; raise it or set data.truncation to "
                    "left, right or filter"
                )
            if truncation == "filter":
                dropped += 1
                continue
            ids = ids[-max_prompt_length:] if truncation == "left" else ids[:max_prompt_length]
        truth = _ground_truth(row)
        examples.append(
            Example(
                len(examples),
                tuple(ids),
                str(row.get("data_source", "unknown")),
                "" if truth is None else str(truth),
                _tools_kwargs(row, source_name, i),
            )
        )
    if not examples:
        raise ValueError(f"{source_name}: no usable prompts")
    return examples, dropped


def _tools_kwargs(row: dict[str, Any], source_name: str, index: int) -> dict[str, Any]:
    """verl's ``extra_info.tools_kwargs``: ``{tool name: {"create_kwargs": {...}, ...}}``, or {}."""
    extra = row.get("extra_info")
    found = extra.get("tools_kwargs") if isinstance(extra, dict) else None
    if found is None:
        return {}
    if not isinstance(found, dict) or not all(isinstance(v, dict) for v in found.values()):
        raise ValueError(
            f"{source_name} row {index}: extra_info.tools_kwargs must map each tool name to its settings "
            f'({{"calc_gsm8k_reward": {{"create_kwargs": {{...}}}}}}), not {found!r:.120}'
        )
    return {str(name): dict(settings) for name, settings in found.items()}


def load_datasets(
    data_cfg: Any, tokenizer: Any, seed: int, tools: Optional[list[dict[str, Any]]] = None
) -> tuple[list[Example], list[Example], list[str]]:
    """(train, val, notes) from ``data.*`` settings; notes are log lines about what was done. ``tools``: the tool
    schemas a multi-turn rollout offers (rendered into chat prompts by the template)."""
    notes = []
    filtered = data_cfg.filter_overlong_prompts  # verl drops them when loading, so truncation never sees them
    dropping = "data.filter_overlong_prompts" if filtered else "data.truncation=filter"
    common = dict(
        prompt_key=data_cfg.prompt_key,
        max_prompt_length=data_cfg.max_prompt_length,
        truncation="filter" if filtered else data_cfg.truncation,
        use_template=data_cfg.apply_chat_template,
        tools=tools,
    )
    if data_cfg.train_files is None:
        if data_cfg.task not in BUILTIN_TASKS:
            raise ValueError(f"data.task={data_cfg.task!r} is unknown; choose one of: {', '.join(BUILTIN_TASKS)}")
        make = BUILTIN_TASKS[data_cfg.task]
        train_rows = make(data_cfg.train_size, data_cfg.task_max_operand, seed)
        val_rows = make(data_cfg.val_size, data_cfg.task_max_operand, seed + 10_000)
        notes.append(
            f"data: built-in task {data_cfg.task!r}: {len(train_rows)} training and {len(val_rows)} validation prompts"
        )
    else:
        train_rows = read_rows(data_cfg.train_files)
        val_rows = read_rows(data_cfg.val_files) if data_cfg.val_files is not None else []
    train, dropped = build_examples(train_rows, tokenizer, source_name="data.train_files", **common)
    if dropped:
        notes.append(f"data: dropped {dropped} over-long training prompts ({dropping})")
    val: list[Example] = []
    if val_rows:
        val, dropped = build_examples(val_rows, tokenizer, source_name="data.val_files", **common)
        if dropped:
            notes.append(f"data: dropped {dropped} over-long validation prompts ({dropping})")
    return train, val, notes


class PromptBatches:
    """The prompt stream, a batch at a time: batch ``k`` (from 1) is fixed by (seed, epoch), so a run that resumes at
    batch k continues the same order. Batches are ``data.gen_batch_size`` prompts (a generation round; by default the
    step's ``train_batch_size``); an epoch's incomplete last batch is dropped (verl's ``drop_last``)."""

    def __init__(
        self, examples: list[Example], batch_size: int, seed: int, shuffle: bool, setting: str = "data.train_batch_size"
    ) -> None:
        """``setting``: the key that sets ``batch_size``, for the error when there are fewer prompts."""
        if len(examples) < batch_size:
            raise ValueError(f"{setting}={batch_size} is larger than the {len(examples)} training prompts")
        self.examples = examples
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.batches_per_epoch = len(examples) // batch_size
        self._order: Optional[tuple[int, list[int]]] = None  # the last epoch's order

    def order(self, epoch: int) -> list[int]:
        if self._order is None or self._order[0] != epoch:
            indices = list(range(len(self.examples)))
            if self.shuffle:
                random.Random(self.seed * 1_000_003 + epoch).shuffle(indices)
            self._order = (epoch, indices)
        return self._order[1]

    def epoch_of(self, k: int) -> int:
        """The epoch (from 0) of batch ``k``."""
        return (k - 1) // self.batches_per_epoch

    def batch(self, k: int) -> list[Example]:
        """The prompts of batch ``k`` (1-based)."""
        epoch, position = divmod(k - 1, self.batches_per_epoch)
        order = self.order(epoch)
        chosen = order[position * self.batch_size : (position + 1) * self.batch_size]
        return [self.examples[i] for i in chosen]


def left_pad(
    sequences: Sequence[Sequence[int]], pad_id: int, length: Optional[int] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention_mask) ``[B, L]``, left-padded to ``length`` (default: the longest)."""
    length = length or max(len(s) for s in sequences)
    ids = torch.tensor([[pad_id] * (length - len(s)) + list(s) for s in sequences], dtype=torch.long)
    mask = torch.tensor([[0] * (length - len(s)) + [1] * len(s) for s in sequences], dtype=torch.long)
    return ids.reshape(len(sequences), length), mask.reshape(len(sequences), length)


def shard(items: list[Any], rank: int, world_size: int) -> list[Any]:
    """This rank's contiguous share of a global batch (sizes are validated to divide evenly)."""
    per_rank = len(items) // world_size
    return items[rank * per_rank : (rank + 1) * per_rank]
