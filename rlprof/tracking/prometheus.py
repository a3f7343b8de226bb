"""``prometheus`` backend: each step's scalars as gauges on an HTTP endpoint of this process, for a Prometheus
server to scrape; ``rl_insight`` is verl's spelling (its metric names).

A metric key becomes a gauge named ``rlprof_`` + the key with ``/`` (and any other character a Prometheus name cannot
hold) as ``_``: ``timing_s/gen`` -> ``rlprof_timing_s_gen``; the original key is the gauge's help text. Every series
carries the labels ``project``, ``experiment``, ``rank`` and ``role``. Besides the logged keys:

- ``rlprof_step``: the last logged step; ``rlprof_step_logged_timestamp_seconds``: when it was logged (Unix time), so
  that ``time() - rlprof_step_logged_timestamp_seconds`` is how long the process has not finished a step;
- ``rlprof_step_seconds``: a histogram of ``timing_s/step`` (the step's wall time), for quantiles over any range;
- ``rlprof_nonfinite{key="..."}`` = 1 for each key whose last value is NaN or infinite;
- the process's own ``process_*`` series (resident memory, CPU seconds, open descriptors);
- the samples of the live sources (:meth:`Tracker.add_live`, the watchdog's phase), read at each scrape;
- a vLLM engine's own ``vllm:*`` series when one runs in this process with statistics on (KV-cache use, running and
  waiting requests, tokens, latencies), with the run's labels added.

The alert rules on these names are ``prometheus_rules.yml`` beside this module (``rlprof prometheus rules``).

Each process serves its own endpoint: ``http://{host}:{port + local_rank}/metrics`` (``host`` the loopback unless
another is asked for), and writes ``{log_dir}/prometheus_targets/rank{R}.json``, a Prometheus ``file_sd`` file naming
that endpoint; a server given ``file_sd_configs: [{files: ["{log_dir}/prometheus_targets/*.json"]}]`` scrapes every
rank of the run. The file is removed when the process closes the backend (a finished run is not a missing target); a
crashed process leaves it, and its target then shows down, which is what the alerts on a missing rank look for.
"""

from __future__ import annotations

import json
import math
import re
import socket
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Optional

from rlprof.atomic_file import write_text_atomically
from rlprof.tracking.base import Backend, BackendContext, LiveSample, LiveSource, register_backend

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 9490
"""The base port: rank ``R`` of a node serves on ``DEFAULT_PORT + local rank``."""
STEP_SECONDS_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, math.inf)
"""``rlprof_step_seconds``' buckets: a step of an RL run takes from a tenth of a second (a toy) to most of an hour."""
TARGETS_FOLDER = "prometheus_targets"

_NOT_IN_A_NAME = re.compile(r"[^a-zA-Z0-9_]")


def metric_name(prefix: str, key: str) -> str:
    """The Prometheus name of a metric key: ``prefix`` + the key with every character a name cannot hold as ``_``
    (``val-core/gsm8k/reward/mean@4`` -> ``val_core_gsm8k_reward_mean_4``)."""
    return prefix + _NOT_IN_A_NAME.sub("_", key)


