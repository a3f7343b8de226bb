"""Host (CPU) allocation timeline of a step window: the host-side equivalent of a CUDA memory snapshot.

torch's profiler records every CPU allocator event (``profile_memory=True``, on the CPU build too), with the Python
stack that made it (``with_stack=True``). Each window is recorded that way; each rlprof range also opens a
``record_function`` of its ``role/name`` label, so every allocation is attributed to the innermost range open on its
thread. What was alive before the window is a census taken when it starts: every live CPU tensor storage, named by
the path that reaches it from an object whose class has methods decorated with ``@rlprof.profiled(role=...)``
(``Actor.engine.optimizer.optimizer.state``, tagged with that role), else ``(other live tensors)``.

File: ``{save_path}/torch_memory/step{S}[-{E}]/rank{R}_pid{P}.host_alloc.json.gz``, JSON in format
``rlprof-host-alloc/1``::

    {"format": "rlprof-host-alloc/1", "device": "cpu", "rank": R, "pid": P, "steps": [S, ..., E],
     "stacks": [["model.py:11 attention", "train.py:7 main"], ...],      # innermost frame first
     "alive_at_start": [{"addr": A, "bytes": B, "range": "actor", "site": "Actor.engine... state"}, ...],
     "events": [{"t_us": T, "action": "alloc"|"free", "addr": A, "bytes": B, "range": "actor/update_actor",
                 "stack": 0}, ...],                                      # stack: index into stacks, or null
     "dropped": D}                                                       # oldest events beyond the bound

``t_us`` counts from the window's start. At most ``trace_alloc_max_entries`` events are kept (the newest, as the
CUDA ring buffer does); the dropped ones are folded into ``alive_at_start`` and counted in ``dropped``. A free of
memory allocated before the window and missed by the census (not a tensor) is listed in ``alive_at_start`` as
``(allocated before the window)``, so live bytes never go below zero.
"""

from __future__ import annotations

import gc
import gzip
import json
import os
import sys
import threading
import types
import warnings
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from rlprof.tools.base import ToolContext, decorated_sites
from rlprof.tools.torch_profiler import free_results
from rlprof.window import StepWindow

FORMAT = "rlprof-host-alloc/1"
SUFFIX = ".host_alloc.json.gz"
INTERNAL_FRAMES = ("/torch/", "/rlprof/annotate.py", "/rlprof/session.py", "/contextlib.py", "<frozen ")
"""Frames left out of allocation stacks (matched in ``/`` + the file name): torch's own and rlprof's wrappers."""
CENSUS_NODES = 200_000
"""Objects visited at most when naming the live tensors at a window's start."""
CENSUS_DEPTH = 12
OTHER_TENSORS = "(other live tensors)"
BEFORE_WINDOW = "(allocated before the window)"


Allocated = tuple[int, int, int, int, Optional[tuple[str, ...]]]
"""(time in ns, thread, address, bytes: negative for a free, stack)."""


@dataclass
class _Alive:
    bytes: int
    range: str
    site: str


