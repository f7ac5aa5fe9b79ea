"""Media decoding off the training thread: worker threads fed ahead of use.

The loop submits the media references it will encode (the current step's, and, where the data
plane can predict them, the next steps'); workers read, decode and preprocess them; the training
thread takes finished arrays (or decodes a reference nobody submitted itself). Results are pure
functions of the reference, so prefetching never changes what is trained on, and the loader state
is untouched by it (read-ahead draws are rewound in ``components/dataplane.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from omni_trainer.data.sample import MediaRef


class MediaPrefetcher:
    """A pool of ``workers`` decoding threads and the futures of what was submitted.

    Bounded by its callers: they submit at most the media of their read-ahead depth, and every
    submitted reference is taken (or dropped with :meth:`clear`) by the training thread.
    """

    def __init__(self, load: Callable[[MediaRef], Any], *, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self._load = load
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="omni-media")
        self._futures: dict[MediaRef, Future] = {}
        self._lock = threading.Lock()
        self.hits = 0
        """References taken ready or in flight (decoded, or being decoded, by a worker)."""

    def submit(self, refs: Iterable[MediaRef]) -> None:
        """Start decoding ``refs`` (already submitted ones are not decoded twice)."""
        with self._lock:
            for ref in refs:
                if ref not in self._futures:
                    self._futures[ref] = self._pool.submit(self._load, ref)

    def take(self, ref: MediaRef) -> Any | None:
        """What ``load`` returned for a submitted ``ref`` (waiting for it), else None."""
        with self._lock:
            future = self._futures.pop(ref, None)
        if future is None:
            return None
        self.hits += 1
        return future.result()

    def clear(self) -> None:
        """Forget everything submitted (after a resume rewinds the data)."""
        with self._lock:
            futures, self._futures = self._futures, {}
        for f in futures.values():
            f.cancel()

    def close(self) -> None:
        self.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)
