"""``rlprof compare RUN_A RUN_B ...``: a :class:`~rlprof.analysis.compare.Comparison` as a document: runs, config
diff, learning and speed sections, and its charts (overlaid curves, phase medians)."""

from __future__ import annotations

from pathlib import Path

from rlprof.analysis.compare import NOT_SIGNIFICANT, Comparison, verdict
from rlprof.analysis.document import Document, Section, Table

LEARNING_TITLE = "Learning (final: mean of the last tenth of the steps, at least 5; best: smoothed)"
NOT_SIGNIFICANT_NOTE = (
    f"vs A: 95% bootstrap interval; {NOT_SIGNIFICANT} = no significant difference (it holds no change)"
)
SPEED_TITLE = "Speed (median over steps, warm-up excluded; vs A: ratio of medians)"


def _value(value: object) -> str:
    return "-" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


def _reached(step: object) -> str:
    return "never" if step is None else str(step)


def _layout(processes: dict[str, int] | None) -> str:
    if processes is None:
        return ""
    trainer, rollout = processes.get("trainer", 0), processes.get("rollout", 0)
    if rollout:
        return f"; asynchronous: {trainer} trainer + {rollout} rollout process{'es' if rollout > 1 else ''}"
    return f"; synchronous: {trainer} process{'es' if trainer > 1 else ''}"


def document(comparison: Comparison) -> Document:
    return Document(
        f"rlprof compare: {' vs '.join(comparison.runs)}", sections(comparison), comparison, lambda: charts(comparison)
    )


def sections(comparison: Comparison) -> list[Section]:
    labels = [f"{chr(ord('A') + i)}" for i in range(len(comparison.runs))]
    processes = comparison.processes or [None] * len(comparison.runs)
    runs = Section(
        "Runs",
        [
            f"{label}: {run} ({count} steps{_layout(layout)})"
            for label, run, count, layout in zip(
                labels, comparison.runs, comparison.step_counts, processes, strict=True
            )
        ]
        + [f"note: {line}" for line in comparison.notes]
        + [f"missing: {line}" for line in comparison.missing],
    )
    return [
        runs,
        _config_section(comparison, labels),
        _learning_section(comparison, labels),
        _speed_section(comparison, labels),
    ]


def _config_section(comparison: Comparison, labels: list[str]) -> Section:
    diff = Section("Config diff")
    if comparison.config_diff:
        diff.tables.append(Table(["key", *labels], [[d.key, *map(_value, d.values)] for d in comparison.config_diff]))
    else:
        diff.lines.append(
            "no setting differs"
            if not any("no saved config" in m for m in comparison.missing)
            else "not available (a run has no saved config)"
        )
    if comparison.identity_diff:
        diff.lines.append("also differ (names and folders): " + ", ".join(d.key for d in comparison.identity_diff))
    return diff


def _learning_section(comparison: Comparison, labels: list[str]) -> Section:
    learning = Section(LEARNING_TITLE)
    targeted = any(curve.target is not None for curve in comparison.curves)
    rows = [
        [
            curve.metric if i == 0 else "",
            label,
            _value(curve.final[i]),
            _value(curve.best[i]),
            *([_reached(curve.reached[i]) if curve.target is not None else ""] if targeted else []),
            verdict(curve.versus_first[i], ratio=False) if i else "",
        ]
        for curve in comparison.curves
        for i, label in enumerate(labels)
    ]
    header = ["metric", "run", "final", "best", *(["target reached at step"] if targeted else []), "vs A"]
    learning.tables.append(Table(header, rows))
    learning.lines.append(NOT_SIGNIFICANT_NOTE)
    if not comparison.curves:
        learning.lines.append("no learning metrics (critic/score/mean, actor/kl_loss, ...) in these runs")
    return learning


def _speed_section(comparison: Comparison, labels: list[str]) -> Section:
    speed = Section(SPEED_TITLE)
    header = [*labels, *[f"{label} vs A" for label in labels[1:]]]
    for title, first, verdicts in (
        ("", "metric", comparison.speed),
        ("Memory", "memory (GB)", comparison.memory),
        ("Pipeline (asynchronous runs: idle ratios, waits, staleness)", "pipeline", comparison.pipeline),
    ):
        if verdicts or not title:
            rows = [[v.metric, *map(_value, v.medians), *[verdict(i) for i in v.versus_first[1:]]] for v in verdicts]
            speed.tables.append(Table([first, *header], rows, title))
    speed.lines.append(NOT_SIGNIFICANT_NOTE)
    return speed


def charts(comparison: Comparison) -> dict[str, list[str]]:
    """Overlaid learning curves (one chart per metric) and the phase medians side by side."""
    import plotly.graph_objects as go

    from rlprof.analysis.render.html import figure_html

    labels = [f"{chr(ord('A') + i)}" for i in range(len(comparison.runs))]
    names = [f"{label}: {Path(run.split(',')[0]).name}" for label, run in zip(labels, comparison.runs, strict=True)]
    learning = []
    for curve in comparison.curves:
        figure = go.Figure()
        for label, points in zip(names, curve.points, strict=True):
            figure.add_scatter(x=curve.steps, y=points, mode="lines", name=label, connectgaps=False)
        figure.update_layout(title=curve.metric, xaxis_title="training step", height=320)
        learning.append(figure_html(figure))
    phases = [v for v in comparison.speed if v.metric.startswith("timing_s/")]
    figure = go.Figure()
    for i, label in enumerate(names):
        figure.add_bar(
            x=[v.metric.removeprefix("timing_s/") for v in phases], y=[v.medians[i] for v in phases], name=label
        )
    figure.update_layout(barmode="group", title="Median seconds per phase", height=360)
    return {LEARNING_TITLE: learning, SPEED_TITLE: [figure_html(figure)]}
