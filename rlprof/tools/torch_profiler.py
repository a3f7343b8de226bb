"""torch.profiler over each step window: one gzipped Chrome trace per window per rank.

Files: ``{save_path}/torch/step{S}[-{E}]/rank{R}.pt.trace.json.gz``. Each step of the window is a
``ProfilerStep#{step}`` span (training step numbers, not counted from 0), each range a
``record_function("role/name")``, and the trace carries ``distributedInfo`` (rank, world size) even without
torch.distributed, so Holistic Trace Analysis and TensorBoard's PyTorch profiler plugin read it. verl's other
torch settings: a ``schedule`` over update mini-batches keeps the cycles it selects, one file each
(``rank{R}.mb{first}-{last}...``, no step spans); ``discrete`` gives each outermost range its own file
(``rank{R}.{role}.{name}...``); the rollout's token window is for an engine's own profiler (:func:`token_window`).

The trace is exported beside its final place (never through ``$TMPDIR``), checked to be complete, and gzipped
with its final name in the gzip header and as ``traceName``; an incomplete export (a full disk) is reported and
left out of the manifest.
"""

from __future__ import annotations

import gzip
import json
import re
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

from rlprof.manifest import free_name
from rlprof.mini_batches import MiniBatchSchedule
from rlprof.roles import RoleBlocks, governing_block, role_setting
from rlprof.tools.base import RangeOps, RangeSite, StepWindowSettings, Tool, ToolContext
from rlprof.tools.registry import register_tool
from rlprof.typed_config import bounds
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
    """True: each outermost range of a role is a trace of its own, as verl's discrete mode gives each stage its own
    (a role's block may set its own); False: one trace per window. Once any role is discrete there is no window
    trace: the ranges of the other roles are recorded inside the discrete ones they run in."""
    schedule: MiniBatchSchedule = field(default_factory=MiniBatchSchedule)
    """Which update mini-batches a window's trace keeps (:mod:`rlprof.mini_batches`), for roles without their own;
    off by default (the whole window)."""
    profile_token_start: Optional[int] = field(default=None, metadata=bounds(ge=0))
    """An inference engine's own profiler (vLLM's): the first response token it records, for roles without their
    own; null: from the first."""
    profile_token_end: Optional[int] = field(default=None, metadata=bounds(ge=1))
    """... and the token it stops before (exclusive); null: to the end."""


def role_schedule(settings: TorchSettings, roles: RoleBlocks, role: str) -> MiniBatchSchedule:
    """The schedule over ``role``'s mini-batches: its block's (or its parent's), else the global one."""
    schedule: MiniBatchSchedule = role_setting(roles, role, "schedule", settings)
    return schedule


def token_window(settings: TorchSettings, roles: RoleBlocks, role: str) -> tuple[int, Optional[int]]:
    """``(start, end)`` of the response tokens an engine's profiler records for ``role`` (end None: to the end),
    its block's (or its parent's) where set, else the global ones."""
    block = governing_block(roles, role)
    start = block.profile_token_start if block is not None else None
    end = block.profile_token_end if block is not None else None
    if start is None and end is None:  # an engine-profiling tool of the user's may not have the global ones
        start, end = getattr(settings, "profile_token_start", None), getattr(settings, "profile_token_end", None)
    return start or 0, end


def _enabled_schedules(settings: TorchSettings, roles: RoleBlocks) -> dict[MiniBatchSchedule, list[str]]:
    """Each enabled schedule, with where it is set."""
    where: dict[MiniBatchSchedule, list[str]] = {}
    if settings.schedule.enabled:
        where.setdefault(settings.schedule, []).append("global_profiler.global_tool_config.torch.schedule")
    for name, block in roles.items():
        if block.schedule is not None and block.schedule.enabled:
            where.setdefault(block.schedule, []).append(f"the {name} role's profiler.tool_config.torch.schedule")
    return where


def role_discrete(settings: TorchSettings, roles: RoleBlocks, role: str) -> bool:
    """Whether ``role``'s ranges are traces of their own: its block's (or its parent's) ``discrete``, else the
    global one."""
    return bool(role_setting(roles, role, "discrete", settings))


def _discrete(settings: TorchSettings, roles: RoleBlocks) -> bool:
    """The process records discrete traces (no window trace) when the global setting or any role's says so."""
    return settings.discrete or any(block.discrete for block in roles.values())


