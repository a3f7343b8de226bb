"""The profiler session: config, rank and world, the current step, the step windows and the active tool.

There is at most one session per process (:func:`init` replaces the previous one). Ranges reach the tool through
one :class:`RoleGate` per role; the session opens a role's gate only while a step window is open and the role is
enabled on this rank, so a closed gate is the whole cost of a range that does not record.

Which roles record: with no role blocks in the config, every role records on rank 0. With role blocks, exactly
the declared roles record, each on its ``ranks`` (or every rank with ``all_ranks``). A rank where no role records
starts no tool and writes no file.
"""

from __future__ import annotations

import atexit
import os
import threading
import warnings
from typing import Any, Optional

from rlprof.config import ProfilerConfig, load_config
from rlprof.manifest import Manifest
from rlprof.tools import Tool, ToolContext, create_tool


class RoleGate:
    """Whether ranges of one role record right now, and the tool entry point they call when they do.

    ``enter(site)`` is the active tool's ``enter_range``: it opens the range and returns its closer, so a range
    always closes with the tool it opened with. ``fail(exc)`` reports a tool error to the session.
    """

    __slots__ = ("role", "open", "enter", "fail")

    def __init__(self, role: str) -> None:
        self.role = role
        self.open = False
        self.enter: Any = None
        self.fail: Any = None

    def __repr__(self) -> str:
        return f"RoleGate({self.role!r}, open={self.open})"


_gates: dict[str, RoleGate] = {}
_gates_lock = threading.Lock()
_current: Optional["Session"] = None


def gate_for(role: str) -> RoleGate:
    """The gate of ``role`` (created on first use, opened at once if the current session records it)."""
    gate = _gates.get(role)
    if gate is None:
        with _gates_lock:
            gate = _gates.get(role)
            if gate is None:
                gate = RoleGate(role)
                if _current is not None:
                    _current._sync_gate(gate)
                _gates[role] = gate
    return gate


