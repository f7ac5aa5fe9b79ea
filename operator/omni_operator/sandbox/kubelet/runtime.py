"""The sandbox's container runtime: a bound pod's container as a local process group.

A container starts in the sandbox's working directory (a shared filesystem for every node) with
the pod's environment and volumes (:mod:`.command`, :mod:`.volumes`), and its status is
reported through ``/status`` (Running with a pod IP, then Succeeded/Failed with the exit code).
A container that ends is restarted in its pod under the pod's ``restartPolicy`` (``Always``;
``OnFailure`` when it failed) as a kubelet does: same pod, UID and address, ``restartCount``
up, the end in ``lastState``, ``CrashLoopBackOff`` while a restart backs off (:mod:`.backoff`).
A deleted pod's processes get SIGTERM, then SIGKILL after its grace period
(``deletionGracePeriodSeconds``); once they are gone the pod is removed (a forced deletion), as
a real kubelet does. An ``httpGet`` readinessProbe makes a container start unready; its
``ready`` follows the probe (:mod:`omni_operator.sandbox.probes`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import signal
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omni_operator.sandbox import downward
from omni_operator.sandbox.kubelet import command
from omni_operator.sandbox.kubelet.api import ApiClient, now_iso, pod_key, pod_path
from omni_operator.sandbox.kubelet.backoff import (
    CRASH_BACKOFF_S,
    Backoff,
    Restart,
    crash_backoff,
    go_duration,
)
from omni_operator.sandbox.kubelet.container import (
    Container,
    send_signal,
    set_throttle,
    termination_message,
)
from omni_operator.sandbox.kubelet.images import ImagePuller
from omni_operator.sandbox.kubelet.network import Network, map_service_ports
from omni_operator.sandbox.kubelet.node import SimNode
from omni_operator.sandbox.kubelet.volumes import ConfigMissing, Volumes
from omni_operator.sandbox.probes import ReadinessProbe
from omni_trainer.termination import ENV as TERMINATION_LOG_ENV

Obj = dict[str, Any]
log = logging.getLogger("omni.sandbox")


def grace_seconds(spec: Obj) -> float:
    """The pod's ``terminationGracePeriodSeconds`` (30 by default)."""
    return float(spec.get("terminationGracePeriodSeconds", 30))


