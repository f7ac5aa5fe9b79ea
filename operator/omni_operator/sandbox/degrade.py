"""The sandbox's duty cycle of stopped and continued processes: a pod's ``throttle`` fault (a
slow node) and the ``degraded-network`` node fault: a node whose traffic is slow, as a bad cable,
a flapping link or a congested switch port looks to its peers.

Every pod on the loopback shares one network, so the fault slows the node's pods themselves:
their processes (all but each container's first, its init) are stopped and continued in a duty
cycle (``STOP_S`` stopped, ``RUN_S`` running). A message to or from them waits out the stopped
part of a cycle: short exchanges (the preflight's) slow down many times, long computation only by
``(STOP_S + RUN_S) / RUN_S``. Unlike a real slow link, the node's computation slows as well.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable

import psutil

STOP_S = 0.04
RUN_S = 0.01
REFRESH_S = 1.0
"""How often the node's process list is read again (reading it is the costly part)."""


async def throttle(
    processes: Callable[[], list[psutil.Process]], *, stop_s: float = STOP_S, run_s: float = RUN_S
) -> None:
    """Stop and continue ``processes()`` in a duty cycle (``stop_s`` stopped, ``run_s``
    running) until cancelled; continued at the end. The list is read again every
    :data:`REFRESH_S` (torchrun starts its workers later; an in-place restart starts new ones)."""
    procs: list[psutil.Process] = []
    read_at = 0.0
    try:
        while True:
            if time.monotonic() - read_at > REFRESH_S:
                procs, read_at = processes(), time.monotonic()
            _send(procs, signal.SIGSTOP)
            await asyncio.sleep(stop_s)
            _send(procs, signal.SIGCONT)
            await asyncio.sleep(run_s)
    finally:
        _send(processes(), signal.SIGCONT)


def _send(procs: list[psutil.Process], sig: signal.Signals) -> None:
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(sig)
