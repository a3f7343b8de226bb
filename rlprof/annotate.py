"""The public face: ``@profiled`` for functions and methods, ``profile_range`` for blocks.

Both record through the role's gate (see :mod:`rlprof.session`). When the gate is closed — no tool, the role not
enabled on this rank, or the step not selected — a decorated call costs one attribute test on top of a plain
pass-through wrapper. When it is open, the range is entered before the body and always exited after it. The
body runs exactly once and its exception passes through unchanged; a tool that fails is reported to the session
(which warns once and turns it off) and never replaces the user's exception.
"""

from __future__ import annotations

import functools
import inspect
import threading
from typing import Any, Callable, Optional, TypeVar, overload

from rlprof.session import RoleGate, gate_for
from rlprof.tools.base import RangeSite
from rlprof.tools.nsys import parse_color

F = TypeVar("F", bound=Callable[..., Any])

_sites: dict[tuple[str, str, Any], RangeSite] = {}
_sites_lock = threading.Lock()


def _check_role(role: Any, caller: str) -> str:
    if not isinstance(role, str) or not role:
        raise ValueError(f"{caller}: role={role!r} must be a non-empty string such as 'actor', 'rollout' or 'critic'")
    return role


def _site(role: str, name: str, color: Optional[str | int]) -> RangeSite:
    key = (role, name, color)
    site = _sites.get(key)
    if site is None:
        with _sites_lock:
            site = _sites.setdefault(key, RangeSite(role, name, color))
    return site


@overload
def profiled(fn: F) -> F: ...
@overload
def profiled(
    fn: None = None, *, role: str = "default", name: Optional[str] = None, color: Optional[str | int] = None
) -> Callable[[F], F]: ...


def profiled(
    fn: Optional[F] = None, *, role: str = "default", name: Optional[str] = None, color: Optional[str | int] = None
) -> Any:
    """Record every call of the decorated function as a range ``role/name``.

    ``name`` defaults to the function's qualified name; ``color`` (nsys only) overrides the role's colour with a
    name, ``'#RRGGBB'`` or an ARGB int. Works on functions, methods and ``async def`` functions; usable bare
    (``@profiled``) or with arguments (``@profiled(role="actor")``).
    """
    _check_role(role, "profiled")
    parse_color(color)

    def decorate(func: F) -> F:
        if not callable(func):
            raise TypeError(f"profiled: expected a function or method, got {func!r}")
        site = _site(role, name or func.__qualname__, color)
        gate = gate_for(role)
        if inspect.iscoroutinefunction(func):
            wrapper = _async_wrapper(func, gate, site)
        else:
            wrapper = _sync_wrapper(func, gate, site)
        return functools.wraps(func)(wrapper)  # type: ignore[return-value]

    return decorate(fn) if fn is not None else decorate


# The two wrappers below are the hot path: the range logic is written out in each rather than shared through a
# helper, because one more Python call per range is a measurable share of the overhead budget (benchmarks/).


def _sync_wrapper(func: Callable[..., Any], gate: RoleGate, site: RangeSite) -> Callable[..., Any]:
    def profiled_call(*args: Any, **kwargs: Any) -> Any:
        if not gate.open:
            return func(*args, **kwargs)
        try:
            close = gate.enter(site)
        except Exception as exc:
            gate.fail(exc)
            close = _nothing
        try:
            return func(*args, **kwargs)
        finally:
            try:
                close()
            except Exception as exc:
                _report_close_failure(gate, exc)

    return profiled_call


def _async_wrapper(func: Callable[..., Any], gate: RoleGate, site: RangeSite) -> Callable[..., Any]:
    async def profiled_call(*args: Any, **kwargs: Any) -> Any:
        if not gate.open:
            return await func(*args, **kwargs)
        try:
            close = gate.enter(site)
        except Exception as exc:
            gate.fail(exc)
            close = _nothing
        try:
            return await func(*args, **kwargs)
        finally:
            try:
                close()
            except Exception as exc:
                _report_close_failure(gate, exc)

    return profiled_call


def _nothing() -> None:
    """The closer of a range whose opening failed."""


def _report_close_failure(gate: RoleGate, exc: Exception) -> None:
    if gate.fail is not None:
        gate.fail(exc)


class _NullRange:
    """The context manager returned when the role does not record: does nothing, shared by all callers."""

    __slots__ = ()

    def __enter__(self) -> "_NullRange":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        return None


_NULL_RANGE = _NullRange()


class _Range:
    """One recording ``profile_range`` block."""

    __slots__ = ("gate", "site", "close")

    def __init__(self, gate: RoleGate, site: RangeSite) -> None:
        self.gate = gate
        self.site = site
        self.close: Callable[[], Any] = _nothing

    def __enter__(self) -> "_Range":
        try:
            self.close = self.gate.enter(self.site)
        except Exception as exc:
            self.gate.fail(exc)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        try:
            self.close()
        except Exception as exc:
            _report_close_failure(self.gate, exc)


def profile_range(name: str, role: str = "default", color: Optional[str | int] = None) -> Any:
    """A context manager recording the ``with`` block as a range ``role/name``.

    Returns a shared do-nothing object when the role does not record right now, so it is cheap to leave in hot
    code. Each call returns a fresh range otherwise, so nesting and threads work.
    """
    entry = _range_entries.get((role, name, color))
    if entry is None:
        entry = _new_range_entry(role, name, color)
    gate, site = entry
    if not gate.open:
        return _NULL_RANGE
    return _Range(gate, site)


_range_entries: dict[tuple[str, str, Any], tuple[RoleGate, RangeSite]] = {}


def _new_range_entry(role: Any, name: Any, color: Any) -> tuple[RoleGate, RangeSite]:
    _check_role(role, "profile_range")
    if not isinstance(name, str) or not name:
        raise ValueError(f"profile_range: name={name!r} must be a non-empty string")
    parse_color(color)
    entry = (gate_for(role), _site(role, name, color))
    _range_entries[(role, name, color)] = entry
    return entry
