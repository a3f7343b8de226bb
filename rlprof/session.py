"""The profiler session: config, rank and world, the current step, the step window and the active tool.

There is at most one session per process (:func:`init` replaces the previous one). Ranges reach the tool through
one :class:`RoleGate` per role; the session opens a role's gate only while a step window is open and the role is
enabled on this rank, so a closed gate is the whole cost of a range that does not record. Before opening a gate it
binds the tool's ``(enter, exit)`` pair to every site of the role (:meth:`rlprof.tools.RangeSite.bind`).

Which roles record: with no role blocks in the config, every role records on rank 0. With role blocks, exactly the
roles they govern (``rollout`` and ``ref`` follow ``actor`` unless they have their own), each on its ``ranks`` (or
every rank with ``all_ranks``). A rank where no role records starts no tool and writes no file.

Windows: each selected step is one :class:`~rlprof.window.StepWindow`; with ``profile_continuous_steps`` (verl's
key) or a step window (``step_start``..``step_end``) consecutive selected steps form one, from the start of its first
step to the end of its last, and what runs between two of its steps is recorded inside a ``step/between_steps``
range. Code
that follows windows (an engine's own profiler) subscribes with :meth:`Session.add_window_listener` and asks
:func:`rlprof.is_recording`. The session writes an open window's files at shutdown, at interpreter exit and on
SIGTERM/SIGINT (then hands the signal on to the handler that was there before); a forked child records nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Optional

from rlprof.config import ConfigError, ProfilerConfig, load_config
from rlprof.finish_hook import hook_environment, run_finish_hook
from rlprof.manifest import Manifest
from rlprof.tools import RangeSite, Tool, ToolContext, ToolSpec, create_tool, tool_spec
from rlprof.tools.base import remove_abandoned
from rlprof.window import StepWindow, WindowListener

GAP_SITE = RangeSite("step", "between_steps")
"""The range that covers what runs between two steps of one window."""


class RoleGate:
    """Whether ranges of one role record right now; the sites of the role; how a range reports a tool failure."""

    __slots__ = ("fail", "open", "role", "sites")

    def __init__(self, role: str) -> None:
        self.role = role
        self.open = False
        self.fail: Any = None
        self.sites: list[RangeSite] = []

    def __repr__(self) -> str:
        return f"RoleGate({self.role!r}, open={self.open})"


_gates: dict[str, RoleGate] = {}
_gates_lock = threading.RLock()
_current: Optional[Session] = None


def add_site(site: RangeSite) -> RoleGate:
    """Attach ``site`` to its role's gate (created on first use, opened at once if the current session records the
    role now) and return the gate."""
    with _gates_lock:
        gate = _gates.get(site.role)
        if gate is None:
            gate = _gates[site.role] = RoleGate(site.role)
        gate.sites.append(site)
        if _current is not None:
            _current._sync_gate(gate)
    return gate


def detect_rank_world() -> tuple[int, int]:
    """(rank, world size) from torch.distributed when initialised, else ``RANK``/``WORLD_SIZE``, else (0, 1)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except ImportError:
        pass
    values = []
    for name, default in (("RANK", "0"), ("WORLD_SIZE", "1")):
        text = os.environ.get(name, default)
        try:
            values.append(int(text))
        except ValueError:
            raise ConfigError(
                f"environment variable {name}={text!r} is not an integer (set by the launcher: "
                "torchrun, deepspeed, srun); unset it or give a number"
            ) from None
    return values[0], values[1]


def new_run_id() -> str:
    """An id for this run: ``$RLPROF_RUN_ID``, else torchrun's ``$TORCHELASTIC_RUN_ID``, else host-time-pid."""
    for name in ("RLPROF_RUN_ID", "TORCHELASTIC_RUN_ID"):
        value = os.environ.get(name)
        if value and value != "none":
            return value
    return f"{socket.gethostname()}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