def serve(registry: Any, host: str, port: int) -> tuple[Any, threading.Thread]:
    """``registry`` at ``http://{host}:{port}/metrics`` in Prometheus' text format (0.0.4), whatever the scraper
    asks: prometheus_client 0.26 writes OpenMetrics sample names with a name's colons as ``_``
    (``vllm:kv_cache_usage_perc`` scraped as ``vllm_kv_cache_usage_perc`` by a Prometheus 2 server); the text format
    keeps them. A thread serves it; ``shutdown()`` and ``server_close()`` stop it."""
    from wsgiref.simple_server import make_server

    from prometheus_client.exposition import (
        CONTENT_TYPE_PLAIN_0_0_4,
        ThreadingWSGIServer,
        _SilentHandler,
        generate_latest,
    )

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        if environ.get("PATH_INFO", "/") not in ("/", "/metrics"):
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"rlprof: the metrics are at /metrics\n"]
        body = generate_latest(registry)
        start_response("200 OK", [("Content-Type", CONTENT_TYPE_PLAIN_0_0_4), ("Content-Length", str(len(body)))])
        return [body]

    class Server(ThreadingWSGIServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    server = make_server(host, port, app, Server, handler_class=_SilentHandler)
    thread = threading.Thread(target=server.serve_forever, name=f"rlprof-prometheus-{port}", daemon=True)
    thread.start()
    return server, thread


def scrape_config(log_dirs: list[Path], interval: str = "15s", rules: Optional[Path] = None) -> dict[str, Any]:
    """A whole ``prometheus.yml`` (JSON is YAML): one job, ``rlprof``, whose targets are the ``file_sd`` files every
    rank of the runs logging under ``log_dirs`` writes (so it stays current as ranks come and go)."""
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        **({"rule_files": [str(rules.resolve())]} if rules is not None else {}),
        "scrape_configs": [
            {
                "job_name": "rlprof",
                "file_sd_configs": [
                    {"files": [str(folder.resolve() / TARGETS_FOLDER / "*.json") for folder in log_dirs]}
                ],
            }
        ],
    }


@register_backend("prometheus")
class PrometheusBackend(Backend):
    """Gauges of the last value of every logged key, served over HTTP by this process (see the module's text).

    Options (``Tracker(..., options={"prometheus": {...}})``, the trainer's ``trainer.prometheus``): ``host`` (default
    the loopback; ``0.0.0.0`` serves on every interface and names this machine's host name in the targets file),
    ``port`` (the base port), ``role`` (the ``role`` label, default ``trainer``). A port in use stops this backend
    only, with an error naming the port and the setting to change.
    """

    prefix = "rlprof_"
    per_rank = True

    def __init__(self, context: BackendContext) -> None:
        from prometheus_client import CollectorRegistry, Histogram, ProcessCollector

        options = dict(context.options.get("prometheus", {}))
        host = str(options.get("host", DEFAULT_HOST))
        self.port = int(options.get("port", DEFAULT_PORT)) + context.local_rank
        self.labels = {
            "project": context.project,
            "experiment": context.experiment,
            "rank": str(context.rank),
            "role": str(options.get("role", "trainer")),
        }
        own = ("step", "step_logged_timestamp_seconds", "step_seconds", "nonfinite")
        self.owners = {self.prefix + name: "" for name in own}
        """Prometheus name -> the metric key it shows ("": rlprof's own series, which no key may take)."""
        self.values: dict[str, float] = {}
        """Prometheus name -> the key's last value."""
        self.clashes: set[tuple[str, str]] = set()
        self.live: list[LiveSource] = []
        self.step: float = math.nan
        self.logged_at: float = math.nan
        self.lock = threading.Lock()
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self.registry.register(_LastValues(self))
        self.step_seconds = Histogram(
            self.prefix + "step_seconds",
            "the step's wall time (timing_s/step)",
            list(self.labels),
            registry=self.registry,
            buckets=STEP_SECONDS_BUCKETS,
        ).labels(**self.labels)
        try:
            self.server, self.thread = serve(self.registry, host, self.port)
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"port {self.port} on {host} is not free for rank {context.rank}'s metrics ({exc.strerror}): choose "
                "another base port with trainer.prometheus.port (or Tracker's options={'prometheus': {'port': ...}}); "
                "rank R serves on the base port + its local rank",
            ) from None
        self.targets_file = context.log_dir / TARGETS_FOLDER / f"rank{context.rank}.json"
        self._write_targets(host)

    def _write_targets(self, host: str) -> None:
        """This endpoint as a ``file_sd`` target group. Its labels are prefixed ``rlprof_``: a target label of the
        same name as a series label would rename the series' own (``exported_rank``)."""
        address = socket.getfqdn() if host in ("", "0.0.0.0", "::") else host
        target = f"[{address}]:{self.port}" if ":" in address else f"{address}:{self.port}"
        labels = {f"rlprof_{name}": value for name, value in self.labels.items()}
        self.targets_file.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(self.targets_file, json.dumps([{"targets": [target], "labels": labels}]) + "\n")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        with self.lock:
            for key, value in metrics.items():
                name = metric_name(self.prefix, key)
                owner = self.owners.setdefault(name, key)
                if owner == key:
                    self.values[name] = value
                else:
                    self._warn_clash(name, owner, key)
            self.step = float(step)
            self.logged_at = time.time()
        seconds = metrics.get("timing_s/step")
        if seconds is not None and math.isfinite(seconds):
            self.step_seconds.observe(seconds)

    def add_live(self, source: LiveSource) -> None:
        self.live.append(source)

    def _warn_clash(self, name: str, owner: str, key: str) -> None:
        if (name, key) in self.clashes:
            return
        self.clashes.add((name, key))
        taken_by = f"the metric {owner!r}" if owner else "rlprof's own series"
        warnings.warn(
            f"prometheus: the metric {key!r} makes the name {name}, taken by {taken_by}; {key!r} is left out",
            RuntimeWarning,
            stacklevel=4,
        )

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()
        self.targets_file.unlink(missing_ok=True)


