"""Rule-based reward functions, chosen per response by its ``data_source``, or the user's own function.

A reward function is ``f(data_source, solution_str, ground_truth, extra_info=None)`` returning a number, or (as in
verl) a dict with a ``"score"`` number and any other numbers, which are logged as metrics.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from rlprof_train.data import ARITHMETIC_SOURCE, CALCULATOR_SOURCE, REVERSE_SOURCE

RewardFn = Callable[..., Any]

_STRICT_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")
_ANY_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")
_GSM8K_CLIP_CHARS = 300  # verl reads the last 300 characters only (the answer is at the end)
MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
"""The data sources verl's ``default_compute_score`` scores with its MATH reward (``math_reward``)."""
DAPO_SOURCES = ("math_dapo", "math", "math_dapo_reasoning", "aime*")
"""The data sources (``fnmatch`` patterns) verl scores with its DAPO reward (``math_dapo``)."""
TOOL_RESPONSE_END = "</tool_response>"
_TOOL_REPLY = re.compile(r"<tool_response>(.*?)</tool_response>", re.DOTALL)


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


def gsm8k_answer(solution_str: str, method: str = "strict") -> Optional[str]:
    """The final answer as verl's ``gsm8k.extract_solution`` reads it, from the last 300 characters: ``strict``, the
    number after the last ``#### `` (commas and ``$`` removed); ``flexible``, the last number (not a lone ``.``)."""
    text = solution_str[-_GSM8K_CLIP_CHARS:]
    if method == "strict":
        found = _STRICT_ANSWER.findall(text)
        return found[-1].replace(",", "").replace("$", "") if found else None
    numbers = [n for n in _ANY_NUMBER.findall(text) if n not in ("", ".")]
    return numbers[-1] if numbers else None


def gsm8k_score(solution_str: str, ground_truth: str, method: str = "strict") -> float:
    """verl's ``gsm8k.compute_score`` (format score 0, score 1): 1.0 when :func:`gsm8k_answer` is the ground truth
    as written, else 0.0."""
    return 1.0 if gsm8k_answer(solution_str, method) == ground_truth else 0.0


def last_boxed(text: str) -> Optional[str]:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) of ``text``, its braces balanced, as verl's
    ``math_reward.last_boxed_only_string`` then ``remove_boxed`` read it; ``\\boxed x`` (a space, no braces) is the
    text after the last ``\\boxed `` up to a ``$``. None when there is none or its braces never close."""
    if "\\boxed " in text:
        return text.rsplit("\\boxed ", maxsplit=1)[-1].split("$", maxsplit=1)[0]
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    boxed = _through_closing_brace(text, start)
    return boxed[len("\\boxed{") : -1] if boxed is not None and boxed.startswith("\\boxed{") else None


def _through_closing_brace(text: str, start: int) -> Optional[str]:
    """``text`` from ``start`` through the brace that closes the first one opened there, or None if none does."""
    depth = 0
    for end in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if text[end] == "}" and depth == 0:
            return text[start : end + 1]
    return None


def _braced_fracs(text: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{72}`` -> ``\\frac{1}{72}`` (a ``\\frac`` followed by one
    character only: the text unchanged)."""
    head, *parts = text.split("\\frac")
    out = head
    for part in parts:
        out += "\\frac"
        if part[0] == "{":  # an empty part (a trailing ``\\frac``): IndexError, as in verl
            out += part
        elif len(part) < 2:
            return text
        elif part[1] != "{":
            out += "{" + part[0] + "}{" + part[1] + "}" + part[2:]
        else:
            out += "{" + part[0] + "}" + part[1:]
    return out


def _slash_to_frac(text: str) -> str:
    """``3/4`` (two integers written plainly) -> ``\\frac{3}{4}``."""
    found = re.fullmatch(r"(-?\d+)/(-?\d+)", text)
    if not found or text != f"{int(found.group(1))}/{int(found.group(2))}":
        return text
    return f"\\frac{{{int(found.group(1))}}}{{{int(found.group(2))}}}"


def _braced_sqrt(text: str) -> str:
    """``\\sqrt3`` -> ``\\sqrt{3}``."""
    head, *parts = text.split("\\sqrt")  # an empty part (a trailing ``\\sqrt``): IndexError, as in verl
    return head + "".join("\\sqrt" + (p if p[0] == "{" else "{" + p[0] + "}" + p[1:]) for p in parts)