class Session:
    """One profiling run in this process. Use :func:`rlprof.init` rather than building it directly."""

    def __init__(
        self,
        config: Any = None,
        *,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        run_id: Optional[str] = None,
        pool: Optional[str] = None,
    ) -> None:
        detected_rank, detected_world = (
            detect_rank_world() if rank is None or world_size is None else (rank, world_size)
        )
        self.rank = detected_rank if rank is None else rank
        self.world_size = detected_world if world_size is None else world_size
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank={self.rank} is outside the world (world_size={self.world_size})")
        self.config: ProfilerConfig = load_config(config, world_size=self.world_size)
        self.run_id = run_id or new_run_id()
        self.pool = pool
        """The pool of processes this one is in where an asynchronous trainer splits its launch (``trainer``,
        ``rollout``), written with each of its manifest lines; None: every process does everything."""
        self.selection = self.config.step_selection()
        self.current_step: Optional[int] = None
        self.step_open = False
        self.scoped_step: Optional[int] = None
        """The step of the ``with rlprof.step(n):`` block running, if any (steps do not nest)."""
        self.step_thread: Optional[threading.Thread] = None
        """The thread that begins the steps (one at a time: the training loop's); ranges may run on any thread."""
        self.window: Optional[StepWindow] = None
        """The open step window, or None."""
        self.windows_opened = 0
        self.finish_hook_due = self._runs_finish_hook()
        """Whether ``global_profiler.finish_hook_cmd`` is still to run on this rank (see :mod:`rlprof.finish_hook`)."""
        self.listeners: list[WindowListener] = []
        self._gap_exit: Any = None
        self._gap_thread: Optional[threading.Thread] = None
        self._lock = threading.RLock()
        self._warned: set[str] = set()
        self._pid = os.getpid()
        self.tool: Optional[Tool] = None
        tool_name = self.config.global_profiler.tool
        if tool_name is not None and self.config.records_on(self.rank):
            files, size = remove_abandoned(Path(self.config.global_profiler.save_path))
            if files:
                warnings.warn(
                    f"rlprof.init: removed {files} temporary files ({size / 2**20:.1f} MiB) that killed processes left "
                    f"in {self.config.global_profiler.save_path}",
                    RuntimeWarning,
                    stacklevel=3,
                )
            self._create_tool(tool_name)

    # ------------------------------------------------------------------ who records

    def role_enabled(self, role: str) -> bool:
        """Whether ``role``'s ranges record on this rank (inside selected steps, with a tool active)."""
        return self.config.role_enabled(role, self.rank)

    def is_recording(self, role: str) -> bool:
        """Whether a range of ``role`` started now would be recorded (a window is open, the role is enabled)."""
        return self.window is not None and self.tool is not None and self.role_enabled(role)

    @property
    def tool_name(self) -> Optional[str]:
        """The active tool's name, or None when nothing records on this rank (or the tool was turned off)."""
        return self.tool.name if self.tool is not None else None

    @property
    def tool_spec(self) -> Optional[ToolSpec]:
        """What the active tool can do (its registration), or None when nothing records on this rank."""
        return tool_spec(self.tool.name) if self.tool is not None else None

    def add_window_listener(self, listener: WindowListener) -> None:
        """Call ``listener.window_started(window)`` / ``window_stopped(window)`` as windows open and close."""
        with self._lock:
            self.listeners.append(listener)

    def remove_window_listener(self, listener: WindowListener) -> None:
        with self._lock:
            if listener in self.listeners:
                self.listeners.remove(listener)

    def record_output(
        self,
        tool: str,
        path: Any,
        window: StepWindow,
        role: Optional[str] = None,
        format: Optional[str] = None,
        engine: Optional[str] = None,
    ) -> None:
        """List a file that code following the windows wrote in this run's manifest, with its ``format`` (see
        :meth:`rlprof.tools.ToolContext.publish`); ``engine``: the inference engine that wrote it beside the trainer
        (``vLLM``: its own process and clock, shown as ``rank R vLLM engine``)."""
        extra = {"engine": engine} if engine is not None else {}
        self._manifest().record(
            tool, path, steps=window.steps, rank=self.rank, role=role, window=window.index, format=format, **extra
        )

    def record_event(self, kind: str, **fields: Any) -> None:
        """A line about the run (not a file) in its manifest, e.g. a ``stall`` the watchdog saw."""
        self._manifest().record_event(kind, rank=self.rank, **fields)

    # ------------------------------------------------------------------ steps

    def begin_step(self, step: int) -> None:
        """Step ``step`` starts now (ending the previous one); opens or continues a window if it is selected."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"rlprof.step: step={step!r} must be an integer >= 0")
        with self._lock:
            self._check_step_thread(step)
            if self.scoped_step is not None:
                raise ValueError(
                    f"rlprof.step({step}) inside `with rlprof.step({self.scoped_step}):`: steps do not nest; let step "
                    f"{self.scoped_step} end first (use profile_range for parts of a step)"
                )
            if self.step_open:
                self.end_step()
            self._close_gap()
            self.current_step = step
            self.step_open = True
            if self.tool is None:
                return
            window = self.window
            if window is not None and (step != window.last + 1 or not self.selection.joins(step)):
                self._stop_window()
                window = None
            if step in self.selection:
                if window is not None:
                    window.last = step
                    self._guarded(f"advancing to step {step}", self.tool.advance, window)
                else:
                    self._start_window(step)

    def _check_step_thread(self, step: int) -> None:
        """Steps are the process's and begin on one thread; another thread may take over once that one has ended.
        (Two threads stepping would close each other's windows and split their ranges across threads.)"""
        me, owner = threading.current_thread(), self.step_thread
        if owner is not None and owner is not me and owner.is_alive():
            raise ValueError(
                f"rlprof.step({step}) on thread {me.name!r}: this session's steps are begun on thread "
                f"{owner.name!r}; call rlprof.step from one thread (the training loop); ranges may run on any thread"
            )
        self.step_thread = me

    def end_mini_batch(self, role: str) -> None:
        """A mini-batch of ``role``'s update ended (:func:`rlprof.mini_batch`): the tool's schedule advances."""
        if self.tool is not None and self.window is not None and self.role_enabled(role):
            with self._lock:
                if self.tool is not None:
                    self._guarded(f"ending a mini-batch of {role!r}", self.tool.mini_batch_done, role)

    def end_step(self) -> None:
        """The current step is over; the window stays open (recording ``step/between_steps``) when the next step
        is selected, and closes otherwise."""
        with self._lock:
            if not self.step_open:
                return
            self.step_open = False
            if self.window is not None and self.current_step is not None:
                if self.selection.joins(self.current_step + 1):
                    self._open_gap()
                else:
                    self._stop_window()
            last = self.selection.last()
            finished = last is not None and self.current_step is not None and self.current_step >= last
        if finished:
            self._finish_hook()

    def shutdown(self) -> None:
        """End the step, close an open window (writing its files) and release the tool. Idempotent."""
        global _current
        with self._lock:
            if os.getpid() == self._pid:
                if self.step_open:
                    self.end_step()
                self._close_gap()
                if self.window is not None:
                    self._stop_window()
                if self.tool is not None:
                    tool, self.tool = self.tool, None
                    try:
                        tool.close()
                    except Exception as exc:  # closing must not raise out of atexit
                        self.warn_once(f"close:{tool.name}", f"rlprof: closing the {tool.name} tool failed: {exc}")
        if os.getpid() == self._pid and self.selection.last() is None and self.current_step is not None:
            self._finish_hook()  # an open-ended selection's last profiled step is the run's last step
        atexit.unregister(self.shutdown)
        with _gates_lock:
            if _current is self:
                _current = None

    # ------------------------------------------------------------------ the finish hook

    def _runs_finish_hook(self) -> bool:
        gp = self.config.global_profiler
        if gp.finish_hook_cmd is None or gp.tool is None:  # as verl: only where profiling is on
            return False
        if gp.finish_hook_all_ranks:
            return True
        if gp.finish_hook_ranks:
            return self.rank in gp.finish_hook_ranks
        return self.config.records_on(self.rank)

    def _finish_hook(self) -> None:
        """Run the user's finish command once (outside the lock: it may take minutes), listing it in the manifest."""
        with self._lock:
            due, self.finish_hook_due = self.finish_hook_due, False
        if not due:
            return
        gp = self.config.global_profiler
        assert gp.finish_hook_cmd is not None
        roles = [name for name in self.config.roles if self.config.role_enabled(name, self.rank)]
        variables = hook_environment(gp.save_path, gp.tool, self.rank, roles if self.config.roles else None)
        code = run_finish_hook(gp.finish_hook_cmd, self.rank, variables)
        if code != 0:
            self.warn_once(
                "finish_hook",
                f"rlprof: global_profiler.finish_hook_cmd exited with {code} on rank {self.rank} (training goes on): "
                f"{gp.finish_hook_cmd}",
            )
        with contextlib.suppress(OSError):  # the record of it is best-effort, as the command is
            self.record_event("finish_hook", command=gp.finish_hook_cmd, returncode=code)

    # ------------------------------------------------------------------ windows and gates

    def _manifest(self) -> Manifest:
        return Manifest(self.config.global_profiler.save_path, run=self.run_id, pool=self.pool)

    def _create_tool(self, name: str) -> None:
        save_path = self.config.global_profiler.save_path
        try:
            os.makedirs(save_path, exist_ok=True)
            if not os.access(save_path, os.W_OK):
                raise PermissionError(f"{save_path} is not writable")
            manifest = self._manifest()
            context = ToolContext(
                self.config.roles,
                self.config.tool_settings(),
                self.rank,
                self.world_size,
                manifest,
                warn=self.warn_once,
                published=self._output_written,
            )
            self.tool = create_tool(name, context)
            manifest.record_session(
                tool=name,
                rank=self.rank,
                world_size=self.world_size,
                steps=sorted(self.selection.steps)
                if self.selection.steps is not None
                else [self.selection.start, self.selection.end],
            )
        except Exception as exc:
            self.tool = None
            self.warn_once(
                f"create:{name}",
                f"rlprof: the {name} tool could not start ({type(exc).__name__}: {exc}); profiling is off",
            )

    def _start_window(self, step: int) -> None:
        assert self.tool is not None
        window = StepWindow(self.windows_opened + 1, step, step)
        if self._guarded(f"starting the window at step {step}", self.tool.start_window, window):
            self.windows_opened += 1
            self.window = window
            self._sync_gates()
            self._notify("window_started", window)

    def _stop_window(self) -> None:
        window, self.window = self.window, None
        self._close_gap()
        self._sync_gates()
        if self.tool is not None and window is not None:
            self._guarded("writing the window's output", self.tool.stop_window, window)
        if window is not None:
            self._notify("window_stopped", window)

    def _open_gap(self) -> None:
        if self.tool is None:
            return
        try:
            GAP_SITE.bind(self.tool)
            assert GAP_SITE.ops is not None
            enter, self._gap_exit = GAP_SITE.ops
            enter()
            self._gap_thread = threading.current_thread()
        except Exception as exc:
            self._gap_exit = None
            self._disable_tool("recording the range between steps", exc)

    def _close_gap(self) -> None:
        """End ``step/between_steps`` on the thread that began it (a range's ends are on one thread). On another
        thread (shutdown at exit, or a step thread that has ended) the range is dropped instead."""
        close, self._gap_exit = self._gap_exit, None
        if close is not None and self._gap_thread is threading.current_thread():
            self._guarded("closing the range between steps", close)

    def _sync_gates(self) -> None:
        with _gates_lock:
            for gate in _gates.values():
                self._sync_gate(gate)

    def _sync_gate(self, gate: RoleGate) -> None:
        tool = self.tool
        if self.window is not None and tool is not None and self.role_enabled(gate.role):
            try:
                for site in gate.sites:
                    site.bind(tool)
            except Exception as exc:
                gate.open = False
                self._disable_tool(f"preparing the ranges of role {gate.role!r}", exc)
                return
            gate.fail = self._range_failed
            gate.open = True
        else:
            gate.open = False

    def _notify(self, event: str, *args: Any) -> None:
        """Call ``event`` (a :class:`~rlprof.window.WindowListener` method) of every listener with ``args``."""
        for listener in list(self.listeners):
            try:
                getattr(listener, event)(*args)
            except Exception as exc:
                self.warn_once(
                    f"listener:{id(listener)}:{event}",
                    f"rlprof: the window listener {listener!r} failed in {event} "
                    f"({type(exc).__name__}: {exc}); the run goes on",
                )

    def _output_written(self, path: Path, format: Optional[str], window: StepWindow, role: Optional[str]) -> None:
        self._notify("output_written", path, format, window, role)

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
        self.window = None
        self._gap_exit = None
        self._sync_gates()
        if tool is None:
            return
        self.warn_once(
            f"failed:{tool.name}",
            f"rlprof: the {tool.name} tool failed while {action} ({type(exc).__name__}: {exc}); "
            "it is turned off for the rest of this run and the program goes on",
        )
        with contextlib.suppress(Exception):  # already reported the failure that matters
            tool.close()

    def forget_in_child(self) -> None:
        """After ``fork``: the child records nothing and writes nothing (the parent owns the window)."""
        self.tool = None
        self.window = None
        self._gap_exit = None
        with _gates_lock:
            for gate in _gates.values():
                gate.open = False

    def warn_once(self, key: str, message: str) -> None:
        """Emit ``message`` as a RuntimeWarning the first time ``key`` is seen in this session."""
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)


