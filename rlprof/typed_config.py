"""Typed configuration: build a dataclass tree from plain data, with errors that name the key, the value and what
is allowed.

Both configs of the project use it: the profiler's (:mod:`rlprof.config`) and the trainer's. A schema is a
dataclass whose fields carry their type (``int``, ``float``, ``bool``, ``str``, ``Literal[...]``, ``Optional[...]``,
``list[...]``, ``dict[str, ...]``, a nested dataclass or ``Any``) and, where a number has a range, a constraint in
the field's metadata::

    @dataclass
    class Optim:
        lr: float = field(default=1e-3, metadata=bounds(gt=0))
        \"\"\"Learning rate.\"\"\"

Unknown keys are refused with the nearest valid key suggested. Every error is one :class:`ConfigError` line.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal, Optional, TypeVar, Union

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the key, the value and what is allowed."""


def bounds(
    *, ge: Optional[float] = None, gt: Optional[float] = None, le: Optional[float] = None, lt: Optional[float] = None
) -> dict[str, Any]:
    """Field metadata constraining a number: ``field(default=1, metadata=bounds(ge=1))``."""
    return {"bounds": {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}}


_PROBLEMS: contextvars.ContextVar[Optional[list[str]]] = contextvars.ContextVar("rlprof_schema_problems", default=None)


@contextlib.contextmanager
def collecting() -> Iterator[list[str]]:
    """Within the block, :func:`build` records each key's problem in the yielded list and goes on with that key's
    default, so that one message can name every problem of a config."""
    problems: list[str] = []
    token = _PROBLEMS.set(problems)
    try:
        yield problems
    finally:
        _PROBLEMS.reset(token)


def one_message(problems: list[str]) -> str:
    """Several problems as one line: ``3 problems: (1) ...; (2) ...; (3) ...`` (one problem: itself)."""
    unique = list(dict.fromkeys(problems))
    if len(unique) == 1:
        return unique[0]
    return f"{len(unique)} problems: " + "; ".join(f"({i}) {p}" for i, p in enumerate(unique, 1))


def build(schema: type[T], data: Any, path: str) -> T:
    """Instantiate dataclass ``schema`` from the mapping ``data`` (missing keys take their defaults)."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: expected a mapping with keys {field_names(schema)}, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(schema)}  # type: ignore[arg-type]
    hints = typing.get_type_hints(schema)
    kwargs = {}
    sink = _PROBLEMS.get()
    for key, value in data.items():
        key_path = f"{path}.{key}" if path else str(key)
        try:
            if key not in fields:
                raise ConfigError(unknown_key_message(key_path, str(key), list(fields)))
            kwargs[key] = check_bounds(fields[key], coerce(hints[key], value, key_path), key_path)
        except ConfigError as exc:
            if sink is None:
                raise
            sink.append(str(exc))
    return schema(**kwargs)


def unknown_key_message(path: str, key: str, allowed: list[str]) -> str:
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{path}: unknown key{hint}; allowed keys: {', '.join(allowed)}"


def field_names(schema: type) -> str:
    return ", ".join(f.name for f in dataclasses.fields(schema))


def check_bounds(field: dataclasses.Field[Any], value: Any, path: str) -> Any:
    limits = field.metadata.get("bounds")
    if not limits or value is None:
        return value
    tests: dict[str, tuple[Callable[[Any, Any], bool], str]] = {
        "ge": (lambda v, b: v >= b, ">="),
        "gt": (lambda v, b: v > b, ">"),
        "le": (lambda v, b: v <= b, "<="),
        "lt": (lambda v, b: v < b, "<"),
    }
    for name, limit in limits.items():
        test, _symbol = tests[name]
        if not test(value, limit):
            allowed = " and ".join(f"{tests[n][1]} {_number(b)}" for n, b in limits.items())
            raise ConfigError(f"{path}: {value!r} is out of range; allowed: a number {allowed}")
    return value


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def describe(hint: Any) -> str:
    """How a type reads in an error message: ``an integer``, ``true or false``, ``one of: a, b``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        inner = [describe(a) for a in args if a is not type(None)]
        return " or ".join(inner) + (" or null" if type(None) in args else "")
    if origin is Literal:
        return "one of: " + ", ".join(map(str, args))
    if origin is list:
        return f"a list of {PLURALS.get(args[0], describe(args[0]))}" if args else "a list"
    if origin is dict:
        return "a mapping"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(hint, str(hint))


PLURALS = {int: "integers", float: "numbers", bool: "booleans", str: "strings"}


def coerce(hint: Any, value: Any, path: str) -> Any:
    """``value`` checked (and where lossless, converted) against the type ``hint``."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"{path}: null is not allowed; expected {describe(hint)}")
        options = [a for a in args if a is not type(None)]
        block = options[0] if len(options) == 1 else None
        if isinstance(block, type) and dataclasses.is_dataclass(block) and isinstance(value, Mapping):
            return build(block, value, path)  # an optional block: its own message names the field
        for option in options:
            try:
                return coerce(option, value, path)
            except ConfigError:
                continue
        raise ConfigError(f"{path}: {value!r} is not allowed; expected {describe(hint)}")
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return build(hint, value, path)
    if origin is Literal:
        if value not in args or isinstance(value, bool) != any(isinstance(a, bool) for a in args if a == value):
            raise ConfigError(f"{path}: {value!r} is not allowed; choose one of: {', '.join(map(str, args))}")
        return value
    if origin is list:
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        return [coerce(args[0], item, f"{path}[{i}]") for i, item in enumerate(value)] if args else list(value)
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        inner = args[1] if len(args) == 2 else Any
        return {k: coerce(inner, v, f"{path}.{k}") for k, v in value.items()}
    if hint is Any:
        return value
    if value is None:
        raise ConfigError(f"{path}: null is not allowed; expected {describe(hint)}")
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{path}: expected a finite number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    raise TypeError(f"{path}: schema type {hint!r} is not supported by the loader")


def to_dict(instance: Any) -> dict[str, Any]:
    """A plain nested dict of a schema instance."""
    return dataclasses.asdict(instance)