def normalize_math_answer(answer: str) -> str:
    """A MATH answer in the normal form verl's ``math_reward.strip_string`` gives (Hendrycks' MATH normalisation,
    as in lm-evaluation-harness): no line breaks, ``\\!``, ``\\left``/``\\right``, degrees, ``\\$``, a trailing
    ``\\text{ unit}``, percent signs or spaces; ``tfrac``/``dfrac`` as ``frac``; ``.5`` as ``0.5``; a short
    ``x = `` prefix dropped; ``\\sqrt`` and ``\\frac`` arguments braced; ``0.5`` and ``a/b`` as ``\\frac``."""
    text = answer.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    text = text.replace("tfrac", "frac").replace("dfrac", "frac").replace("\\left", "").replace("\\right", "")
    text = text.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\$", "")
    if "\\text{ " in text:
        units = text.split("\\text{ ")
        if len(units) != 2:
            raise ValueError(f"more than one unit in {answer!r}")
        text = units[0]
    text = text.replace("\\\\%", "").replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not text:
        return text
    if text.startswith("."):
        text = "0" + text
    sides = text.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        text = sides[1]
    text = _braced_fracs(_braced_sqrt(text).replace(" ", ""))
    return "\\frac{1}{2}" if text == "0.5" else _slash_to_frac(text)


def math_score(solution_str: str, ground_truth: str) -> float:
    """verl's MATH reward (``math_reward.compute_score``): 1.0 when the last boxed answer of the response equals the
    ground truth once both are normalised (:func:`normalize_math_answer`; compared as written where the
    normalisation fails), else 0.0 (no boxed answer: 0.0)."""
    answer = last_boxed(solution_str)
    if answer is None:
        return 0.0
    try:
        return float(normalize_math_answer(answer) == normalize_math_answer(ground_truth))
    except (ValueError, IndexError):
        return float(answer == ground_truth)


_DAPO_SUBSTITUTIONS = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)  # fmt: skip
_DAPO_REMOVED = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue", "points",
    "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges", "students",
    "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3",
    "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
)  # fmt: skip
"""verl's ``math_dapo`` normalisation tables (Minerva's, from lm-evaluation-harness), in its order."""
_DAPO_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_DAPO_WINDOW = 300  # verl reads the last 300 characters (the longest MATH-500 answer has 159)
_DAPO_BOX_WINDOW = 100  # and looks for the boxed answer in the last 100 of those


def normalize_final_answer(answer: str) -> str:
    """A final answer as verl's ``math_dapo.normalize_final_answer`` (Minerva's) normalises it: the text after the
    last ``=``, substitutions and unit words removed in verl's order, the first ``$...$`` kept, ``\\text``,
    ``\\textbf``, ``\\overline`` and ``\\boxed`` unwrapped, ``\\fracab`` / ``\\sqrta`` braced, ``$`` dropped, a
    number's thousands commas removed, spaces stripped."""
    answer = answer.rsplit("=", maxsplit=1)[-1]
    for before, after in _DAPO_SUBSTITUTIONS:
        answer = answer.replace(before, after)
    for removed in _DAPO_REMOVED:
        answer = answer.replace(removed, "")
    answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", answer)
    for command in ("text", "textbf", "overline"):
        answer = re.sub(rf"(\\{command}\{{)(.*?)(\}})", "\\2", answer)
    answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", answer)
    answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", answer)
    answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", answer).replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def _last_braced_box(text: str) -> Optional[str]:
    """The content of the last ``\\boxed{...}`` (braces balanced; ``\\boxed x`` and ``\\fbox`` do not count, as
    in verl's ``math_dapo``), or None."""
    start = text.rfind("\\boxed{")
    boxed = _through_closing_brace(text, start) if start >= 0 else None
    return boxed[len("\\boxed{") : -1] if boxed is not None else None


