"""How numbers are written in every layout: bytes, milliseconds, shares, trends."""

from __future__ import annotations

from typing import Optional

GROWTH_FLAG = 0.2
"""A trend at least this large is marked as growing."""


def human_bytes(value: float) -> str:
    """``512 B``, ``1.5 KiB``, ``12.0 MiB``, ``1.234 GiB``."""
    size = abs(value)
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
