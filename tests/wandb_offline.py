"""Read the history of offline wandb runs from their ``run-*.wandb`` transaction logs.

wandb >= 0.19 ships no reader for these files. Each is a LevelDB-style log (a 7-byte ``:W&B`` header, 32 KiB
blocks of records framed as checksum, length, type) of wandb's own protobuf ``Record`` messages, parsed here with
wandb's schema.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _records(path: Path) -> Iterator[bytes]:
    data = path.read_bytes()
    if not data.startswith(b":W&B"):
        raise ValueError(f"{path} is not a wandb transaction log")
    pos, parts = HEADER, []
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # block trailer padding
            pos += left
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        pos += HEADER
        if kind == 0 and length == 0:  # zero-filled rest of the block
            pos += BLOCK - pos % BLOCK if pos % BLOCK else 0
            continue
        parts.append(data[pos : pos + length])
        pos += length
        if kind in (FULL, LAST):
            yield b"".join(parts)
            parts = []


def read_history(wandb_file: str | Path) -> list[dict[str, Any]]:
    """The ``run.log`` rows of one ``.wandb`` file, in order, values decoded from JSON."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for raw in _records(Path(wandb_file)):
        record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]  # generated protobuf class
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
    return rows


def read_run_history(wandb_dir: str | Path, run_id: str) -> list[dict[str, Any]]:
    """Every history row of run ``run_id`` under ``wandb_dir`` (all its offline sessions, oldest first)."""
    files = sorted(Path(wandb_dir).glob(f"*-{run_id}/run-{run_id}.wandb"))
    return [row for path in files for row in read_history(path)]