def check_settings(settings: TorchSettings, roles: RoleBlocks) -> list[str]:
    """What one torch profiler per process cannot honour, and the token windows' order."""
    problems = []
    discrete = _discrete(settings, roles)
    schedules = _enabled_schedules(settings, roles)
    if len(schedules) > 1:
        places = "; ".join(f"{', '.join(keys)}: {schedule}" for schedule, keys in schedules.items())
        problems.append(
            f"torch schedules differ ({places}): one torch profiler runs per process, so one schedule walks the "
            "update mini-batches of the roles that have it; give them the same one"
        )
    if discrete and schedules:
        keys = ", ".join(key for keys in schedules.values() for key in keys)
        problems.append(
            f"{keys}: a schedule over mini-batches with discrete torch traces is not implemented here (verl keeps "
            "the scheduled mini-batches in the update stage's own trace); use discrete=false, where the window's "
            "trace keeps them"
        )
    windows = [("global_profiler.global_tool_config.torch", settings.profile_token_start, settings.profile_token_end)]
    windows += [
        (f"the {name} role's profiler.tool_config.torch", block.profile_token_start, block.profile_token_end)
        for name, block in roles.items()
    ]
    for prefix, start, end in windows:
        if start is not None and end is not None and end <= start:
            problems.append(
                f"{prefix}.profile_token_end: {end} is not after profile_token_start={start}; the end is exclusive"
            )
    return problems


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


_UNSAFE = re.compile(r"[^0-9A-Za-z._=+-]+")