class HostAllocationRecorder:
    """Records one window at a time: :meth:`start`, ranges via :meth:`enter` / :meth:`exit`, :meth:`stop`."""

    def __init__(self, stack_depth: int, max_entries: int) -> None:
        self.stack_depth = stack_depth
        self.max_entries = max_entries
        self.labels: set[str] = set()
        self._profiler: Any = None
        self._census: dict[int, _Alive] = {}
        self._local = threading.local()

    @property
    def recording(self) -> bool:
        return self._profiler is not None

    def start(self) -> None:
        import torch

        self._census = live_tensor_census()
        profiler = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU],
            profile_memory=True,
            with_stack=self.stack_depth > 0,
        )
        profiler.start()
        self._profiler = profiler

    def enter(self, label: str) -> None:
        import torch

        if self._profiler is None:
            return
        self.labels.add(label)
        stack = getattr(self._local, "open", None)
        if stack is None:
            stack = self._local.open = []
        stack.append(torch.ops.profiler._record_function_enter_new(label, None))

    def exit(self) -> None:
        import torch

        stack = getattr(self._local, "open", None)
        if stack:
            torch.ops.profiler._record_function_exit._RecordFunction(stack.pop())

    def stop(self, rank: int, pid: int, steps: list[int]) -> dict[str, Any]:
        """End the window and return its document (see the module doc)."""
        profiler, self._profiler = self._profiler, None
        if profiler is None:
            raise RuntimeError("host allocation recording was not started")
        profiler.stop()
        try:
            roots = profiler.profiler.kineto_results.experimental_event_tree()
            return self._document(roots, rank, pid, steps)
        finally:
            free_results(profiler)

    def abandon(self) -> None:
        """Stop recording without writing anything (the tool is being turned off)."""
        profiler, self._profiler = self._profiler, None
        if profiler is not None:
            profiler.stop()
            free_results(profiler)

    # ----------------------------------------------------------------------------------------------- the tree

    def _collect(self, roots: list[Any]) -> tuple[list[Allocated], list[tuple[int, int, int, str]]]:
        """Every CPU allocation event (time ordered) and every rlprof range of the tree."""
        from torch._C._profiler import _EventType

        allocations: list[Allocated] = []
        ranges: list[tuple[int, int, int, str]] = []  # (start_ns, end_ns, tid, label)
        known_stacks: dict[int, tuple[str, ...]] = {}
        pending = list(roots)
        while pending:
            node = pending.pop()
            kind = node.tag
            if kind == _EventType.Allocation:
                fields = node.typed[1]
                if fields.device.type == "cpu" and fields.alloc_size:
                    stack = self._stack(node, known_stacks)
                    allocations.append(
                        (node.start_time_ns, node.start_tid, int(fields.ptr), int(fields.alloc_size), stack)
                    )
            elif kind == _EventType.TorchOp and node.name in self.labels:
                ranges.append((node.start_time_ns, node.end_time_ns, node.start_tid, node.name))
            pending.extend(node.children)
        allocations.sort(key=lambda a: a[0])
        return allocations, ranges

    def _document(self, roots: list[Any], rank: int, pid: int, steps: list[int]) -> dict[str, Any]:
        allocations, ranges = self._collect(roots)
        start_ns = min((root.start_time_ns for root in roots), default=None)
        labels = _innermost_ranges(allocations, ranges)
        stacks: dict[tuple[str, ...], int] = {}  # each distinct stack once; events refer to it by index
        stack_list: list[tuple[str, ...]] = []
        alive: dict[int, _Alive] = dict(self._census)
        before: dict[int, _Alive] = dict(self._census)  # alive at the window's start, as far as the events show
        events: deque[dict[str, Any]] = deque()
        dropped = 0
        origin = start_ns or 0
        for (t_ns, _, addr, size, stack), open_range in zip(allocations, labels, strict=True):
            if size > 0:
                alive[addr] = _Alive(size, open_range, "")
                event = {"t_us": (t_ns - origin) / 1000, "action": "alloc", "addr": addr, "bytes": size}
                event["range"] = open_range
            else:
                ended = alive.pop(addr, None)
                if ended is None:  # allocated before the window and not a tensor the census saw
                    before[addr] = ended = _Alive(-size, "", BEFORE_WINDOW)
                event = {"t_us": (t_ns - origin) / 1000, "action": "free", "addr": addr, "bytes": -size}
                event["range"] = ended.range or open_range  # a free belongs to the range that allocated it
            if stack and stack not in stacks:
                stacks[stack] = len(stack_list)
                stack_list.append(stack)
            event["stack"] = stacks[stack] if stack else None
            events.append(event)
            if len(events) > self.max_entries:  # keep the newest; the oldest become the start state
                oldest = events.popleft()
                dropped += 1
                if oldest["action"] == "alloc":
                    site = " < ".join(stack_list[oldest["stack"]]) if oldest["stack"] is not None else ""
                    before[oldest["addr"]] = _Alive(oldest["bytes"], oldest["range"], site)
                else:
                    before.pop(oldest["addr"], None)
        return {
            "format": FORMAT,
            "device": "cpu",
            "rank": rank,
            "pid": pid,
            "steps": steps,
            "stacks": [list(stack) for stack in stack_list],
            "alive_at_start": [
                {"addr": addr, "bytes": a.bytes, "range": a.range, "site": a.site} for addr, a in before.items()
            ],
            "events": list(events),
            "dropped": dropped,
        }

    def _stack(self, node: Any, known: dict[int, tuple[str, ...]]) -> Optional[tuple[str, ...]]:
        """The Python lines that led to an allocation, innermost first, without torch's and rlprof's own: the
        ``caller`` of each Python call above it (the line in the calling function, not the callee's first line).
        ``known`` holds the stacks of ancestors already seen, so each ancestor is read once per window."""
        if self.stack_depth == 0:
            return None
        from torch._C._profiler import _EventType

        python_calls = (_EventType.PyCall, _EventType.PyCCall)
        chain = []
        parent = node.parent
        while parent is not None and parent.id not in known:
            chain.append(parent)
            parent = parent.parent
        stack = known[parent.id] if parent is not None else ()
        for ancestor in reversed(chain):  # outermost first: each adds a frame inside the ones above it
            if ancestor.tag in python_calls:
                caller = ancestor.typed[1].caller
                if not any(marker in f"/{caller.file_name}" for marker in INTERNAL_FRAMES):
                    frame = f"{caller.file_name.rsplit('/', 1)[-1]}:{caller.line_number} {caller.function_name}"
                    stack = (frame, *stack)[: self.stack_depth]
            known[ancestor.id] = stack
        return stack or None


