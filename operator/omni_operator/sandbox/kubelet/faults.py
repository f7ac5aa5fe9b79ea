"""Faults requested through the API, as the kubelet carries them out.

The annotation :data:`~omni_operator.sandbox.control.FAULT` (``kubectl annotate`` works as well
as ``omni sandbox fault``) on a Node: ``lost`` (its processes are killed, its local disk goes,
it stops reporting and turns Ready=Unknown), ``ready`` (it comes back), ``degraded-network``
(its pods stall in a duty cycle, :mod:`omni_operator.sandbox.degrade`, until the annotation
changes). On a Pod: ``kill`` (every process of its container gets SIGKILL, exit 137), ``crash``
(its newest process, a trainer worker, dies of SIGKILL, as a rank that crashes does: torchrun
stops the others, and the supervisor or the container's end reports it), ``hang`` (SIGSTOP to
every process but the first: the trainer stops making progress), ``throttle`` (the same
processes stopped and continued on a duty cycle, :data:`.container.THROTTLE_STOPPED` of every
:data:`.container.THROTTLE_PERIOD_S`, until the annotation goes: a node slower than the others,
as a thermally throttled GPU or a noisy neighbour makes one). ``kill`` and ``crash`` act once:
the kubelet removes the annotation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import signal
from dataclasses import dataclass
from typing import Any

import psutil

from omni_operator.sandbox import degrade
from omni_operator.sandbox.control import FAULT
from omni_operator.sandbox.kubelet.api import ApiClient, pod_path
from omni_operator.sandbox.kubelet.container import (
    Container,
    pod_processes,
    send_signal,
    set_throttle,
)
from omni_operator.sandbox.kubelet.node import SimNode, ready_condition
from omni_operator.sandbox.kubelet.runtime import Runtime
from omni_operator.sandbox.kubelet.volumes import Volumes

Obj = dict[str, Any]
log = logging.getLogger("omni.sandbox")


def fault_of(obj: Obj) -> str:
    """The fault an object's annotation requests ("": none)."""
    return ((obj["metadata"].get("annotations") or {}).get(FAULT) or "").strip()


def crash_newest(c: Container) -> None:
    """A trainer process dies: the pod's newest (a worker: torchrun, a supervisor and the
    zygote its workers fork from all started before it); the container's only one if alone."""
    started: list[tuple[float, int, psutil.Process]] = []
    for p in pod_processes(c.uid):
        with contextlib.suppress(psutil.Error):
            if p.pid != c.proc.pid:
                started.append((p.create_time(), p.pid, p))
    if not started:
        send_signal(c, signal.SIGKILL, all_processes=False)
        return
    with contextlib.suppress(psutil.Error):
        max(started, key=lambda t: t[:2])[2].kill()


@dataclass
class Faults:
    """Carries out the faults the nodes' and running pods' annotations request."""

    client: ApiClient
    runtime: Runtime
    volumes: Volumes

    async def on_node(self, sim: SimNode, node: Obj) -> None:
        """Lose the node, bring it back, or start or end its ``degraded-network``."""
        fault = fault_of(node)
        if (fault == "degraded-network") != (sim.degraded is not None):
            self._degrade(sim, on=fault == "degraded-network")
        if fault == "lost" and not sim.lost:
            sim.lost = True
            for c in list(self.runtime.containers.values()):
                if c.node == sim.name:
                    send_signal(c, signal.SIGKILL)
                    c.lost = True
            await self.client.patch(
                f"/api/v1/nodes/{sim.name}", {"status": {"conditions": ready_condition(False)}}
            )
            # its local disk goes with it: a new node's is empty
            shutil.rmtree(self.volumes.node_disk(sim.name), ignore_errors=True)
            log.warning(f"sandbox: node {sim.name} lost (its processes and local disk)")
        elif fault in ("", "ready") and sim.lost:
            sim.lost = False
            await self.client.patch(
                f"/api/v1/nodes/{sim.name}", {"status": {"conditions": ready_condition(True)}}
            )
            log.warning(f"sandbox: node {sim.name} is back")

    def _degrade(self, sim: SimNode, *, on: bool) -> None:
        """Start or end the node's ``degraded-network`` duty cycle (its pods' processes but
        each container's init; a hung container stays stopped)."""
        if not on:
            assert sim.degraded is not None
            sim.degraded.cancel()
            sim.degraded = None
            log.warning(f"sandbox: node {sim.name}'s network is healthy again")
            return

        def processes() -> list[psutil.Process]:
            containers = self.runtime.containers.values()
            mine = [c for c in containers if c.node == sim.name and not c.hung]
            return [p for c in mine for p in pod_processes(c.uid) if p.pid != c.proc.pid]

        sim.degraded = asyncio.get_running_loop().create_task(
            degrade.throttle(processes), name=f"sandbox-degraded-{sim.name}"
        )
        log.warning(f"sandbox: node {sim.name}'s network degraded (its pods stall in a duty cycle)")

    async def on_pod(self, pod: Obj, c: Container) -> bool:
        """Kill, crash or hang the running pod's container, or start or end its throttle;
        True when a fault acted, so the pod's sync waits for the next tick."""
        fault = fault_of(pod)
        if fault in ("kill", "crash"):
            if fault == "kill":
                send_signal(c, signal.SIGKILL)
            else:
                crash_newest(c)
            await self.client.patch(pod_path(pod), {"metadata": {"annotations": {FAULT: None}}})
            return True
        if fault == "hang" and not c.hung:
            c.hung = True
            send_signal(c, signal.SIGSTOP, spare_first=True)
            return True
        set_throttle(c, on=fault == "throttle")
        return False
