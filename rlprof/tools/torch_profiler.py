"""torch.profiler over each step window: one gzipped Chrome trace per window per rank.

Files: ``{save_path}/torch/step{S}[-{E}]/rank{R}.pt.trace.json.gz``. Each step of the window is a
``ProfilerStep#{step}`` span (training step numbers, not counted from 0), each range a
``record_function("role/name")``, and the trace carries ``distributedInfo`` (rank, world size) even without
torch.distributed, so Holistic Trace Analysis and TensorBoard's PyTorch profiler plugin read it.

The trace is exported beside its final place (never through ``$TMPDIR``), checked to be complete, and gzipped
with its final name in the gzip header and as ``traceName``; an incomplete export (a full disk) is reported and
left out of the manifest.
"""

from __future__ import annotations

import gzip
import json
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rlprof.manifest import free_name
from rlprof.tools.base import RangeOps, RangeSite, StepWindowSettings, Tool, ToolContext
from rlprof.tools.registry import register_tool
from rlprof.window import StepWindow

TRACE_SUFFIX = ".pt.trace.json.gz"
TorchContent = Literal["cpu", "cuda", "shapes", "stack", "memory", "flops", "modules"]
_TRACE_NAME = re.compile(rb'("traceName"\s*:\s*)"(?:[^"\\]|\\.)*"')


@dataclass
class TorchSettings(StepWindowSettings):
    """torch.profiler over each step window, one gzipped Chrome trace per window per rank."""

    contents: list[TorchContent] = field(default_factory=list)
    """Extra detail: cpu, cuda (activities; both on where available by default), shapes, stack, memory, flops,
    modules."""
    discrete: bool = False
    """Accepted for verl compatibility; the torch tool always writes one trace per window per process."""


def effective_contents(contents: Any) -> frozenset[str]:
    """What a ``contents`` list records: as given, with both activities (cpu, cuda) when it names neither."""
    given = frozenset(contents or ())
    return given if given & {"cpu", "cuda"} else given | {"cpu", "cuda"}


def free_results(profiler: Any) -> None:
    """Free a stopped ``torch.profiler.profile``'s results now. The object holds itself in a reference cycle (its
    ``action_map`` of bound methods), so what it recorded (torch's native event tree of the whole window) would wait
    for Python's full collection, which in a process holding torch runs only once every many windows: measured in
    the library loop, +7 MB of allocated (not freed) memory per 100 one-step ``torch_memory`` windows, released all
    at once by a full collection."""
    profiler.profiler = None


class IncompleteTrace(RuntimeError):
    """torch wrote a trace that is cut short (for example on a full disk)."""


def check_complete(path: Path) -> None:
    """Raise :class:`IncompleteTrace` unless ``path`` is a whole Chrome trace object (``{ ... }``, with events)."""
    size = path.stat().st_size if path.exists() else 0
    if size < 32:
        raise IncompleteTrace(f"the exported trace {path.name} has {size} bytes")
    with path.open("rb") as handle:
        head = handle.read(4096)
        handle.seek(max(0, size - 4096))
        tail = handle.read()
    if not head.lstrip().startswith(b"{") or not tail.rstrip().endswith(b"}") or b"traceEvents" not in head + tail:
        raise IncompleteTrace(f"the exported trace {path.name} ({size} bytes) is cut short")


def gzip_trace(source: Path, target: Path, final_name: Path) -> None:
    """Gzip ``source`` into ``target`` with ``final_name`` in the gzip header and as the trace's ``traceName``."""
    name = json.dumps(str(final_name))[1:-1].encode()
    with (
        source.open("rb") as fin,
        target.open("wb") as raw,
        gzip.GzipFile(filename=final_name.name, mode="wb", fileobj=raw, mtime=int(source.stat().st_mtime)) as out,
    ):
        for line in fin:
            out.write(
                _TRACE_NAME.sub(lambda m: m.group(1) + b'"' + name + b'"', line) if b'"traceName"' in line else line
            )


def _record_every_step(step: int) -> Any:
    """A schedule that records every step; it makes torch emit the ``ProfilerStep#N`` spans."""
    from torch.profiler import ProfilerAction

    return ProfilerAction.RECORD