@register_backend("rl_insight")
class RLInsightBackend(PrometheusBackend):
    """verl's ``trainer.logger`` entry ``rl_insight`` (RL-Insight's gauges, which verl pushes to an RL-Insight server):
    the same endpoint, with RL-Insight's names: ``rl_insight_monitor_`` + the key with ``/`` as ``_``. Options under
    ``prometheus`` as for :class:`PrometheusBackend`."""

    prefix = "rl_insight_monitor_"


class _LastValues:
    """The collector of a :class:`PrometheusBackend`'s gauges, read at each scrape: the last logged values,
    ``{prefix}nonfinite{key}`` = 1 for each of them that is NaN or infinite, and the live sources' samples."""

    def __init__(self, backend: PrometheusBackend) -> None:
        self.backend = backend

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        backend = self.backend
        names, values = list(backend.labels), list(backend.labels.values())
        with backend.lock:
            last = sorted((name, backend.owners[name], value) for name, value in backend.values.items())
            step, logged_at = backend.step, backend.logged_at
        for name, key, value in last:
            family = GaugeMetricFamily(name, f"rlprof metric {key}", labels=names)
            family.add_metric(values, value)
            yield family
        nonfinite = [key for _, key, value in last if not math.isfinite(value)]
        if nonfinite:
            family = GaugeMetricFamily(
                backend.prefix + "nonfinite",
                "1 for each logged metric whose last value is NaN or infinite",
                labels=[*names, "key"],
            )
            for key in nonfinite:
                family.add_metric([*values, key], 1.0)
            yield family
        for name, text, value in (
            ("step", "the last logged step", step),
            ("step_logged_timestamp_seconds", "when the last step was logged (Unix time)", logged_at),
        ):
            if not math.isnan(value):
                family = GaugeMetricFamily(backend.prefix + name, text, labels=names)
                family.add_metric(values, value)
                yield family
        yield from self._live(names, values)
        yield from self._engine(backend.labels)

    @staticmethod
    def _engine(labels: Mapping[str, str]) -> Iterator[Any]:
        """vLLM's own ``vllm:*`` series of an engine in this process (it registers them in prometheus_client's
        default registry when it keeps statistics: ``disable_log_stats=false``), with the run's labels added."""
        if "vllm" not in sys.modules:
            return
        from prometheus_client import REGISTRY
        from prometheus_client.metrics_core import Metric

        for family in REGISTRY.collect():
            if not family.name.startswith("vllm:"):
                continue
            copy = Metric(family.name, family.documentation, family.type, family.unit)
            copy.samples = [sample._replace(labels={**sample.labels, **labels}) for sample in family.samples]
            yield copy

    def _live(self, names: list[str], values: list[str]) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        samples: list[LiveSample] = [sample for source in self.backend.live for sample in source()]
        families: dict[str, Any] = {}
        for sample in samples:
            name = metric_name(self.backend.prefix, sample.key)
            if name not in families:
                families[name] = GaugeMetricFamily(
                    name, f"rlprof live value {sample.key}", labels=[*names, *sample.labels]
                )
            families[name].add_metric([*values, *sample.labels.values()], sample.value)
        yield from families.values()