# --------------------------------------------------------------------------------------------- process wiring


def _after_fork_in_child() -> None:
    if _current is not None:
        _current.forget_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)

_previous_handlers: dict[int, Any] = {}


def _on_signal(signum: int, frame: Any) -> None:
    """SIGTERM/SIGINT: write the open window, then do what the previous handler (or the default) would do."""
    session = _current
    if session is not None and os.getpid() == session._pid:
        session.shutdown()
    previous = _previous_handlers.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _install_signal_handlers() -> None:
    """Chain our handler in front of whatever is installed (main thread only; elsewhere signals cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGTERM, signal.SIGINT):
        current = signal.getsignal(signum)
        if current is _on_signal or current == signal.SIG_IGN or current is None:
            continue
        _previous_handlers[signum] = current
        signal.signal(signum, _on_signal)


def init(
    config: Any = None,
    *,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    run_id: Optional[str] = None,
    pool: Optional[str] = None,
) -> Session:
    """Start the process's profiling session from a config (mapping, DictConfig, YAML path or ProfilerConfig).

    A session still running is shut down and replaced, with a warning (end it with :func:`shutdown` first to replace
    it silently). The session shuts down at interpreter exit and on
    SIGTERM/SIGINT, writing the files of an open window, so a crash or a kill loses no trace. ``run_id`` names the
    run in the manifest (default: ``$RLPROF_RUN_ID``, torchrun's run id, or host-time-pid). ``pool``: where an
    asynchronous trainer splits its launch into pools of processes, this one's (``trainer``, ``rollout``): its
    manifest lines say so, and ``rlprof timeline`` names its lanes by it.
    """
    global _current
    session = Session(config, rank=rank, world_size=world_size, run_id=run_id, pool=pool)
    previous = _current
    if previous is not None:
        warnings.warn(
            "rlprof.init: a session is already running in this process; it is shut down (its open window written) "
            "and replaced. Call rlprof.shutdown() first to end it yourself",
            RuntimeWarning,
            stacklevel=2,
        )
        previous.shutdown()
    with _gates_lock:
        _current = session
    atexit.register(session.shutdown)
    if session.tool is not None:
        _install_signal_handlers()
    return session


def get_session() -> Optional[Session]:
    """The current session, or None before :func:`init` / after :func:`shutdown`."""
    return _current


def shutdown() -> None:
    """Shut down the current session, if any."""
    if _current is not None:
        _current.shutdown()


def is_recording(role: str) -> bool:
    """Whether a range of ``role`` started now would be recorded by the current session."""
    return _current is not None and _current.is_recording(role)


class StepScope:
    """Returned by :func:`step`: the step has begun; used as a context manager it also ends at ``with`` exit."""

    __slots__ = ("session", "step")

    def __init__(self, session: Optional[Session], step: int) -> None:
        self.session = session
        self.step = step

    def __enter__(self) -> StepScope:
        if self.session is not None:
            self.session.scoped_step = self.step
        return self

    def __exit__(self, *exc_info: Any) -> None:
        session = self.session
        if session is None:
            return
        if session.scoped_step == self.step:
            session.scoped_step = None
        if session.step_open and session.current_step == self.step:
            session.end_step()


def step(n: int) -> StepScope:
    """Begin training step ``n``: ``rlprof.step(n)`` at the top of each step, or ``with rlprof.step(n): ...``.

    Steps do not nest: a step begun inside a ``with rlprof.step(m):`` block is a ``ValueError`` (it used to end step
    ``m`` silently, losing the rest of its ranges). Steps begin on one thread, the first to call this (another may
    take over once it has ended); a step from a second thread while the first lives is a ``ValueError``. Ranges
    may run on any thread."""
    session = _current
    if session is not None:
        session.begin_step(n)
    return StepScope(session, n)
