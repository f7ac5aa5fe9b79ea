"""Where a rank's step time goes: named, non-overlapping spans, summed per step."""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch

OP_LOG_ENV = "OMNI_OP_LOG"
"""Set to 1 (benchmarks do) to log every span's ends on the CPU: per-op durations for the
replay simulator (``multiplex/replay.py``); off, a step pays nothing for it."""


class PhaseTimer:
    """Sums time per phase. Spans must not nest: each second is counted once.

    On the CPU a span is wall time. With ``events=True`` (GPUs) a span is the time between two
    CUDA events recorded on the current stream at its ends, i.e. where the device's work of the
    phase starts and ends; nothing synchronises inside the step (megatron's 1F1B keeps its
    overlap), and :meth:`take` waits once, for the last event, when the step is over.

    With ``log`` (CPU only) each span and :meth:`mark` is also kept as ``(name, start, end)``
    for :meth:`take_log`.
    """

    def __init__(self, *, events: bool = False, log: bool | None = None) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self._events = events
        self._pending: list[tuple[str, object, object]] = []
        self._log: list[tuple[str, float, float]] | None = (
            [] if (os.environ.get(OP_LOG_ENV) == "1" if log is None else log) and not events
            else None
        )  # fmt: skip

    @contextmanager
    def mark(self, name: str) -> Iterator[None]:
        """Log a stretch (an LLM op) without counting it in any phase; nothing when not
        logging."""
        if self._log is None:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self._log.append((name, start, time.perf_counter()))

    def take_log(self) -> list[tuple[str, float, float]]:
        """The logged spans and marks since the last call, in order of their end."""
        if self._log is None:
            return []
        out, self._log[:] = list(self._log), []
        return out

    @contextmanager
    def span(self, phase: str) -> Iterator[None]:
        if self._events:
            begin = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            begin.record()
            try:
                yield
            finally:
                end.record()
                self._pending.append((phase, begin, end))
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            self.totals[phase] += end - start
            if self._log is not None:
                self._log.append((phase, start, end))

    def take(self) -> dict[str, float]:
        """The totals since the last call, and start over."""
        if self._pending:
            self._pending[-1][2].synchronize()  # events complete in stream order
            for phase, begin, end in self._pending:
                self.totals[phase] += begin.elapsed_time(end) / 1e3
            self._pending.clear()
        out = dict(self.totals)
        self.totals.clear()
        return out


class ActivationMeter:
    """Bytes that encoder forwards keep for their backward, live and at peak.

    Counted through ``saved_tensors_hooks`` (each storage once per encoder micro-batch), which is
    exactly the activation memory the on-demand insertion policy is meant to bound.
    """

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._by_key: dict[object, int] = {}

    @contextmanager
    def recording(self, key: object) -> Iterator[None]:
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        size = sum(seen.values())
        self._by_key[key] = self._by_key.get(key, 0) + size
        self.live += size
        self.peak = max(self.peak, self.live)

    def release(self, key: object) -> None:
        self.live -= self._by_key.pop(key, 0)

    def take_peak(self) -> int:
        """Peak since the last call (then the peak restarts from what is live now)."""
        peak, self.peak = self.peak, self.live
        return peak
