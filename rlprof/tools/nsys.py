"""Nsight Systems: NVTX ranges in domain ``rlprof`` (category = role, colour per role) and cudaProfilerApi capture.

Run the program under ``nsys profile --capture-range=cudaProfilerApi ...`` on GPU machines so that only the
selected steps are captured. Continuous mode (``discrete: false``) brackets each step window with
``cudaProfilerStart/Stop``; discrete mode brackets each outermost range instead. Without CUDA the capture calls are
skipped and the NVTX ranges are still emitted, only inside the selected steps.

nvtx >= 0.2.12 asks ``nvtxDomainIsEnabled()`` before handing out a domain and returns a no-op stand-in when it
answers 0, which older injection libraries (Debian's nsys 2022.4) always do. :func:`open_domain` builds the real
domain object in that case: it records under old and current nsys alike, and with no tool attached the NVTX C
calls are no-ops anyway.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, Optional

from rlprof.tools.base import RangeSite, Tool, ToolContext

DOMAIN = "rlprof"
STEP_CATEGORY = "step"

ROLE_COLORS: dict[str, int] = {
    "rollout": 0xFF76B900,  # green
    "actor": 0xFF1F77B4,  # blue
    "critic": 0xFF9467BD,  # purple
    "ref": 0xFFFF7F0E,  # orange
    "reward": 0xFFD62728,  # red
    "step": 0xFF7F7F7F,  # grey
}
OTHER_ROLE_COLORS = (0xFF17BECF, 0xFFBCBD22, 0xFF8C564B, 0xFFE377C2)
NAMED_COLORS: dict[str, int] = {
    "green": 0xFF008000, "blue": 0xFF0000FF, "yellow": 0xFFFFFF00, "purple": 0xFF800080, "cyan": 0xFF00FFFF,
    "red": 0xFFFF0000, "white": 0xFFFFFFFF, "darkgreen": 0xFF006400, "orange": 0xFFFFA500, "grey": 0xFF7F7F7F,
    "black": 0xFF000000, "pink": 0xFFFFC0CB, "brown": 0xFF8B4513,
}


def parse_color(color: Optional[str | int], argument: str = "color") -> Optional[int]:
    """ARGB int for a colour name, ``#RRGGBB`` or int; ``ValueError`` naming ``argument`` otherwise."""
    if color is None:
        return None
    if isinstance(color, int) and not isinstance(color, bool) and 0 <= color <= 0xFFFFFFFF:
        return color if color > 0xFFFFFF else 0xFF000000 | color
    if isinstance(color, str):
        if color.lower() in NAMED_COLORS:
            return NAMED_COLORS[color.lower()]
        if color.startswith("#") and len(color) == 7:
            try:
                return 0xFF000000 | int(color[1:], 16)
            except ValueError:
                pass
    raise ValueError(
        f"{argument}={color!r} is not a colour; use one of {', '.join(sorted(NAMED_COLORS))}, '#RRGGBB' or an ARGB int"
    )


def role_color(role: str) -> int:
    """The default colour of ``role``: fixed for the built-in roles, stable per name for the others."""
    if role in ROLE_COLORS:
        return ROLE_COLORS[role]
    return OTHER_ROLE_COLORS[sum(role.encode()) % len(OTHER_ROLE_COLORS)]


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


class NsysTool(Tool):
    """Emits NVTX ranges for enabled roles inside selected steps, and brackets captures for ``nsys``."""

    name = "nsys"

    def __init__(self, context: ToolContext) -> None:
        super().__init__(context)
        self.domain = open_domain(DOMAIN)
        self.capture = _CudaCapture()
        self.discrete = context.config.global_profiler.global_tool_config.nsys.discrete
        self._push = self.domain.push_range
        self._pop = self.domain.pop_range
        self._may_capture_per_range = self.capture.available  # discrete capture needs CUDA; off: one test per range
        self._role_discrete: dict[str, bool] = {}
        self._depth = threading.local()
        self._step_range: Optional[Any] = None

    def _attributes(self, site: RangeSite) -> Any:
        color = parse_color(site.color) if site.color is not None else role_color(site.role)
        return self.domain.get_event_attributes(message=site.name, color=color, category=site.role)

    def _is_discrete(self, role: str) -> bool:
        if role not in self._role_discrete:
            override = self.context.config.role(role).discrete
            self._role_discrete[role] = self.discrete if override is None else override
        return self._role_discrete[role]

    def start_window(self, step: int) -> None:
        super().start_window(step)
        if not self.discrete:
            self.capture.start()
        self._mark_step(step)

    def advance(self, step: int) -> None:
        super().advance(step)
        self._mark_step(step)

    def stop_window(self) -> None:
        self._end_step_range()
        if not self.discrete:
            self.capture.stop()
        super().stop_window()

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

    def enter_range(self, site: RangeSite) -> Callable[[], Any]:
        attributes = site.tool_data if site.tool_owner is self else site.cached(self, self._attributes)
        self._push(attributes)
        if self._may_capture_per_range and self._is_discrete(site.role):
            return self._enter_capture()
        return self._pop

    def _enter_capture(self) -> Callable[[], Any]:
        """Discrete mode: the outermost range of each thread starts a capture; its closer stops it."""
        depth = getattr(self._depth, "value", 0)
        if depth == 0:
            self.capture.start()
        self._depth.value = depth + 1
        return self._exit_capture

    def _exit_capture(self) -> None:
        try:
            self._depth.value -= 1
            if self._depth.value == 0:
                self.capture.stop()
        finally:
            self._pop()