def _innermost_ranges(allocations: list[Allocated], ranges: list[tuple[int, int, int, str]]) -> list[str]:
    """The label of the innermost range open on the allocating thread at each allocation (``""``: none)."""
    by_thread: dict[int, list[tuple[int, int, int, str]]] = {}
    for r in sorted(ranges, key=lambda r: (r[0], -r[1])):
        by_thread.setdefault(r[2], []).append(r)
    labels = []
    for t_ns, tid, *_ in allocations:
        innermost = ""
        for start, end, _, label in by_thread.get(tid, ()):
            if start > t_ns:
                break
            if t_ns <= end:
                innermost = label  # later starts are nested deeper
        labels.append(innermost)
    return labels


# --------------------------------------------------------------------------------------------- the census


def role_holder_classes() -> dict[type, str]:
    """Classes with methods decorated by ``@rlprof.profiled(role=...)``, with that role."""
    found: dict[type, str] = {}
    for function, site in decorated_sites():
        owner_name, _, _ = function.__qualname__.rpartition(".")
        if not owner_name or "<locals>" in owner_name:
            continue
        owner: Any = sys.modules.get(function.__module__)
        for part in owner_name.split("."):
            owner = getattr(owner, part, None)
        if isinstance(owner, type):
            found[owner] = site.role
    return found


def live_tensor_census() -> dict[int, _Alive]:
    """Every live CPU tensor storage by address: named by the path from a role's object that reaches it (see the
    module doc), else :data:`OTHER_TENSORS`."""
    import torch

    holders = role_holder_classes()
    census: dict[int, _Alive] = {}
    with warnings.catch_warnings():  # touching every object wakes deprecated module attributes
        warnings.simplefilter("ignore")
        objects = gc.get_objects()
        for obj in [o for o in objects if type(o) in holders]:
            _walk(obj, type(obj).__name__, holders[type(obj)], census)
        for obj in objects:
            if isinstance(obj, torch.Tensor):
                _record_tensor(obj, OTHER_TENSORS, "", census)
    return census


def _record_tensor(tensor: Any, site: str, role: str, census: dict[int, _Alive]) -> None:
    try:
        if tensor.device.type != "cpu" or tensor.is_sparse:
            return
        storage = tensor.untyped_storage()
        address, size = storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError, AttributeError):  # meta, wrapper subclasses, no storage
        return
    if address and size and address not in census:
        census[address] = _Alive(size, role, site)


