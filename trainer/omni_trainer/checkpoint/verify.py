"""Checksums of a committed step, verified before a restart loads it.

The commit marker records each file's size and sha256. Sizes catch a truncated or missing file
for free; only the hash catches a file corrupted in place at the same size (a bad disk, a
partial overwrite), which would otherwise load and turn the loss non-finite a few steps later.
Hashing is streamed (never a whole file in memory) and parallel twice over: the files of a step
are shared among the ranks (largest first, each to the least-loaded rank: every rank computes
the same split), and each rank hashes its share in threads (``hashlib`` releases the GIL on
large updates, so threads use several cores). Measured cost: ``bench_verify`` below.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

CHUNK_BYTES = 8 << 20
"""Bytes hashed per read: large enough that the GIL is released for most of the time."""


def default_threads() -> int:
    """Hashing threads per rank: the cores this process may use, at most 8 (storage bandwidth,
    not hashing, bounds more)."""
    return max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1))


def sha256_stream(stream: BinaryIO) -> str:
    """The sha256 of a stream, read in :data:`CHUNK_BYTES` pieces."""
    digest = hashlib.sha256()
    while chunk := stream.read(CHUNK_BYTES):
        digest.update(chunk)
    return digest.hexdigest()


def share(files: Mapping[str, Mapping[str, Any]], rank: int, world: int) -> list[str]:
    """The files rank ``rank`` of ``world`` verifies: largest first to the least-loaded rank
    (ties to the lowest rank), the same split on every rank."""
    load = [0] * world
    mine: list[str] = []
    for rel in sorted(files, key=lambda r: (-int(files[r]["size"]), r)):
        least = min(range(world), key=lambda r: (load[r], r))
        load[least] += int(files[rel]["size"])
        if least == rank:
            mine.append(rel)
    return mine


def mismatches(
    open_file: Callable[[str], BinaryIO],
    files: Mapping[str, Mapping[str, Any]],
    rels: list[str],
    *,
    threads: int | None = None,
) -> list[str]:
    """The files among ``rels`` whose sha256 differs from the marker's (in words, sorted).

    Args:
        open_file: opens a stored file of the step for reading (closed here).
        files: the marker's ``files`` (``size`` and ``sha256`` by relative path).
        rels: the files to check.
        threads: hashing threads (default :func:`default_threads`).
    """

    def check(rel: str) -> str | None:
        try:
            with open_file(rel) as stream:
                found = sha256_stream(stream)
        except OSError as exc:
            return f"{rel}: unreadable ({exc})"
        want = files[rel]["sha256"]
        return None if found == want else f"{rel}: sha256 {found[:12]} != marker {want[:12]}"

    with ThreadPoolExecutor(max_workers=threads or default_threads()) as pool:
        return sorted(m for m in pool.map(check, rels) if m is not None)


def bench_verify(
    directory: Path, *, gigabytes: float, files: int, threads: int
) -> dict[str, float]:
    """Write ``files`` files of ``gigabytes`` in total under ``directory``, hash them as a resume
    does, and give the seconds and GB/s (the figure a 7B checkpoint's cost is scaled from)."""
    each = int(gigabytes * 1e9 / files)
    block = os.urandom(CHUNK_BYTES)
    entries: dict[str, dict[str, Any]] = {}
    for i in range(files):
        path = directory / f"f{i}"
        with path.open("wb") as f:
            left = each
            while left > 0:
                f.write(block[: min(left, len(block))])
                left -= len(block)
        entries[path.name] = {"size": each, "sha256": ""}
    start = time.perf_counter()
    mismatches(lambda rel: (directory / rel).open("rb"), entries, sorted(entries), threads=threads)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "gb_per_s": gigabytes / seconds}
