"""Rule-based rewards, chosen per response by its ``data_source``, or the user's own function.

A reward function is ``f(data_source, solution_str, ground_truth, extra_info=None) -> float``.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any, Callable, Optional

from rlprof_train.data import ARITHMETIC_SOURCE

RewardFn = Callable[..., float]

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_GSM8K_ANSWER = re.compile(r"####\s*(-?[\d,]+(?:\.\d+)?)")


def _normalise_number(text: str) -> str:
    text = text.replace(",", "").strip()
    if text.endswith(".0"):
        text = text[:-2]
    return text


def arithmetic_score(solution_str: str, ground_truth: str) -> float:
    """1.0 when the response starts with the correct number (spaces allowed), else 0.0."""
    match = re.match(r"\s*(-?\d+)", solution_str)
    return 1.0 if match and match.group(1) == ground_truth.strip() else 0.0


def gsm8k_score(solution_str: str, ground_truth: str, method: str = "strict") -> float:
    """GSM8K-style final answer: ``strict`` takes the number after ``####``, ``flexible`` the last number.
    1.0 when it equals the ground truth (commas and a trailing ``.0`` ignored), else 0.0."""
    if method == "strict":
        match = _GSM8K_ANSWER.search(solution_str)
        answer = match.group(1) if match else None
    else:
        numbers = _NUMBER.findall(solution_str)
        answer = numbers[-1] if numbers else None
    return 1.0 if answer is not None and _normalise_number(answer) == _normalise_number(ground_truth) else 0.0


def default_compute_score(data_source: str, solution_str: str, ground_truth: str,
                          extra_info: Optional[dict[str, Any]] = None) -> float:
    """The built-in rewards: the arithmetic task, and GSM8K (``openai/gsm8k``, ``gsm8k``) with the strict check."""
    if data_source == ARITHMETIC_SOURCE:
        return arithmetic_score(solution_str, ground_truth)
    if data_source in ("openai/gsm8k", "gsm8k"):
        return gsm8k_score(solution_str, ground_truth)
    raise ValueError(f"no built-in reward for data_source={data_source!r} (known: {ARITHMETIC_SOURCE}, openai/gsm8k, "
                     "gsm8k); set custom_reward_function.path and .name to your own function")


def load_custom_reward(path: str, name: str) -> RewardFn:
    """Import ``name`` from the Python file ``path``; errors name the setting that is wrong."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"custom_reward_function.path={path!r}: no such file")
    spec = importlib.util.spec_from_file_location(f"rlprof_custom_reward_{file.stem}", file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise ValueError(f"custom_reward_function.path={path!r} does not import: {type(exc).__name__}: {exc}") from exc
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"custom_reward_function.name={name!r}: {path} defines no function of that name")
    return fn


def reward_function(custom_path: Optional[str], custom_name: str) -> RewardFn:
    return load_custom_reward(custom_path, custom_name) if custom_path else default_compute_score