def _walk(root: Any, path: str, role: str, census: dict[int, _Alive]) -> None:
    """Breadth-first through attributes, containers, module parameters and optimizer states."""
    import torch

    seen: set[int] = set()
    queue: deque[tuple[Any, str, int]] = deque([(root, path, 0)])
    while queue and len(seen) < CENSUS_NODES:
        obj, where, depth = queue.popleft()
        if id(obj) in seen or depth > CENSUS_DEPTH:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            _record_tensor(obj, where, role, census)
            extra = getattr(obj, "__dict__", None)  # e.g. DeepSpeed's partitioned ds_tensor
            if extra:
                queue.extend((v, where, depth + 1) for v in extra.values())
        elif isinstance(obj, torch.optim.Optimizer):
            for state in obj.state.values():
                for value in state.values() if isinstance(state, dict) else ():
                    queue.append((value, f"{where}.state", depth + 1))
            for group in obj.param_groups:
                queue.extend((p, f"{where}.param_groups", depth + 1) for p in group.get("params", ()))
            queue.extend((v, f"{where}.{k}", depth + 1) for k, v in vars(obj).items() if k not in ("state",))
        elif isinstance(obj, torch.nn.Module):
            for parameter in obj.parameters():
                queue.append((parameter, f"{where} parameters", depth + 1))
                if parameter.grad is not None:
                    queue.append((parameter.grad, f"{where} gradients", depth + 1))
            for buffer in obj.buffers():
                queue.append((buffer, f"{where} buffers", depth + 1))
            queue.extend(
                (v, f"{where}.{k}", depth + 1)
                for k, v in vars(obj).items()
                if k not in ("_parameters", "_buffers", "_modules")
            )
        elif isinstance(obj, dict):
            queue.extend((v, f"{where}[*]", depth + 1) for v in list(obj.values())[:10_000])
        elif isinstance(obj, (list, tuple, set, frozenset, deque)):
            queue.extend((v, f"{where}[*]", depth + 1) for v in list(obj)[:10_000])
        elif _is_plain_instance(obj):
            queue.extend((v, f"{where}.{k}", depth + 1) for k, v in vars(obj).items())


def _is_plain_instance(obj: Any) -> bool:
    """An object whose attributes may hold tensors: not a module, class, function or value."""
    if obj is None or isinstance(obj, (str, bytes, int, float, bool, type, Path, *_NOT_HOLDERS)):
        return False
    return hasattr(obj, "__dict__") and type(obj).__module__ not in ("builtins", "threading", "logging")


_NOT_HOLDERS = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.ModuleType)


class HostAllocations:
    """A tool's host allocation timeline: one recorder, one ``*.host_alloc.json.gz`` per window (published)."""

    def __init__(self, context: ToolContext) -> None:
        settings = context.settings
        self.context = context
        self.recorder = HostAllocationRecorder(settings.stack_depth, settings.trace_alloc_max_entries)

    def start_window(self, window: StepWindow) -> None:
        try:
            self.recorder.start()
        except RuntimeError as exc:  # another profiler is running in this process
            self.context.warn(
                "torch_memory:host_alloc",
                f"rlprof: torch_memory: the host allocation timeline cannot be recorded ({exc}); RSS only",
            )

    def stop_window(self, window: StepWindow, tool: str) -> None:
        if not self.recorder.recording:
            return
        document = self.recorder.stop(self.context.rank, os.getpid(), window.steps)
        final = self.context.window_dir(tool, window) / f"rank{self.context.rank}_pid{os.getpid()}{SUFFIX}"
        tmp = self.context.temp_path(final)
        try:
            with gzip.open(tmp, "wt", encoding="utf-8", compresslevel=6) as handle:
                json.dump(document, handle, separators=(",", ":"))
            self.context.publish(tool, tmp, final, window, format="host_alloc")
        finally:
            if tmp.exists():
                tmp.unlink()