@register_tool("torch", config=TorchSettings, engine_profiler="torch")
class TorchProfilerTool(Tool):
    """Runs one ``torch.profiler.profile`` per step window."""

    def __init__(self, context: ToolContext) -> None:
        super().__init__(context)
        import torch
        from torch.profiler import ProfilerActivity

        contents = effective_contents(context.settings.contents)
        activities = {ProfilerActivity.CPU} if "cpu" in contents else set()
        if torch.cuda.is_available() and "cuda" in contents:
            activities.add(ProfilerActivity.CUDA)
        self.activities = sorted(activities, key=str)
        self.options: dict[str, Any] = dict(
            record_shapes="shapes" in contents,
            with_stack="stack" in contents,
            profile_memory="memory" in contents,
            with_flops="flops" in contents,
            with_modules="modules" in contents,
        )
        self.profiler: Any = None
        self._handles = threading.local()
        self.labels: set[str] = set()
        """The ranges opened in the window: the trace lists them as rlprof's (readers tell them from the program's own
        ``role/name``-looking annotations)."""

    def start_window(self, window: StepWindow) -> None:
        import torch
        from torch.profiler import _ExperimentalConfig  # type: ignore[attr-defined]  # public in torch.profiler

        # Every thread's ranges (rollout and reward threads too), except with "memory": torch records no allocation
        # events when it follows all threads, so then it follows the threads that start profiled work.
        all_threads = not self.options["profile_memory"]
        profiler = torch.profiler.profile(
            activities=self.activities,
            schedule=_record_every_step,
            experimental_config=_ExperimentalConfig(profile_all_threads=all_threads),
            **self.options,
        )
        profiler.step_num = window.first
        self.labels = set()
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            info = {"backend": "none", "rank": self.context.rank, "world_size": self.context.world_size}
            profiler.preset_metadata_json("distributedInfo", json.dumps(info))
        profiler.start()
        self.profiler = profiler

    def advance(self, window: StepWindow) -> None:
        self.profiler.step()

    def stop_window(self, window: StepWindow) -> None:
        profiler, self.profiler = self.profiler, None
        profiler.add_metadata_json("rlprof", json.dumps({"ranges": sorted(self.labels)}))  # which frames are rlprof's
        profiler.stop()
        try:
            self._write(profiler, window)
        finally:
            free_results(profiler)

    def _write(self, profiler: Any, window: StepWindow) -> None:
        final = free_name(self.context.window_dir(self.name, window) / f"rank{self.context.rank}{TRACE_SUFFIX}")
        exported = self.context.temp_path(final.with_name(final.name.removesuffix(".gz")))
        packed = self.context.temp_path(final)
        try:
            profiler.export_chrome_trace(str(exported))
            try:
                check_complete(exported)
            except IncompleteTrace as exc:
                self.context.warn(
                    f"torch:incomplete:{window.index}",
                    f"rlprof: the torch trace of window {window.name} was not written ({exc}; is the "
                    f"disk under {self.context.save_path} full?); it is left out of the manifest",
                )
                return
            gzip_trace(exported, packed, final)
            self.context.publish(self.name, packed, final, window, format="chrome_trace")
        finally:
            kineto_partial = exported.with_name(exported.name + ".tmp")  # kineto writes here, then renames
            for leftover in (exported, kineto_partial, packed):
                if leftover.exists():
                    leftover.unlink()

    def range_ops(self, site: RangeSite) -> RangeOps:
        import torch

        enter_op = torch.ops.profiler._record_function_enter_new
        exit_op = torch.ops.profiler._record_function_exit._RecordFunction
        label, local = site.label, self._handles

        def enter() -> None:
            self.labels.add(label)
            handle = enter_op(label, None)
            stack = getattr(local, "stack", None)
            if stack is None:
                stack = local.stack = []
            stack.append(handle)

        def exit_() -> None:
            exit_op(local.stack.pop())

        return enter, exit_

    def close(self) -> None:
        if self.profiler is not None:  # turned off mid-window: stop recording, write nothing
            profiler, self.profiler = self.profiler, None
            profiler.stop()
            free_results(profiler)
