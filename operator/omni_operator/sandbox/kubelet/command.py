"""A container's command line and environment as the sandbox runs them (pure).

The container's ``command`` (or its image's ENTRYPOINT and CMD, for an image whose
:class:`ImageConfig` the registry holds: the chart's operator) with mount paths as the pod's
directories, cluster names on the loopback and ``torchrun`` as this Python's
``torch.distributed.run``; the environment is the sandbox's own, then ``envFrom``, then ``env``
(which wins, as on a kubelet), plus the API server's address and credentials.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omni_operator.sandbox.kubelet.container import POD_MARKER
from omni_operator.sandbox.kubelet.images import ImageConfig
from omni_operator.sandbox.kubelet.network import localize, own_address
from omni_operator.sandbox.kubelet.volumes import automount

Obj = dict[str, Any]


def container_argv(container: Obj, config: ImageConfig | None) -> list[str]:
    """A container's argv as a runtime builds it: ``command`` replaces the image's
    ENTRYPOINT (and drops its CMD), ``args`` replace its CMD."""
    command, args = container.get("command"), container.get("args")
    if command:
        return [*command, *(args or [])]
    if config is None:
        return list(args or [])
    return [*config.entrypoint, *(args if args else config.cmd)]


def declared_env(
    pod: Obj, container: Obj, *, ip: str, node: str, env_from: Mapping[str, str]
) -> dict[str, str]:
    """``envFrom``, then ``env`` (values and the ``fieldRef`` fields a kubelet resolves)."""
    fields = {"metadata.name": pod["metadata"]["name"],
              "metadata.namespace": pod["metadata"]["namespace"],
              "spec.nodeName": node, "status.podIP": ip}  # fmt: skip
    pod_env: dict[str, str] = dict(env_from)
    for item in container.get("env") or []:
        if "value" in item:
            pod_env[item["name"]] = str(item["value"])
        elif "fieldRef" in (item.get("valueFrom") or {}):
            pod_env[item["name"]] = fields.get(item["valueFrom"]["fieldRef"]["fieldPath"], "")
    return pod_env


def local_argv(words: list[str], mounts: Mapping[str, Path], *, ip: str) -> list[str]:
    """The command line with the pod's directories and address, torchrun as this Python's (also
    as the command a supervisor runs after its ``--``), a bare program found beside it."""
    words = [own_address(localize(w, mounts), ip) for w in words]
    words = [x for w in words
             for x in ([sys.executable, "-m", "torch.distributed.run"] if w == "torchrun"
                       else [w])]  # fmt: skip
    if not os.path.isabs(words[0]):
        local = Path(sys.executable).parent / words[0]
        words[0] = str(local) if local.exists() else words[0]
    return words


def process_env(
    pod: Obj,
    pod_env: Mapping[str, str],
    mounts: Mapping[str, Path],
    *,
    ip: str,
    in_cluster: Mapping[str, str],
) -> dict[str, str]:
    """The process's environment: the sandbox's, the API server as the pod sees it
    (``in_cluster``), the pod's own, and the marker that finds its processes."""
    env = {**os.environ, **in_cluster}
    env.update({k: localize(v, mounts) for k, v in pod_env.items()})
    if not automount(pod):
        env.pop("KUBECONFIG", None)  # no credentials at all, as in such a pod
    env[POD_MARKER] = pod["metadata"]["uid"]
    env["OMNI_METRICS_ADDR"] = ip
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # The sandbox's nodes share this machine's cores: OpenMP threads spinning between
    # parallel regions (libgomp's default) would take them from the other nodes' trainers.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env
