"""The sections of ``rlprof report``, one registered unit each: when it applies, how it builds its part of the
report, how every renderer shows it (as a :class:`~rlprof.analysis.document.Section` of lines and tables, which the
terminal, Markdown, HTML and JSON renderers all take).

::

    def checkpoints(run, report, options):           # its part of the report: plain data or a dataclass
        return {"saved": len(list(run.log_dir.parent.glob("ckpt/global_step_*")))}

    @register_section("checkpoints", build=checkpoints, after="throughput")
    def show_checkpoints(report):
        return Section("Checkpoints", [f"saved: {report.extra['checkpoints']['saved']}"])

A section's part is kept in ``report.extra[name]`` (and written by ``--format json``); the built-in sections
(:mod:`rlprof.analysis.render.report_layout`) show the report's own fields, which the diagnosis rules read too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, TypeVar, Union

from rlprof.analysis.document import Section
from rlprof.analysis.report_model import Report, ReportOptions
from rlprof.analysis.run import Run

Shown = Union[Section, list[Section], None]
Show = Callable[[Report], Shown]
S = TypeVar("S", bound=Show)


def always(report: Report) -> bool:
    return True


@dataclass(frozen=True)
class ReportSection:
    name: str
    show: Show
    """The section(s) renderers show for a report; None or ``[]``: it does not apply to this run."""
    build: Optional[Callable[[Run, Report, ReportOptions], Any]] = None
    """Its own part of the report, from the run, the report of the built-in parts and the options, kept in
    ``report.extra[name]``; None: it shows the report's own fields."""
    applies: Callable[[Report], bool] = always
    """Whether the section has something to say about this report (``show`` is not called otherwise)."""


_SECTIONS: list[ReportSection] = []


def register_section(
    name: str,
    *,
    build: Optional[Callable[[Run, Report, ReportOptions], Any]] = None,
    applies: Optional[Callable[[Report], bool]] = None,
    after: Optional[str] = None,
) -> Callable[[S], S]:
    """Register the decorated ``show(report)`` as the section ``name``, placed after the section ``after`` (default:
    last); a later registration of a name replaces it in place."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"register_section: name={name!r} must be an identifier such as 'checkpoints'")

    def register(show: S) -> S:
        unit = ReportSection(name, show, build, applies or always)
        names = [s.name for s in _SECTIONS]
        if name in names:
            _SECTIONS[names.index(name)] = unit
        elif after is None:
            _SECTIONS.append(unit)
        elif after in names:
            _SECTIONS.insert(names.index(after) + 1, unit)
        else:
            raise ValueError(f"register_section({name!r}): after={after!r} is not a section; sections: {names}")
        return show

    return register


def report_sections() -> list[ReportSection]:
    """The registered sections, in the order a report shows them."""
    return list(_SECTIONS)


def shown(report: Report) -> list[Section]:
    """Every section that applies to ``report``, in order."""
    out: list[Section] = []
    for unit in _SECTIONS:
        if not unit.applies(report):
            continue
        part = unit.show(report)
        out += part if isinstance(part, list) else [part] if part is not None else []
    return out


def built_parts(run: Run, report: Report, options: ReportOptions) -> dict[str, Any]:
    """The parts the registered sections build for ``report`` (``report.extra``)."""
    return {unit.name: unit.build(run, report, options) for unit in _SECTIONS if unit.build is not None}
