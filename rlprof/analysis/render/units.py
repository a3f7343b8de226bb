"""How numbers and names are written in every layout: bytes, milliseconds, shares, trends, kernel names."""

from __future__ import annotations

from typing import Optional

GROWTH_FLAG = 0.2
"""A trend at least this large is marked as growing."""
NAME_WIDTH = 60
"""Kernel and operator names longer than this are shortened in tables (the JSON keeps them whole)."""


def human_bytes(value: float) -> str:
    """``512 B``, ``1.5 KiB``, ``12.0 MiB``, ``1.234 GiB``, ``2.000 TiB``, ``1.000 PiB``."""
    size = abs(value)
    if size >= 2**50:
        return f"{value / 2**50:.3f} PiB"
    if size >= 2**40:
        return f"{value / 2**40:.3f} TiB"
    if size >= 2**30:
        return f"{value / 2**30:.3f} GiB"
    if size >= 2**20:
        return f"{value / 2**20:.1f} MiB"
    return f"{value / 2**10:.1f} KiB" if size >= 2**10 else f"{value:.0f} B"


def ms(value: float) -> str:
    return f"{value:,.1f}"


def seconds(value: float) -> str:
    return f"{value:.3g}"


def pct(value: Optional[float]) -> str:
    return "" if value is None else f"{100 * value:.0f}%"


def trend(value: Optional[float]) -> str:
    if value is None:
        return ""
    return f"{100 * value:+.0f}%" + (" (grows)" if value >= GROWTH_FLAG else "")


def short_name(name: str, width: int = NAME_WIDTH) -> str:
    """A demangled C++ kernel name readable in a table: without ``void`` and the argument list, then with nested
    template arguments as ``<…>``, then cut at ``width``: ``void at::native::reduce_kernel<512, 1,
    at::native::ReduceOp<float, ...> >(...)`` -> ``at::native::reduce_kernel<512, 1, at::native::ReduceOp<…> >``.
    Names up to ``width`` characters are kept as they are."""
    if len(name) <= width:
        return name
    text = name.removeprefix("void ")
    text = _without_arguments(text)
    if len(text) > width:
        text = _collapsed_templates(text)
    return text if len(text) <= width else text[: width - 1] + "…"


def _without_arguments(text: str) -> str:
    """``f<T>(int, float)`` -> ``f<T>``: the final parenthesised group outside template brackets."""
    if not text.endswith(")"):
        return text
    parens = angles = 0
    for i in range(len(text) - 1, -1, -1):
        char = text[i]
        if char == ")":
            parens += 1
        elif char == "(":
            parens -= 1
            if parens == 0 and angles == 0:
                return text[:i] if i > 0 else text
        elif char == ">" and parens == 1:
            angles += 1
        elif char == "<" and parens == 1:
            angles -= 1
    return text


def _collapsed_templates(text: str) -> str:
    """``a<b<c>, d>::e<f>`` -> ``a<b<…>, d>::e<f>``: template arguments inside template arguments as ``…``."""
    out, depth = [], 0
    for char in text:
        if char == "<":
            depth += 1
            if depth <= 2:
                out.append("<" if depth == 1 else "<…")
        elif char == ">" and depth > 0:
            if depth <= 2:
                out.append(">")
            depth -= 1
        elif depth <= 1:
            out.append(char)
    return "".join(out)
