"""The MATH and DAPO rewards against verl's own ``math_reward.py`` and ``math_dapo.py`` (verl-project/verl 1dda039b,
tests/data/verl, Apache-2.0): the same score on MATH-style answers written every way the normalisations handle
(fractions, roots, units, degrees, percent, dollars, ``x =``, ``\\left(``, ``Answer:`` lines), on every pair of them,
and on seeded random LaTeX fragments."""

from __future__ import annotations

import importlib.util
import itertools
import random
from pathlib import Path

import pytest

from rlprof_train.reward_functions import MATH_SOURCES, default_compute_score, math_dapo_score, math_score

VERL = Path(__file__).parents[1] / "data" / "verl"

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


def verl_score(name: str):
    """``compute_score`` of verl's ``name``.py."""
    spec = importlib.util.spec_from_file_location(f"verl_{name}", VERL / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.compute_score


@pytest.fixture(scope="module")
def verls():
    return verl_score("math_reward")


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
    for source in ("math_dapo", "math", "aime2024"):
        assert default_compute_score(source, "Answer: 7", "7")["score"] == 1.0
    with pytest.raises(ValueError, match="no built-in reward for data_source='codecontests'.*lighteval/MATH.*aime"):
        default_compute_score("codecontests", "\\boxed{1}", "1")


def test_dapos_math_scores_as_verls_math_dapo_does(capsys):
    """verl's DAPO reward with its defaults (``Answer:`` lines first, the last boxed answer of the last 100
    characters otherwise): score, verdict and the answer read."""
    verls = verl_score("math_dapo")
    forms = [*ANSWERS, "7 dollars", "an 7", "\\text{7}", "\\textbf{7}", "\\overline{7}", "$7$", "7 cm", "1,000,000"]
    compared = 0
    for answer, truth in itertools.product(forms, repeat=2):
        for response in (
            f"reasoning... Answer: {answer}",
            f"answer: {answer}\nmore",
            f"so $\\boxed{{{answer}}}$",
            "x" * 290 + f"\\boxed{{{answer}}}",  # past the 300 characters read
            f"\\boxed{{{answer}}}" + "y" * 120,  # past the 100 characters searched for a box
            f"Answer: {answer} \\boxed 3",
        ):
            assert math_dapo_score(response, truth) == verls(response, truth), (response, truth)
            compared += 1
    capsys.readouterr()
    print(f"\n{compared} responses scored as verl's math_dapo scores them")
