"""Nsight Systems: NVTX ranges in domain ``rlprof`` (category = role, colour per role) and cudaProfilerApi capture.

Run the program under ``nsys profile --capture-range=cudaProfilerApi ...`` on GPU machines so that only the
selected steps are captured. Continuous mode (``discrete: false``) brackets each step window with
``cudaProfilerStart/Stop``; discrete mode brackets each outermost range instead. Without CUDA the capture calls are
skipped and the NVTX ranges are still emitted, only inside the selected steps.

nvtx >= 0.2.12 asks ``nvtxDomainIsEnabled()`` before handing out a domain and returns a no-op stand-in when it
answers 0, which older injection libraries (Debian's nsys 2022.4) always do. :func:`open_domain` builds the real
domain object in that case: it records under old and current nsys alike, and with no tool attached the NVTX C
calls are no-ops anyway. Ranges are pushed with ``nvtx._lib.lib.push_range(attributes, handle)`` and popped with
``lib.pop_range(handle)``, bound per site. These are nvtx's private internals (present in 0.2.12 to 0.2.17), hence
the ``nvtx>=0.2.12,<0.3`` requirement; :data:`NVTX_INTERNALS` lists them and a test checks the installed nvtx.
"""

from __future__ import annotations

import functools
import os
import threading
from dataclasses import dataclass
from typing import Any, Optional

from rlprof.colors import ROLE_COLORS, parse_color, role_color
from rlprof.roles import role_setting
from rlprof.tools.base import RangeOps, RangeSite, StepWindowSettings, Tool, ToolContext
from rlprof.tools.registry import register_tool
from rlprof.window import StepWindow

DOMAIN = "rlprof"
NVTX_INTERNALS = ("DummyDomain", "Domain", "DomainHandle", "push_range", "pop_range")
"""What this module uses from ``nvtx._lib.lib``."""
INJECTION_VARIABLES = ("NVTX_INJECTION64_PATH", "NVTX_INJECTION32_PATH")
"""Set by Nsight Systems (and other NVTX tools) in the processes it traces."""
STEP_CATEGORY = "step"
RANK_CATEGORY = "rank"
"""Category of the mark ``rank R of W`` each recording process writes once, so a report of several processes
(torchrun under one nsys) tells its ranks apart."""


def open_domain(name: str) -> Any:
    """An ``nvtx`` Domain that records even where ``nvtxDomainIsEnabled()`` wrongly answers 0 (see module doc)."""
    import nvtx
    from nvtx._lib import lib

    domain = nvtx.get_domain(name)
    if isinstance(domain, lib.DummyDomain) and not os.environ.get("NVTX_DISABLE"):
        domain = object.__new__(lib.Domain)
        domain.handle = lib.DomainHandle(name)
        domain.__init__(name)
    return domain


class _CudaCapture:
    """cudaProfilerStart/Stop, or nothing where CUDA is absent."""

    def __init__(self) -> None:
        try:
            import torch

            self.available = torch.cuda.is_available()
        except ImportError:
            self.available = False

    def start(self) -> None:
        if self.available:
            import torch

            torch.cuda.synchronize()
            torch.cuda.profiler.start()

    def stop(self) -> None:
        if self.available:
            import torch

            torch.cuda.synchronize()
            torch.cuda.profiler.stop()


@dataclass
class NsysSettings(StepWindowSettings):
    """Nsight Systems: NVTX ranges (domain ``rlprof``, category = role) plus cudaProfilerApi capture on GPU."""

    discrete: bool = False
    """True: bracket each range with its own capture (one report per task); False: one capture per step window."""


def nvtx_tool_attached() -> bool:
    """Whether an NVTX tool (Nsight Systems) is injected into this process."""
    return any(os.environ.get(name) for name in INJECTION_VARIABLES)


@register_tool("nsys", config=NsysSettings, per_role=("discrete",), launcher="nsys")
class NsysTool(Tool):
    """Emits NVTX ranges for enabled roles inside selected steps, and brackets captures for ``nsys``.

    A range of a continuous-mode role is two C calls (``nvtx._lib.lib.push_range``/``pop_range`` bound to the
    site's pre-built attributes); a discrete-mode role's outermost range per thread also starts and stops a capture.
    """

    def __init__(self, context: ToolContext) -> None:
        super().__init__(context)
        from nvtx._lib import lib

        self.domain = open_domain(DOMAIN)
        self.capture = _CudaCapture()
        self.discrete = context.settings.discrete
        self._lib = lib
        self._depth = threading.local()
        self._step_range: Optional[Any] = None
        self.domain.mark(
            self.domain.get_event_attributes(
                message=f"rank {context.rank} of {context.world_size}", category=RANK_CATEGORY
            )
        )
        if not nvtx_tool_attached():
            context.warn(
                "nsys:detached",
                "rlprof: tool=nsys but no Nsight Systems is attached to this process "
                "(NVTX_INJECTION64_PATH is unset), so the NVTX ranges go nowhere; run the program under "
                "`rlprof nsys profile -- ...` or `nsys profile ...`",
            )

    def _attributes(self, site: RangeSite) -> Any:
        color = parse_color(site.color) if site.color is not None else role_color(site.role)
        return self.domain.get_event_attributes(message=site.name, color=color, category=site.role)

    def _is_discrete(self, role: str) -> bool:
        return bool(role_setting(self.context.roles, role, "discrete", self.context.settings))

    def start_window(self, window: StepWindow) -> None:
        if not self.discrete:
            self.capture.start()
        self._mark_step(window.first)

    def advance(self, window: StepWindow) -> None:
        self._mark_step(window.last)

    def stop_window(self, window: StepWindow) -> None:
        self._end_step_range()
        if not self.discrete:
            self.capture.stop()

    def _mark_step(self, step: int) -> None:
        """A process-wide range ``step {n}`` (category ``step``) so the timeline shows step boundaries."""
        self._end_step_range()
        attributes = self.domain.get_event_attributes(
            message=f"step {step}", color=ROLE_COLORS["step"], category=STEP_CATEGORY
        )
        self._step_range = self.domain.start_range(attributes)

    def _end_step_range(self) -> None:
        if self._step_range is not None:
            self.domain.end_range(self._step_range)
            self._step_range = None

    def range_ops(self, site: RangeSite) -> RangeOps:
        push = functools.partial(self._lib.push_range, self._attributes(site), self.domain.handle)
        pop = functools.partial(self._lib.pop_range, self.domain.handle)
        if self.capture.available and self._is_discrete(site.role):
            return self._captured(push, pop)
        return push, pop

    def _captured(self, push: Any, pop: Any) -> RangeOps:
        """Discrete mode: the outermost range of each thread starts a capture; its exit stops it."""

        def enter() -> None:
            push()
            depth = getattr(self._depth, "value", 0)
            if depth == 0:
                self.capture.start()
            self._depth.value = depth + 1

        def exit_() -> None:
            try:
                self._depth.value -= 1
                if self._depth.value == 0:
                    self.capture.stop()
            finally:
                pop()

        return enter, exit_
