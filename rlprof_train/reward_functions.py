"""Rule-based reward functions, chosen per response by its ``data_source``, or the user's own function.

A reward function is ``f(data_source, solution_str, ground_truth, extra_info=None)`` returning a number, or (as in
verl) a dict with a ``"score"`` number and any other numbers, which are logged as metrics.
"""

from __future__ import annotations

import importlib.util
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from rlprof_train.data import ARITHMETIC_SOURCE, REVERSE_SOURCE

RewardFn = Callable[..., Any]

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_GSM8K_ANSWER = re.compile(r"####\s*(-?[\d,]+(?:\.\d+)?)")
BUILTIN_SOURCES = (ARITHMETIC_SOURCE, REVERSE_SOURCE, "openai/gsm8k", "gsm8k")


def _normalise_number(text: str) -> str:
    text = text.replace(",", "").strip()
    if text.endswith(".0"):
        text = text[:-2]
    return text


def arithmetic_score(solution_str: str, ground_truth: str) -> float:
    """1.0 when the response starts with the correct number (spaces allowed), else 0.0."""
    match = re.match(r"\s*(-?\d+)", solution_str)
    return 1.0 if match and match.group(1) == ground_truth.strip() else 0.0


def reverse_score(solution_str: str, ground_truth: str) -> float:
    """The share of positions where the response (surrounding spaces ignored) has the answer's character, over the
    longer of the two: 1.0 only for the exact answer, partial credit for a partly right one."""
    response, truth = solution_str.strip(), ground_truth.strip()
    if not response or not truth:
        return float(response == truth)
    return sum(a == b for a, b in zip(response, truth, strict=False)) / max(len(response), len(truth))


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


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: Optional[dict[str, Any]] = None
) -> float:
    """The built-in rewards: the arithmetic and reverse tasks, and GSM8K (``openai/gsm8k``, ``gsm8k``) with the strict
    check. All compare with ``reward_model.ground_truth``."""
    if data_source == ARITHMETIC_SOURCE:
        return arithmetic_score(solution_str, ground_truth)
    if data_source == REVERSE_SOURCE:
        return reverse_score(solution_str, ground_truth)
    if data_source in ("openai/gsm8k", "gsm8k"):
        return gsm8k_score(solution_str, ground_truth)
    raise ValueError(
        f"no built-in reward for data_source={data_source!r} (known: {', '.join(BUILTIN_SOURCES)}); "
        "set custom_reward_function.path and .name to your own function"
    )


_loaded: dict[tuple[str, float, str], RewardFn] = {}


def load_custom_reward(path: str, name: str) -> RewardFn:
    """Import ``name`` from the Python file ``path`` (once per file version); errors name the setting that is wrong."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"custom_reward_function.path={path!r}: no such file")
    key = (str(file.resolve()), file.stat().st_mtime, name)
    if key in _loaded:
        return _loaded[key]
    spec = importlib.util.spec_from_file_location(f"rlprof_custom_reward_{file.stem}", file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise ValueError(f"custom_reward_function.path={path!r} does not import: {type(exc).__name__}: {exc}") from exc
    fn: Optional[RewardFn] = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"custom_reward_function.name={name!r}: {path} defines no function of that name")
    assert fn is not None
    _loaded[key] = fn
    return fn


class RewardFunction:
    """Calls the reward function of a run and checks what it returns, naming the function, its file and the
    sample when it fails: an exception, a hang past ``timeout_s``, or a value that is not a finite number."""

    def __init__(
        self, custom_path: Optional[str] = None, custom_name: str = "compute_score", timeout_s: Optional[float] = None
    ) -> None:
        self.fn = load_custom_reward(custom_path, custom_name) if custom_path else default_compute_score
        self.is_custom = custom_path is not None
        where = f"{custom_path}" if custom_path else "rlprof_train/reward_functions.py"
        self.description = f"reward function {getattr(self.fn, '__name__', custom_name)} ({where})"
        self.timeout_s = timeout_s
        self._executor: Any = None

    def __call__(self, data_source: str, solution_str: str, ground_truth: str) -> tuple[float, dict[str, float]]:
        """(score, extra metrics) of one response."""
        sample = f"data_source={data_source!r}, response={solution_str[:200]!r}, ground_truth={ground_truth!r}"
        try:
            value = self._call(data_source, solution_str, ground_truth)
        except TimeoutError:
            raise RuntimeError(
                f"the {self.description} took longer than custom_reward_function.timeout_s="
                f"{self.timeout_s} s on the sample {sample}"
            ) from None
        except Exception as exc:
            raise RuntimeError(
                f"the {self.description} raised {type(exc).__name__}: {exc} on the sample {sample}"
            ) from exc
        extra: dict[str, float] = {}
        if isinstance(value, dict):
            if "score" not in value:
                raise RuntimeError(
                    f"the {self.description} returned a dict without 'score' ({sorted(value)}) on the "
                    f"sample {sample}; return a number or {{'score': number, ...}}"
                )
            extra = {
                k: float(v)
                for k, v in value.items()
                if k != "score" and isinstance(v, (int, float)) and not isinstance(v, bool)
            }
            value = value["score"]
        if isinstance(value, bool) or (not isinstance(value, (int, float)) and not hasattr(value, "__float__")):
            raise RuntimeError(
                f"the {self.description} returned {value!r} ({type(value).__name__}) on the sample "
                f"{sample}; it must return a number or {{'score': number, ...}}"
            )
        score = float(value)
        if not math.isfinite(score):
            raise RuntimeError(
                f"the {self.description} returned {score} (not finite) on the sample {sample}; a "
                "NaN or infinite reward would silently skip every update"
            )
        return score, extra

    def _call(self, data_source: str, solution_str: str, ground_truth: str) -> Any:
        if self.timeout_s is None:
            return self.fn(data_source, solution_str, ground_truth)
        if self._executor is None:
            from concurrent.futures import ThreadPoolExecutor

            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlprof-reward")
        future = self._executor.submit(self.fn, data_source, solution_str, ground_truth)
        try:
            return future.result(timeout=self.timeout_s)
        except TimeoutError:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
            raise