@register_tool(
    "torch",
    config=TorchSettings,
    per_role=("discrete", "schedule", "profile_token_start", "profile_token_end"),
    engine_profiler="torch",
    check=check_settings,
)
class TorchProfilerTool(Tool):
    """Runs one ``torch.profiler.profile`` per step window, or per outermost range in discrete mode.

    Continuous: each step of the window is a ``ProfilerStep#{step}`` span; with a schedule over mini-batches
    (:mod:`rlprof.mini_batches`) the profiler is walked by the mini-batches of the roles that have it instead (no
    step spans, as in verl), and each saved cycle is a file ``rank{R}.mb{first}-{last}``. Discrete: a range of a
    discrete role that opens while no trace is recording starts a profiler, and its end writes
    ``rank{R}.{role}.{name}``; ranges that open inside it (any role, any thread) are in that trace.
    """

    def __init__(self, context: ToolContext) -> None:
        super().__init__(context)
        import torch
        from torch.profiler import ProfilerActivity

        settings = context.settings
        contents = effective_contents(settings.contents)
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
        self.discrete = _discrete(settings, context.roles)
        schedules = list(_enabled_schedules(settings, context.roles))
        self.schedule: Optional[MiniBatchSchedule] = schedules[0] if schedules else None
        self._walks: dict[str, bool] = {}
        """Role -> whether its mini-batches walk the schedule."""
        self.profiler: Any = None
        self.window: Optional[StepWindow] = None
        self._handles = threading.local()
        self._lock = threading.Lock()
        self._open_ranges = 0
        self._discrete: Optional[tuple[RangeSite, StepWindow]] = None
        """Discrete mode: the outermost range open now and its window."""
        self.labels: set[str] = set()
        """The ranges opened in the trace being recorded: it lists them as rlprof's (readers tell them from the
        program's own ``role/name``-looking annotations)."""

    def _new_profiler(self, schedule: Any = None, on_trace_ready: Any = None) -> Any:
        import torch
        from torch.profiler import _ExperimentalConfig  # type: ignore[attr-defined]  # public in torch.profiler

        # Every thread's ranges (rollout and reward threads too), except with "memory": torch records no allocation
        # events when it follows all threads, so then it follows the threads that start profiled work.
        all_threads = not self.options["profile_memory"]
        profiler = torch.profiler.profile(
            activities=self.activities,
            schedule=schedule,
            on_trace_ready=on_trace_ready,
            experimental_config=_ExperimentalConfig(profile_all_threads=all_threads),
            **self.options,
        )
        self.labels = set()
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            info = {"backend": "none", "rank": self.context.rank, "world_size": self.context.world_size}
            profiler.preset_metadata_json("distributedInfo", json.dumps(info))
        return profiler

    def start_window(self, window: StepWindow) -> None:
        self.window = window
        if self.discrete:
            return
        if self.schedule is None:
            profiler = self._new_profiler(_record_every_step)
            profiler.step_num = window.first
        else:
            import torch

            s = self.schedule
            with warnings.catch_warnings():  # "won't be using warmup": verl's default, the user's choice
                warnings.simplefilter("ignore", UserWarning)
                walk = torch.profiler.schedule(
                    skip_first=s.skip_first, wait=s.wait, warmup=s.warmup, active=s.active, repeat=s.cycles
                )
            profiler = self._new_profiler(walk, lambda done: self._write(done, window, self._cycle_name(done)))
            profiler.record_steps = False  # a step of this schedule is a mini-batch, not a training step (verl)
        profiler.start()
        self.profiler = profiler

    def advance(self, window: StepWindow) -> None:
        if self.profiler is not None and self.schedule is None:
            self.profiler.step()

    def mini_batch_done(self, role: str) -> None:
        if self.profiler is None or self.schedule is None or self.discrete:
            return
        walks = self._walks.get(role)
        if walks is None:
            walks = self._walks[role] = role_schedule(self.context.settings, self.context.roles, role).enabled
        if walks:
            from torch.profiler import ProfilerAction

            if self.profiler.current_action is ProfilerAction.RECORD_AND_SAVE:  # this step saves the cycle
                self._label(self.profiler)
            self.profiler.step()

    def stop_window(self, window: StepWindow) -> None:
        self.window = None
        if self.discrete:  # each outermost range writes its own (one still open writes at its end)
            return
        profiler, self.profiler = self.profiler, None
        if profiler is None:
            return
        try:
            self._label(profiler)
            profiler.stop()  # a cycle the window ended in is saved too, shorter (verl keeps it)
            if self.schedule is None:
                self._write(profiler, window, "")
        finally:
            free_results(profiler)

    def _cycle_name(self, profiler: Any) -> str:
        assert self.schedule is not None
        first, last = self.schedule.kept(profiler.step_num)
        if last < 0:  # no mini-batch ran in the window
            return ""
        if first > last:
            return f".after-mb{last}"
        return f".mb{first}" if first == last else f".mb{first}-{last}"

    def _label(self, profiler: Any) -> None:
        """Name the ranges rlprof opened (which frames are rlprof's) in the trace being recorded."""
        from torch.profiler import ProfilerAction

        if profiler.current_action in (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE):
            profiler.add_metadata_json("rlprof", json.dumps({"ranges": sorted(self.labels)}))
            self.labels = set()

    def _write(self, profiler: Any, window: StepWindow, part: str, role: Optional[str] = None) -> None:
        name = f"rank{self.context.rank}{part}{TRACE_SUFFIX}"
        final = free_name(self.context.window_dir(self.name, window) / name)
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
            self.context.publish(self.name, packed, final, window, role, format="chrome_trace")
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

        if not (self.discrete and role_discrete(self.context.settings, self.context.roles, site.role)):
            return enter, exit_

        def enter_discrete() -> None:
            with self._lock:
                if self._open_ranges == 0 and self.window is not None:
                    self._start_discrete(site)
                self._open_ranges += 1
            enter()

        def exit_discrete() -> None:
            exit_()
            with self._lock:
                self._open_ranges -= 1
                if self._open_ranges == 0:
                    self._stop_discrete()

        return enter_discrete, exit_discrete

    def _start_discrete(self, site: RangeSite) -> None:
        assert self.window is not None
        profiler = self._new_profiler()
        profiler.start()
        self.profiler, self._discrete = profiler, (site, self.window)

    def _stop_discrete(self) -> None:
        profiler, opened = self.profiler, self._discrete
        self.profiler = self._discrete = None
        if profiler is None or opened is None:
            return
        site, window = opened
        try:
            self._label(profiler)
            profiler.stop()
            part = f".{_UNSAFE.sub('-', site.role)}.{_UNSAFE.sub('-', site.name)}"
            self._write(profiler, window, part, site.role)
        finally:
            free_results(profiler)

    def close(self) -> None:
        if self.profiler is not None:  # turned off mid-window: stop recording, write nothing
            profiler, self.profiler = self.profiler, None
            profiler.on_trace_ready = None
            profiler.stop()
            free_results(profiler)
