"""vLLM's scheduler statistics through its stat-logger interface: the KV cache's use at every engine iteration.

vLLM hands every stat logger each iteration's ``SchedulerStats`` (``kv_cache_usage``: the fraction of the KV cache's
blocks in use, 0..1, what its ``vllm:kv_cache_usage_perc`` gauge shows). The offline ``LLM`` class takes no loggers of
its own, so :func:`attach` adds one to the engine's logger manager, which exists when the engine keeps statistics
(``rollout.disable_log_stats=false``). Imports vLLM: load this module only where vLLM is installed."""

from __future__ import annotations

from typing import Any, Optional

from vllm.v1.metrics.loggers import AggregateStatLoggerBase


class KvCacheUsage(AggregateStatLoggerBase):
    """Collects ``kv_cache_usage`` of each engine iteration until :meth:`drain`."""

    def __init__(self, vllm_config: Any = None, engine_indexes: Optional[list[int]] = None):
        self.samples: list[float] = []

    def record(
        self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0
    ) -> None:
        if scheduler_stats is not None:
            self.samples.append(float(scheduler_stats.kv_cache_usage))

    def log_engine_initialized(self) -> None:
        pass

    def drain(self) -> list[float]:
        """The samples since the last drain."""
        samples, self.samples = self.samples, []
        return samples


def attach(llm: Any) -> Optional[KvCacheUsage]:
    """A :class:`KvCacheUsage` recording ``llm``'s iterations, or None when its engine keeps no statistics."""
    manager = getattr(llm.llm_engine, "logger_manager", None)
    if manager is None:
        return None
    usage = KvCacheUsage()
    manager.stat_loggers.append(usage)
    return usage
