"""What verifying a checkpoint's content costs: a 1 GB weight file written with ``torch.save`` (to the page cache and
flushed to disk), then digested as ``checkpoint.mark_complete`` and a resume do (XXH3-128), and with BLAKE2b and
SHA-256 for comparison, each timed in the same run. Target: the digest at most a quarter of the write."""

from __future__ import annotations

import hashlib
import os
import time

import torch

from rlprof_train.checkpoint import file_digest

GIB = 1 << 30


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def stdlib_digest(path, name: str) -> str:
    digest = hashlib.new(name)
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(4 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def test_digesting_a_1_gb_checkpoint_costs_a_fraction_of_writing_it(tmp_path, speed_target):
    weights = torch.randn(GIB // 4)  # 1 GiB of float32
    path = tmp_path / "mp_rank_00_model_states.pt"

    def write() -> None:
        torch.save({"module": {"weight": weights}}, path)
        with path.open("rb+") as handle:
            os.fsync(handle.fileno())

    seconds = {
        "write (torch.save + fsync)": timed(write),
        "XXH3-128 (rlprof_train)": timed(lambda: file_digest(path)),
        "BLAKE2b": timed(lambda: stdlib_digest(path, "blake2b")),
        "SHA-256": timed(lambda: stdlib_digest(path, "sha256")),
    }
    write_s = seconds["write (torch.save + fsync)"]
    print(f"\n1 GiB checkpoint file ({path.stat().st_size / GIB:.2f} GiB):")
    for name, s in seconds.items():
        print(f"  {name:28s} {s:6.2f} s  {path.stat().st_size / GIB / s:5.2f} GiB/s  {s / write_s:5.2f}x the write")
    digest_s = seconds["XXH3-128 (rlprof_train)"]
    speed_target(digest_s <= 0.25 * write_s, f"XXH3-128 {digest_s / write_s:.2f}x the write (target <= 0.25x)")
