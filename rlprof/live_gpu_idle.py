"""The GPU's idle share as a live value, where a window measured it: each torch trace the session's tool writes on
this rank is read on a thread of this module's own (the report's reader, :mod:`rlprof.analysis.sources.chrome_trace`,
as untrusted as any trace), and the newest one's device idle share of its traced span, stream captures left out
(the report's ``gpu-idle`` measure, :func:`rlprof.analysis.trace_model.judged_idle_share`), is read at each scrape of
a live backend::

    gauge = rlprof.live_gpu_idle.WindowGpuIdle.follow(rlprof.get_session(), tracker)
    ...                                   # train: torch windows on a GPU write their traces
    gauge.close()

Samples (no labels beyond the backend's): ``gpu/idle_share`` (0..1), ``gpu/traced_seconds`` (the span it is a share
of; the report judges spans of 10 ms or more) and ``gpu/idle_share_step`` (the last step of the window measured).
None before a trace with device work was read: a CPU-only trace measures no GPU.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from rlprof.analysis.sources import source
from rlprof.analysis.sources.base import InputFile, ReadOptions, SourceError
from rlprof.analysis.trace_model import judged_idle_share, judged_span_us
from rlprof.tracking.base import LiveSample
from rlprof.window import StepWindow, WindowListener

if TYPE_CHECKING:
    from rlprof.session import Session
    from rlprof.tracking.tracker import Tracker

TRACE_FORMAT = "chrome_trace"
CLOSE_WAIT_S = 10.0
"""How long :meth:`WindowGpuIdle.close` waits for a trace being read (the thread is a daemon: it ends with the
process in any case)."""


@dataclass(frozen=True)
class IdleMeasure:
    share: float
    """The device's idle share of its judged span."""
    traced_s: float
    """The judged span: the device's traced span less its idle time inside stream captures, in seconds."""
    step: int
    """The last step of the window whose trace it is."""


class WindowGpuIdle(WindowListener):
    """Follows a session's torch traces (:meth:`output_written`) and serves the newest one's GPU idle share to live
    backends (:meth:`live_samples`)."""

    def __init__(self) -> None:
        self.latest: Optional[IdleMeasure] = None
        self.unreadable = 0
        """Traces the reader refused (truncated, not a trace): counted, the gauge keeps its last value."""
        self._pending: queue.Queue[Optional[tuple[Path, StepWindow]]] = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._session: Optional[Session] = None
        self._counts = threading.Condition()
        self._handed = self._read_count = 0

    @classmethod
    def follow(cls, session: Session, tracker: Tracker) -> WindowGpuIdle:
        """A gauge listening to ``session``'s windows whose samples ``tracker``'s live backends read."""
        gauge = cls()
        gauge._session = session
        session.add_window_listener(gauge)
        tracker.add_live(gauge.live_samples)
        return gauge

    def output_written(self, path: Path, format: Optional[str], window: StepWindow, role: Optional[str]) -> None:
        if format != TRACE_FORMAT:
            return
        with self._counts:
            if self._thread is None:  # the first trace starts the reader: a run without torch traces has none
                self._thread = threading.Thread(target=self._read, name="rlprof-gpu-idle", daemon=True)
                self._thread.start()
            self._handed += 1
        self._pending.put((path, window))

    def live_samples(self) -> list[LiveSample]:
        measure = self.latest
        if measure is None:
            return []
        return [
            LiveSample("gpu/idle_share", {}, measure.share),
            LiveSample("gpu/traced_seconds", {}, measure.traced_s),
            LiveSample("gpu/idle_share_step", {}, float(measure.step)),
        ]

    def wait(self, timeout_s: float) -> bool:
        """Wait until every trace handed over so far is read; False when ``timeout_s`` passed first."""
        with self._counts:
            return self._counts.wait_for(lambda: self._read_count >= self._handed, timeout_s)

    def close(self) -> None:
        """Stop following the session; wait (at most :data:`CLOSE_WAIT_S`) for a trace being read."""
        if self._session is not None:
            self._session.remove_window_listener(self)
            self._session = None
        with self._counts:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._pending.put(None)
            thread.join(CLOSE_WAIT_S)

    def _read(self) -> None:
        while (item := self._pending.get()) is not None:
            try:
                measured = measure(*item)
            except Exception:  # noqa: BLE001  (a trace it cannot read is counted; the gauge keeps its last value)
                self.unreadable += 1
            else:
                self.latest = measured or self.latest
            with self._counts:
                self._read_count += 1
                self._counts.notify_all()


def measure(path: Path, window: StepWindow) -> Optional[IdleMeasure]:
    """The device's idle share in the trace at ``path`` (None: the trace holds no device work); raises
    :class:`~rlprof.analysis.sources.base.SourceError` for a file that is not a trace, or not a whole one."""
    reader = source(TRACE_FORMAT)
    assert reader is not None
    scans = reader.read(InputFile(TRACE_FORMAT, path, tuple(window.steps)), ReadOptions())
    for scan in scans:
        if scan.cut_short:  # the share of a part of the window is not the window's
            raise SourceError(scan.problems[-1])
        if scan.gpu is not None:
            share = judged_idle_share(scan.gpu, scan.captures)
            return IdleMeasure(share, judged_span_us(scan.gpu, scan.captures) / 1e6, window.last)
    return None