def detect_rank_world() -> tuple[int, int]:
    """(rank, world size) from torch.distributed when initialised, else ``RANK``/``WORLD_SIZE``, else (0, 1)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except ImportError:
        pass
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


class Session:
    """One profiling run in this process. Use :func:`rlprof.init` rather than building it directly."""

    def __init__(self, config: Any = None, *, rank: Optional[int] = None, world_size: Optional[int] = None) -> None:
        detected_rank, detected_world = detect_rank_world()
        self.rank = detected_rank if rank is None else rank
        self.world_size = detected_world if world_size is None else world_size
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank={self.rank} is outside the world (world_size={self.world_size})")
        self.config: ProfilerConfig = load_config(config, world_size=self.world_size)
        self.selection = self.config.step_selection()
        self.current_step: Optional[int] = None
        self.step_open = False
        self.window_open = False
        self._lock = threading.RLock()
        self._warned: set[str] = set()
        self.tool: Optional[Tool] = None
        tool_name = self.config.global_profiler.tool
        if tool_name is not None and self.records_on_this_rank:
            self._create_tool(tool_name)

    # ------------------------------------------------------------------ who records

    def role_enabled(self, role: str) -> bool:
        """Whether ``role``'s ranges record on this rank (inside selected steps, with a tool active)."""
        if not self.config.roles:
            return self.rank == 0
        block = self.config.roles.get(role)
        if block is None or not block.enable:
            return False
        return block.all_ranks or self.rank in block.ranks

    @property
    def records_on_this_rank(self) -> bool:
        if not self.config.roles:
            return self.rank == 0
        return any(self.role_enabled(role) for role in self.config.roles)

    @property
    def tool_name(self) -> Optional[str]:
        """The active tool's name, or None when nothing records on this rank (or the tool was turned off)."""
        return self.tool.name if self.tool is not None else None

    # ------------------------------------------------------------------ steps

    def begin_step(self, step: int) -> None:
        """Step ``step`` starts now (ending the previous one); opens or continues a window if it is selected."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"rlprof.step: step={step!r} must be an integer >= 0")
        with self._lock:
            if self.step_open:
                self.end_step()
            self.current_step = step
            self.step_open = True
            if self.tool is None:
                return
            if self.window_open and (step != self.tool.window_last + 1 or step not in self.selection):
                self._stop_window()
            if step in self.selection:
                if self.window_open:
                    self._guarded("advancing to step %d" % step, self.tool.advance, step)
                else:
                    self._start_window(step)

    def end_step(self) -> None:
        """The current step is over; the window closes when the next step is not selected."""
        with self._lock:
            if not self.step_open:
                return
            self.step_open = False
            if self.window_open and self.current_step is not None and self.current_step + 1 not in self.selection:
                self._stop_window()

    def shutdown(self) -> None:
        """End the step, close an open window (writing its files) and release the tool. Idempotent."""
        global _current
        with self._lock:
            if self.step_open:
                self.end_step()
            if self.window_open:
                self._stop_window()
            if self.tool is not None:
                tool, self.tool = self.tool, None
                try:
                    tool.close()
                except Exception as exc:  # closing must not raise out of atexit
                    self.warn_once(f"close:{tool.name}", f"rlprof: closing the {tool.name} tool failed: {exc}")
        atexit.unregister(self.shutdown)
        with _gates_lock:
            if _current is self:
                _current = None

    # ------------------------------------------------------------------ windows and gates

    def _create_tool(self, name: str) -> None:
        save_path = self.config.global_profiler.save_path
        try:
            os.makedirs(save_path, exist_ok=True)
            if not os.access(save_path, os.W_OK):
                raise PermissionError(f"{save_path} is not writable")
            context = ToolContext(self.config, self.rank, self.world_size, Manifest(save_path))
            self.tool, note = create_tool(name, context)
        except Exception as exc:
            self.warn_once(
                f"create:{name}", f"rlprof: the {name} tool could not start ({type(exc).__name__}: {exc}); profiling is off"
            )
            return
        if note:
            self.warn_once(f"note:{name}", f"rlprof: {note}")

    def _start_window(self, step: int) -> None:
        assert self.tool is not None
        if self._guarded(f"starting the window at step {step}", self.tool.start_window, step):
            self.window_open = True
            with _gates_lock:
                for gate in _gates.values():
                    self._sync_gate(gate)

    def _stop_window(self) -> None:
        self.window_open = False
        with _gates_lock:
            for gate in _gates.values():
                gate.open = False
        if self.tool is not None:
            self._guarded("writing the window's output", self.tool.stop_window)

    def _sync_gate(self, gate: RoleGate) -> None:
        tool = self.tool
        if self.window_open and tool is not None and self.role_enabled(gate.role):
            gate.enter, gate.fail = tool.enter_range, self._range_failed
            gate.open = True
        else:
            gate.open = False

    def _guarded(self, action: str, method: Any, *args: Any) -> bool:
        """Call a tool method; on error warn once and turn the tool off. True when it succeeded."""
        try:
            method(*args)
            return True
        except Exception as exc:
            self._disable_tool(action, exc)
            return False

    def _range_failed(self, exc: BaseException) -> None:
        with self._lock:
            self._disable_tool("recording a range", exc)

    def _disable_tool(self, action: str, exc: BaseException) -> None:
        tool, self.tool = self.tool, None
        self.window_open = False
        with _gates_lock:
            for gate in _gates.values():
                gate.open = False
        if tool is None:
            return
        self.warn_once(
            f"failed:{tool.name}",
            f"rlprof: the {tool.name} tool failed while {action} ({type(exc).__name__}: {exc}); "
            "it is turned off for the rest of this run and the program goes on",
        )
        try:
            tool.close()
        except Exception:
            pass  # already reported the failure that matters

    def warn_once(self, key: str, message: str) -> None:
        """Emit ``message`` as a RuntimeWarning the first time ``key`` is seen in this session."""
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)


def init(config: Any = None, *, rank: Optional[int] = None, world_size: Optional[int] = None) -> Session:
    """Start the process's profiling session from a config (mapping, DictConfig, YAML path or ProfilerConfig).

    Replaces (and shuts down) any previous session. The session shuts down at interpreter exit, writing the
    files of an open window, so a crash that unwinds normally loses no trace.
    """
    global _current
    session = Session(config, rank=rank, world_size=world_size)
    previous = _current
    if previous is not None:
        previous.shutdown()
    with _gates_lock:
        _current = session
    atexit.register(session.shutdown)
    return session


def get_session() -> Optional[Session]:
    """The current session, or None before :func:`init` / after :func:`shutdown`."""
    return _current


def shutdown() -> None:
    """Shut down the current session, if any."""
    if _current is not None:
        _current.shutdown()


class StepScope:
    """Returned by :func:`step`: the step has begun; used as a context manager it also ends at ``with`` exit."""

    __slots__ = ("session", "step")

    def __init__(self, session: Optional[Session], step: int) -> None:
        self.session = session
        self.step = step

    def __enter__(self) -> "StepScope":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        session = self.session
        if session is not None and session.step_open and session.current_step == self.step:
            session.end_step()


def step(n: int) -> StepScope:
    """Begin training step ``n``: ``rlprof.step(n)`` at the top of each step, or ``with rlprof.step(n): ...``."""
    session = _current
    if session is not None:
        session.begin_step(n)
    return StepScope(session, n)
