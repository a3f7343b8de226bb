"""Whole files for readers that may look at any moment (a Prometheus server's file discovery, ``rlprof top``, a
resume): written beside their place under a hidden name and moved there in one step, so that a reader sees the old
file or the new one, never half of one."""

from __future__ import annotations

import os
from pathlib import Path


def write_text_atomically(path: Path, text: str) -> None:
    """``text`` as the whole of ``path`` (its folder must exist), replaced in one step."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, path)
