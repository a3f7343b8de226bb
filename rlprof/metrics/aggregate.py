"""Combining metrics from micro-batches with a reducer stated per metric, never guessed from the key."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


class Reduce(enum.Enum):
    """How the values of one metric across micro-batches combine into one number."""

    MEAN = "mean"  # plain mean of the values
    WEIGHTED_MEAN = "weighted_mean"  # Σ w·v / Σ w, e.g. a token-mean loss weighted by each micro-batch's tokens
    SUM = "sum"
    MIN = "min"
    MAX = "max"
    LAST = "last"  # the latest value, e.g. a learning rate


@dataclass
class _Series:
    reduce: Reduce
    values: list[float] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)


class MetricAggregator:
    """Collects ``add(key, value, reduce, weight)`` calls and reduces each key once with its own reducer.

    Aggregators of several workers merge (:meth:`merge`), and those of several ranks combine through
    :meth:`state` / :meth:`from_states` (what a cross-rank gather sends), so every metric is reduced with its own
    reducer over all the values of all ranks: a maximum stays a maximum, a count a sum, a token mean a mean
    weighted by tokens."""

    def __init__(self) -> None:
        self._series: dict[str, _Series] = {}

    def add(self, key: str, value: float, reduce: Reduce, weight: float = 1.0) -> None:
        """Record one value of ``key``; every value of a key must use the same reducer."""
        if not isinstance(reduce, Reduce):
            raise TypeError(f"{key}: reduce={reduce!r} must be a rlprof.metrics.Reduce member")
        series = self._series.setdefault(key, _Series(reduce))
        if series.reduce is not reduce:
            raise ValueError(f"{key}: added with reduce={reduce.value} after reduce={series.reduce.value}")
        if weight < 0:
            raise ValueError(f"{key}: weight={weight} must be >= 0")
        series.values.append(float(value))
        series.weights.append(float(weight))

    def compute(self) -> dict[str, float]:
        """The reduced value of every key added so far."""
        return {key: _reduce(series) for key, series in self._series.items()}

    def merge(self, other: MetricAggregator) -> MetricAggregator:
        """Add every value of ``other`` to this aggregator (same reducer per key); returns self."""
        for key, series in other._series.items():
            for value, weight in zip(series.values, series.weights, strict=False):
                self.add(key, value, series.reduce, weight)
        return self

    def state(self) -> dict[str, tuple[str, list[float], list[float]]]:
        """Plain data (reducer name, values, weights per key), e.g. to gather from every rank."""
        return {key: (s.reduce.value, list(s.values), list(s.weights)) for key, s in self._series.items()}

    @classmethod
    def from_states(cls, states: Iterable[Mapping[str, tuple[str, list[float], list[float]]]]) -> MetricAggregator:
        """One aggregator holding the values of every state (e.g. one per rank, in rank order)."""
        merged = cls()
        for state in states:
            for key, (reduce, values, weights) in state.items():
                for value, weight in zip(values, weights, strict=False):
                    merged.add(key, value, Reduce(reduce), weight)
        return merged


def _reduce(series: _Series) -> float:
    values, weights = series.values, series.weights
    if series.reduce is Reduce.MEAN:
        return sum(values) / len(values)
    if series.reduce is Reduce.WEIGHTED_MEAN:
        total = sum(weights)
        return sum(v * w for v, w in zip(values, weights, strict=False)) / total if total else 0.0
    if series.reduce is Reduce.SUM:
        return sum(values)
    if series.reduce is Reduce.MIN:
        return min(values)
    if series.reduce is Reduce.MAX:
        return max(values)
    return values[-1]