@dataclass
class Runtime:
    """The running containers of every node, one per pod (``<namespace>/<name>``)."""

    client: ApiClient
    images: ImagePuller
    volumes: Volumes
    net: Network
    workdir: Path
    cwd: Path
    crash_backoff_s: float = CRASH_BACKOFF_S
    """The first back-off of a crashing container (:func:`.backoff.crash_backoff`)."""
    containers: dict[str, Container] = field(default_factory=dict)
    restarts: dict[str, Restart] = field(default_factory=dict)
    """Containers that ended and wait for their restart in place."""
    backoffs: dict[str, Backoff] = field(default_factory=dict)

    def forget(self, live: set[str]) -> None:
        """Drop the restarts and back-offs of pods that are gone."""
        for table in (self.restarts, self.backoffs):
            for key in [k for k in table if k not in live]:
                del table[key]

    def pod_log(self, namespace: str, name: str) -> str | None:
        path = self.workdir / "logs" / namespace / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else None

    async def start(self, pod: Obj, sim: SimNode, *, restart: Restart | None = None) -> None:
        """Start the pod's container (again, in the same pod and address, for ``restart``)."""
        meta, spec = pod["metadata"], pod["spec"]
        key = pod_key(pod)
        root = self.workdir / "pods" / meta["namespace"] / meta["name"]
        ip = (pod.get("status") or {}).get("podIP") if restart else None
        ip = ip or self.net.pod_ip(sim.index)
        try:
            (container,) = spec["containers"]
            from_refs = await self.volumes.env_from(pod, container)
        except ConfigMissing as err:  # a kubelet waits (and retries) until the object exists
            await self.client.report_waiting(pod, container["name"], container.get("image"),
                                             "CreateContainerConfigError", str(err))  # fmt: skip
            return
        if restart is None:  # a new pod (a kubelet's pod directory is per UID): its emptyDirs
            shutil.rmtree(root / "volumes", ignore_errors=True)  # start empty, even if an
            # earlier pod of the same name (a job deleted and created again) left files there
        loop_now = asyncio.get_running_loop().time()
        try:
            mounts = await self.volumes.mount(pod, root)
            argv, env = self._command(
                pod, container, mounts, ip=ip, node=sim.name, env_from=from_refs
            )
            readiness = ReadinessProbe.of(container, ip, started_at=loop_now)
        except (ValueError, KeyError) as err:
            first = (spec.get("containers") or [{}])[0].get("name", "")
            await self.client.report_exit(
                pod, first, 128, reason="CreateContainerError", message=str(err)
            )
            return
        log_path = self.workdir / "logs" / meta["namespace"] / f"{meta['name']}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        termination_log = root / "termination-log"
        root.mkdir(parents=True, exist_ok=True)
        termination_log.write_bytes(b"")  # what the runtime mounts at terminationMessagePath
        env[TERMINATION_LOG_ENV] = str(termination_log)
        with log_path.open("ab") as out:
            proc = subprocess.Popen(
                argv, cwd=self.cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        count = restart.count if restart else 0
        self.containers[key] = Container(
            key, meta["uid"], sim.name, container["name"], proc, log_path, grace_seconds(spec),
            termination_log=termination_log,
            message_policy=container.get("terminationMessagePolicy", "File"),
            restart_policy=spec.get("restartPolicy", "Always"), restarts=count, mounts=mounts,
            synced_at=loop_now, synced_meta=downward.metadata_version(meta), readiness=readiness,
        )  # fmt: skip
        self.restarts.pop(key, None)
        await self._report_started(pod, sim, self.containers[key], ip=ip, restart=restart)

    async def _report_started(
        self, pod: Obj, sim: SimNode, c: Container, *, ip: str, restart: Restart | None
    ) -> None:
        cs: Obj = {"name": c.name, "ready": c.readiness is None, "restartCount": c.restarts,
                   "state": {"running": {"startedAt": now_iso()}}}  # fmt: skip
        if restart:
            cs["lastState"] = {"terminated": restart.last}
        body: Obj = {"phase": "Running", "podIP": ip, "hostIP": self.net.host_ip(sim.index),
                     "containerStatuses": [cs]}  # fmt: skip
        if not restart:
            body["startTime"] = now_iso()
        await self.client.patch(pod_path(pod, "status"), {"status": body})
        again = f" (restart {c.restarts})" if restart else ""
        log.info(f"sandbox: {c.pod} started{again} on {sim.name} ({ip}), log {c.log_path}")

    def _command(
        self,
        pod: Obj,
        container: Obj,
        mounts: Mapping[str, Path],
        *,
        ip: str,
        node: str,
        env_from: Mapping[str, str],
    ) -> tuple[list[str], dict[str, str]]:
        """argv and environment: the sandbox's own, then ``envFrom``, then ``env`` (which wins,
        as on a kubelet)."""
        words = command.container_argv(container, self.images.config(container.get("image", "")))
        if not words:
            raise ValueError(
                "the sandbox runs only containers with a command (or an image whose "
                "entrypoint it knows)"
            )
        pod_env = command.declared_env(pod, container, ip=ip, node=node, env_from=env_from)
        map_service_ports(words, pod_env, self.net)
        words = command.local_argv(words, mounts, ip=ip)
        in_cluster = self.volumes.in_cluster(pod, mounts)
        return words, command.process_env(pod, pod_env, mounts, ip=ip, in_cluster=in_cluster)

    async def probe(self, pod: Obj, c: Container) -> None:
        """Run the container's readiness probe when due; its ``ready`` follows in the status."""
        probe, http = c.readiness, self.client.http
        if probe is None or http is None or not probe.due(asyncio.get_running_loop().time()):
            return
        if not probe.record(await probe.check(http)):
            return
        statuses = (pod.get("status") or {}).get("containerStatuses") or []
        if statuses:  # a merge patch replaces the list: send the container's whole status
            cs = {**statuses[0], "ready": probe.ready}
            await self.client.patch(
                pod_path(pod, "status"), {"status": {"containerStatuses": [cs]}}
            )
        log.info(f"sandbox: {c.pod} {'ready' if probe.ready else 'not ready'} ({probe.url})")

    async def reap(self) -> None:
        """Collect the containers that ended: report them, restart them in place, or finish
        their pod's deletion."""
        loop = asyncio.get_running_loop()
        for key, c in list(self.containers.items()):
            if c.killing_since is not None and loop.time() - c.killing_since > c.grace_s:
                send_signal(c, signal.SIGKILL)
            code = c.proc.poll()
            if code is None:
                continue
            set_throttle(c, on=False)
            send_signal(c, signal.SIGKILL)  # stragglers of a pod whose first process ended
            del self.containers[key]
            if c.lost:
                continue  # a lost node is silent
            ns, name = key.split("/", 1)
            pod = {"metadata": {"namespace": ns, "name": name}}
            if c.killing_since is not None:  # a deleted pod stopped: the deletion completes
                await self.client.remove_pod(pod)
                continue
            exit_code = 128 - code if code < 0 else code  # killed by signal N -> 128 + N
            reason = "Completed" if exit_code == 0 else "Error"
            message = termination_message(c, exit_code)
            if c.restart_policy == "Always" or (c.restart_policy == "OnFailure" and exit_code):
                await self._back_off(pod, c, exit_code, reason=reason, message=message)
                continue
            await self.client.report_exit(
                pod, c.name, exit_code, reason=reason, message=message, restarts=c.restarts
            )
            log.info(f"sandbox: {key} exited with code {exit_code}")

    async def _back_off(
        self, pod: Obj, c: Container, code: int, *, reason: str, message: str | None
    ) -> None:
        """Restart the ended container in its pod, after its back-off (:func:`crash_backoff`;
        ``CrashLoopBackOff`` meanwhile)."""
        now = asyncio.get_running_loop().time()
        wait, self.backoffs[c.pod] = crash_backoff(
            self.backoffs.get(c.pod), now, first_s=self.crash_backoff_s
        )
        term: Obj = {"exitCode": code, "reason": reason, "finishedAt": now_iso()}
        if message:
            term["message"] = message
        self.restarts[c.pod] = Restart(c.restarts + 1, now + wait, term)
        state: Obj = {"terminated": term}
        if wait > 0:
            state = {
                "waiting": {
                    "reason": "CrashLoopBackOff",
                    "message": (
                        f"back-off {go_duration(wait)} restarting failed container={c.name} "
                        f"pod={c.pod}"
                    ),
                }
            }
        cs = {"name": c.name, "ready": False, "restartCount": c.restarts, "state": state,
              "lastState": {"terminated": term}}  # fmt: skip
        await self.client.patch(pod_path(pod, "status"), {"status": {"containerStatuses": [cs]}})
        log.info(f"sandbox: {c.pod} exited with code {code}; restarting it in {wait:.1f} s")

    def terminate(self, c: Container, *, grace_s: float) -> None:
        """Stop the container: SIGTERM to its first process and SIGKILL to all after
        ``grace_s`` (:meth:`reap`), or SIGKILL at once for a grace of 0."""
        if c.killing_since is None:
            c.killing_since = asyncio.get_running_loop().time()
            c.grace_s = grace_s
            set_throttle(c, on=False)
            if c.hung:
                send_signal(c, signal.SIGCONT)
            if grace_s > 0:  # like a runtime: SIGTERM to the first process, later SIGKILL all
                send_signal(c, signal.SIGTERM, all_processes=False)
            else:
                send_signal(c, signal.SIGKILL)

    def stop_all(self) -> None:
        for c in self.containers.values():
            set_throttle(c, on=False)
            send_signal(c, signal.SIGKILL)
        for c in self.containers.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.proc.wait(timeout=5)
        self.containers.clear()
