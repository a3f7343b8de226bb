"""The public face: ``@profiled`` for functions and methods, ``profile_range`` for blocks.

Both record through the role's gate (see :mod:`rlprof.session`). When the gate is closed — no tool, the role not
enabled on this rank, or the step not selected — a decorated call costs one attribute test on top of a plain
pass-through wrapper. When it is open, the site's ``(enter, exit)`` pair (bound by the session to the active tool)
runs before and after the body. The body runs exactly once and its exception passes through unchanged; a tool that
fails is reported to the session (which warns once and turns it off) and never replaces the user's exception.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable, Generator, Iterator
from typing import Any, Optional, TypeVar, overload

from rlprof.colors import parse_color
from rlprof.session import RoleGate, add_site, get_session
from rlprof.tools.base import RangeSite, remember_decorated

F = TypeVar("F", bound=Callable[..., Any])
DEFAULT_ROLE = "default"
"""The role of ranges that do not name one."""

_entries: dict[tuple[str, str, Any], tuple[RoleGate, RangeSite]] = {}
_entries_lock = threading.Lock()


def _check_role(role: Any, caller: str) -> str:
    if not isinstance(role, str) or not role:
        raise ValueError(f"{caller}: role={role!r} must be a non-empty string such as 'actor', 'rollout' or 'critic'")
    return role


def _entry(role: str, name: str, color: Optional[str | int]) -> tuple[RoleGate, RangeSite]:
    """The gate and the site of ``role/name`` (one site per role, name and colour, shared by every caller)."""
    key = (role, name, color)
    entry = _entries.get(key)
    if entry is None:
        with _entries_lock:
            entry = _entries.get(key)
            if entry is None:
                site = RangeSite(role, name, color)
                entry = _entries[key] = (add_site(site), site)
    return entry


@overload
def profiled(fn: F) -> F: ...
@overload
def profiled(
    fn: None = None, *, role: str = DEFAULT_ROLE, name: Optional[str] = None, color: Optional[str | int] = None
) -> Callable[[F], F]: ...


def profiled(
    fn: Optional[F] = None, *, role: str = DEFAULT_ROLE, name: Optional[str] = None, color: Optional[str | int] = None
) -> Any:
    """Record every call of the decorated function as a range ``role/name``.

    ``name`` defaults to the function's qualified name; ``color`` (nsys only) overrides the role's colour with a
    name, ``'#RRGGBB'`` or an ARGB int. Works on functions, methods (also above ``@staticmethod`` and
    ``@classmethod``), ``async def`` functions and generator functions (each resumption of the generator is one
    range, so the ranges cover the generator's own work and nest properly with the caller's); usable bare
    (``@profiled``) or with arguments (``@profiled(role="actor")``).
    """
    _check_role(role, "profiled")
    parse_color(color)

    def decorate(func: Any) -> Any:
        if isinstance(func, (staticmethod, classmethod)):
            return type(func)(decorate(func.__func__))
        if not callable(func) or isinstance(func, type):
            raise TypeError(f"profiled: expected a function or method, got {func!r}")
        if inspect.isasyncgenfunction(func):
            raise TypeError(
                f"profiled: {func.__qualname__} is an async generator function, which is not supported; "
                "use `with rlprof.profile_range(...)` inside it"
            )
        gate, site = _entry(role, name or func.__qualname__, color)
        remember_decorated(func, site)
        if inspect.iscoroutinefunction(func):
            wrapper = _async_wrapper(func, gate, site)
        elif inspect.isgeneratorfunction(func):
            wrapper = _generator_wrapper(func, gate, site)
        else:
            wrapper = _sync_wrapper(func, gate, site)
        return functools.wraps(func)(wrapper)

    return decorate(fn) if fn is not None else decorate


# The wrappers below are the hot path: the range logic is written out in each rather than shared through a
# helper, because one more Python call per range is a measurable share of the overhead budget (benchmarks/).


def _sync_wrapper(func: Callable[..., Any], gate: RoleGate, site: RangeSite) -> Callable[..., Any]:
    def profiled_call(*args: Any, **kwargs: Any) -> Any:
        if not gate.open:
            return func(*args, **kwargs)
        enter, exit_ = site.ops  # type: ignore[misc]  # bound whenever the gate is open
        try:
            enter()
        except Exception as exc:
            gate.fail(exc)
            return func(*args, **kwargs)
        try:
            return func(*args, **kwargs)
        finally:
            try:
                exit_()
            except Exception as exc:
                _report_close_failure(gate, exc)

    return profiled_call


def _async_wrapper(func: Callable[..., Any], gate: RoleGate, site: RangeSite) -> Callable[..., Any]:
    async def profiled_call(*args: Any, **kwargs: Any) -> Any:
        if not gate.open:
            return await func(*args, **kwargs)
        enter, exit_ = site.ops  # type: ignore[misc]
        try:
            enter()
        except Exception as exc:
            gate.fail(exc)
            return await func(*args, **kwargs)
        try:
            return await func(*args, **kwargs)
        finally:
            try:
                exit_()
            except Exception as exc:
                _report_close_failure(gate, exc)

    return profiled_call


def _generator_wrapper(func: Callable[..., Any], gate: RoleGate, site: RangeSite) -> Callable[..., Any]:
    def profiled_generator(*args: Any, **kwargs: Any) -> Generator[Any, Any, Any]:
        generator = func(*args, **kwargs)
        sent: Any = None
        thrown: Optional[BaseException] = None
        while True:
            try:
                item = _resume(generator, sent, thrown, gate, site)
            except StopIteration as stop:
                return stop.value
            thrown = None
            try:
                sent = yield item
            except GeneratorExit:
                generator.close()
                raise
            except BaseException as exc:  # thrown into us by the caller: pass it on to the generator
                sent, thrown = None, exc

    return profiled_generator


def _resume(
    generator: Generator[Any, Any, Any], sent: Any, thrown: Optional[BaseException], gate: RoleGate, site: RangeSite
) -> Any:
    """Resume ``generator`` once (send or throw), as one range when the gate is open."""
    if not gate.open:
        return generator.throw(thrown) if thrown is not None else generator.send(sent)
    enter, exit_ = site.ops  # type: ignore[misc]
    try:
        enter()
    except Exception as exc:
        gate.fail(exc)
        return generator.throw(thrown) if thrown is not None else generator.send(sent)
    try:
        return generator.throw(thrown) if thrown is not None else generator.send(sent)
    finally:
        try:
            exit_()
        except Exception as exc:
            _report_close_failure(gate, exc)


def _report_close_failure(gate: RoleGate, exc: Exception) -> None:
    if gate.fail is not None:
        gate.fail(exc)


class _NullRange:
    """The context manager returned when the role does not record: does nothing, shared by all callers."""

    __slots__ = ()

    def __enter__(self) -> _NullRange:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        return None


_NULL_RANGE = _NullRange()


def _nothing() -> None:
    """The exit of a range whose opening failed."""


class _Range:
    """One recording ``profile_range`` block."""

    __slots__ = ("exit", "gate", "site")

    def __init__(self, gate: RoleGate, site: RangeSite) -> None:
        self.gate = gate
        self.site = site
        self.exit: Callable[[], Any] = _nothing

    def __enter__(self) -> _Range:
        enter, exit_ = self.site.ops  # type: ignore[misc]
        try:
            enter()
            self.exit = exit_
        except Exception as exc:
            self.gate.fail(exc)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        try:
            self.exit()
        except Exception as exc:
            _report_close_failure(self.gate, exc)


def profile_range(name: str, role: str = DEFAULT_ROLE, color: Optional[str | int] = None) -> Any:
    """A context manager recording the ``with`` block as a range ``role/name``.

    Returns a shared do-nothing object when the role does not record right now, so it is cheap to leave in hot
    code. Each call returns a fresh range otherwise, so nesting and threads work.
    """
    entry = _entries.get((role, name, color))
    if entry is None:
        _check_role(role, "profile_range")
        if not isinstance(name, str) or not name:
            raise ValueError(f"profile_range: name={name!r} must be a non-empty string")
        parse_color(color)
        entry = _entry(role, name, color)
    gate, site = entry
    if not gate.open:
        return _NULL_RANGE
    return _Range(gate, site)


@contextlib.contextmanager
def mini_batch(index: int, role: str = DEFAULT_ROLE) -> Iterator[None]:
    """One mini-batch of an update loop: a range ``role/mini_batch{index}`` (verl's name), and at its end the
    active tool's schedule over mini-batches advances (verl's ``profiler.step()``; :mod:`rlprof.mini_batches`).

    ::

        for i, rows in enumerate(mini_batches):
            with rlprof.mini_batch(i, role="actor"):
                update(rows)
    """
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"mini_batch: index={index!r} must be an integer >= 0")
    with profile_range(f"mini_batch{index}", role):
        yield
    session = get_session()
    if session is not None:
        session.end_mini_batch(role)
