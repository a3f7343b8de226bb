"""The MATH reward against verl's own ``math_reward.py`` (verl-project/verl 1dda039b, tests/data/verl, Apache-2.0):
the same score on MATH-style answers written every way the normalisation handles (fractions, roots, units,
degrees, percent, dollars, ``x =``, ``\\left(``), on every pair of them, and on seeded random LaTeX fragments."""

from __future__ import annotations

import importlib.util
import itertools
import random
from pathlib import Path

import pytest

from rlprof_train.reward_functions import MATH_SOURCES, default_compute_score, math_score

VERL_MATH = Path(__file__).parents[1] / "data" / "verl" / "math_reward.py"

ANSWERS = [
    "\\frac{1}{2}",
    "0.5",
    ".5",
    "1/2",
    "\\dfrac{1}{2}",
    "\\tfrac12",
    "\\frac12",
    "\\frac1{72}",
    "\\frac{1}{72}",
    "3/4",
    "-3/4",
    "\\frac{-3}{4}",
    "03/4",
    "\\sqrt{2}",
    "\\sqrt2",
    "2\\sqrt{3}",
    "2 \\sqrt 3",
    "\\frac{\\sqrt{3}}{2}",
    "10\\%",
    "10",
    "10\\\\%",
    "10\\\\\\%",
    "90^\\circ",
    "90^{\\circ}",
    "90",
    "\\$5",
    "5",
    "5\\text{ cm}",
    "5 \\text{ cm}\\text{ m}",
    "x = 5",
    "k=\\frac{1}{3}",
    "\\frac13",
    "xyz = 5",
    "\\left( 1, 2 \\right)",
    "(1,2)",
    "(1, 2)",
    "\\infty",
    "\\text{(A)}",
    "(A)",
    "-\\infty",
    "\\!1,\\!000",
    "1000",
    "1,000",
    "\\sqrt",
    "\\frac",
    "a\\frac",
    "2\\sqrt",
    "\\pi",
    "2\\pi",
    "\\frac{\\pi}{2}",
    "",
    " ",
    "1\n2",
    "12",
]
"""Ground truths and boxed answers as MATH writes them, and the malformed ones that make verl's normalisation fail
(a trailing ``\\sqrt`` or ``\\frac``, two units): those compare as written in both."""


@pytest.fixture(scope="module")
def verls():
    spec = importlib.util.spec_from_file_location("verl_math_reward", VERL_MATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.compute_score


def test_every_pair_of_math_answers_scores_as_verls_does(verls, capsys):
    agreed = correct = 0
    for answer, truth in itertools.product(ANSWERS, repeat=2):
        for response in (f"so the answer is $\\boxed{{{answer}}}$.", f"\\boxed {answer}$ done", f"{answer}"):
            ours, theirs = math_score(response, truth), verls(response, truth)
            assert ours == theirs, (response, truth, ours, theirs)
            agreed += 1
            correct += ours == 1.0
    capsys.readouterr()  # verl prints its caught exceptions
    print(f"\n{agreed} responses scored as verl's math_reward scores them ({correct} correct)")
    assert correct > len(ANSWERS) * 2  # the normalisation really matched different spellings


def test_random_latex_fragments_score_as_verls_do(verls, capsys):
    pieces = [
        "\\frac",
        "\\dfrac",
        "\\sqrt",
        "{",
        "}",
        "1",
        "2",
        "3",
        "/",
        ".",
        " ",
        "=",
        "x",
        "\\%",
        "\\$",
        "^\\circ",
        "\\text{ ",
        "\\left(",
        "\\right)",
        "\\!",
        "\\\\",
        ",",
        "-",
        "\\boxed",
        "\\fbox",
        "$",
    ]
    rng = random.Random(0)
    for _ in range(3000):
        response = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 14)))
        truth = "".join(rng.choice(pieces[:19]) for _ in range(rng.randint(0, 6)))
        for text in (response, f"\\boxed{{{truth}}}"):
            assert math_score(text, truth) == verls(text, truth), (text, truth)
    capsys.readouterr()


def test_math_data_sources_are_routed_as_verls_default_compute_score_routes_them():
    for source in MATH_SOURCES:
        assert default_compute_score(source, "Thus $\\boxed{\\dfrac{1}{2}}$", "\\frac12") == 1.0
        assert default_compute_score(source, "Thus 1/2", "\\frac12") == 0.0  # no boxed answer
    with pytest.raises(ValueError, match="no built-in reward for data_source='math_dapo'.*lighteval/MATH"):
        default_compute_score("math_dapo", "\\boxed{1}", "1")
