"""The ``rlprof`` command itself: every subcommand's ``--help`` ends with an example of it."""

from __future__ import annotations

import pytest

from rlprof.cli import build_parser, main

SUBCOMMANDS = ("report", "compare", "view", "memory", "summary", "timeline", "nsys", "prometheus", "top")


def test_the_subcommands_are_these():
    (commands,) = [a for a in build_parser()._actions if a.dest == "command"]
    assert tuple(commands.choices) == SUBCOMMANDS


@pytest.mark.parametrize(
    "argv", [[name, "--help"] for name in SUBCOMMANDS] + [["nsys", "profile", "--help"], ["--help"]]
)
def test_help_ends_with_an_example(capsys, argv):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    out = capsys.readouterr().out
    assert exited.value.code == 0
    name = " ".join(a for a in argv if a != "--help")
    assert f"\n  rlprof {name}".rstrip() in out.split("example")[-1], out
