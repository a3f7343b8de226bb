"""Colours of ranges in Nsight Systems: one per built-in role, stable per name for the others, or the user's own."""

from __future__ import annotations

from typing import Optional

ROLE_COLORS: dict[str, int] = {
    "rollout": 0xFF76B900,  # green
    "actor": 0xFF1F77B4,  # blue
    "critic": 0xFF9467BD,  # purple
    "ref": 0xFFFF7F0E,  # orange
    "reward": 0xFFD62728,  # red
    "step": 0xFF7F7F7F,  # grey
    "tool": 0xFFFFD700,  # gold: a multi-turn rollout's tool calls
}
OTHER_ROLE_COLORS = (0xFF17BECF, 0xFFBCBD22, 0xFF8C564B, 0xFFE377C2)
NAMED_COLORS: dict[str, int] = {
    "green": 0xFF008000,
    "blue": 0xFF0000FF,
    "yellow": 0xFFFFFF00,
    "purple": 0xFF800080,
    "cyan": 0xFF00FFFF,
    "red": 0xFFFF0000,
    "white": 0xFFFFFFFF,
    "darkgreen": 0xFF006400,
    "orange": 0xFFFFA500,
    "grey": 0xFF7F7F7F,
    "black": 0xFF000000,
    "pink": 0xFFFFC0CB,
    "brown": 0xFF8B4513,
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