def math_dapo_score(solution_str: str, ground_truth: str) -> dict[str, Any]:
    """verl's DAPO reward (``math_dapo.compute_score``, its defaults): of the last 300 characters, the last
    ``Answer: ...`` line normalised (:func:`normalize_final_answer`) against the normalised ground truth; without one,
    the last boxed answer of the last 100 characters against the ground truth as written. ``score`` 1.0 or -1.0,
    ``acc`` the verdict, ``pred`` the answer read (``"[INVALID]"`` when there was none)."""
    text = solution_str[-_DAPO_WINDOW:]
    found = _DAPO_ANSWER.findall(text)
    pred: Optional[str] = normalize_final_answer(found[-1] if found else "[INVALID]")
    correct = pred == normalize_final_answer(ground_truth)
    if pred == "[INVALID]":
        boxed = _last_braced_box(text[-_DAPO_BOX_WINDOW:])
        if boxed is not None:
            pred, correct = boxed, boxed == ground_truth
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


def calculator_score(solution_str: str, ground_truth: str) -> dict[str, float]:
    """The calculator task: ``score`` 1.0 when the final answer (the text after the last tool reply) starts with the
    correct number; ``tool_call`` 1.0 when the policy called a tool, ``correct_call`` 1.0 when a tool replied with
    the correct number (the call had the right expression). Their means over a step's responses are
    ``reward_extra/tool_call`` and ``reward_extra/correct_call``."""
    final = solution_str.rpartition(TOOL_RESPONSE_END)[2]
    replies = [reply.strip() for reply in _TOOL_REPLY.findall(solution_str)]
    return {
        "score": arithmetic_score(final, ground_truth),
        "tool_call": float("<tool_call>" in solution_str),
        "correct_call": float(ground_truth.strip() in replies),
    }


BUILTIN_REWARDS: dict[str, Callable[[str, str], Any]] = {
    ARITHMETIC_SOURCE: arithmetic_score,
    REVERSE_SOURCE: reverse_score,
    CALCULATOR_SOURCE: calculator_score,
    "openai/gsm8k": gsm8k_score,
    "gsm8k": gsm8k_score,
    **dict.fromkeys(MATH_SOURCES, math_score),
    **dict.fromkeys(DAPO_SOURCES, math_dapo_score),
}
"""``data_source`` (an ``fnmatch`` pattern) -> its rule reward ``f(solution_str, ground_truth)``, as verl's
``default_compute_score`` routes them (the first pattern that matches)."""
BUILTIN_SOURCES = tuple(BUILTIN_REWARDS)


def builtin_reward(data_source: str) -> Optional[Callable[[str, str], Any]]:
    """The rule reward of ``data_source``, or None."""
    return next((fn for pattern, fn in BUILTIN_REWARDS.items() if fnmatch.fnmatchcase(data_source, pattern)), None)


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: Optional[dict[str, Any]] = None
) -> Any:
    """The built-in rewards (:data:`BUILTIN_REWARDS`): the arithmetic, reverse and calculator tasks, GSM8K with the
    strict check, MATH and DAPO's math. All compare with ``reward_model.ground_truth``."""
    reward = builtin_reward(data_source)
    if reward is not None:
        return reward(solution_str, ground_truth)
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

    def __call__(
        self, data_source: str, solution_str: str, ground_truth: str, extra_info: Optional[dict[str, Any]] = None
    ) -> tuple[float, dict[str, float]]:
        """(score, the numbers of a dict it returned, ``score`` included, true/false as 1/0: verl's
        ``reward_extra_info``) of one response; ``extra_info`` is passed on when given (verl's keyword)."""
        sample = f"data_source={data_source!r}, response={solution_str[:200]!r}, ground_truth={ground_truth!r}"
        arguments: dict[str, Any] = {} if extra_info is None else {"extra_info": extra_info}
        try:
            value = self._call(data_source, solution_str, ground_truth, arguments)
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
            extra = {k: float(v) for k, v in value.items() if isinstance(v, (int, float))}  # score too, as verl
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

    def _call(self, data_source: str, solution_str: str, ground_truth: str, arguments: dict[str, Any]) -> Any:
        if self.timeout_s is None:
            return self.fn(data_source, solution_str, ground_truth, **arguments)
        if self._executor is None:
            from concurrent.futures import ThreadPoolExecutor

            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlprof-reward")
        future = self._executor.submit(self.fn, data_source, solution_str, ground_truth, **arguments)
        try:
            return future.result(timeout=self.timeout_s)
        except TimeoutError:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
            raise
