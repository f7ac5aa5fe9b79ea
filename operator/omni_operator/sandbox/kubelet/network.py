"""The sandbox's pod network on the loopback.

Every pod gets its own address ``127.<s>.<node>.<n>`` (``s`` drawn per sandbox, so that two
sandboxes on one machine never share a pod address; the trainer's metrics endpoint binds to it
through ``OMNI_METRICS_ADDR``, so the operator scrapes ``podIP:9464`` as in a cluster), cluster
names (``*.svc``) resolve to the loopback where every listener is, and a service port
(torchrun's rendezvous) maps to a free local port per service name so that jobs never collide;
``0.0.0.0`` in a command is the pod's own address.
"""

from __future__ import annotations

import random
import re
import socket
from collections.abc import Mapping
from pathlib import Path

_SVC = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?\.svc(\.cluster\.local)?")
_ANY_ADDRESS = re.compile(r"(?<![\d.])0\.0\.0\.0(?![\d.])")


class Network:
    """Loopback addresses for pods; cluster DNS names (``*.svc``) resolve to the loopback, and
    each (service name, port) maps to its own free local port so that jobs never collide."""

    def __init__(self, subnet: int | None = None) -> None:
        self._next_host: dict[int, int] = {}
        self._ports: dict[tuple[str, int], int] = {}
        self.subnet = random.randint(1, 254) if subnet is None else subnet
        """Second octet of every address of this sandbox (0 is 127.0.0.1's)."""

    def pod_ip(self, node_index: int) -> str:
        n = self._next_host.get(node_index, 0) % 254 + 1
        self._next_host[node_index] = n
        return f"{self.host_ip(node_index)[:-1]}{n}"

    def host_ip(self, node_index: int) -> str:
        return f"127.{self.subnet}.{node_index + 1}.0"

    @staticmethod
    def is_cluster_name(host: str) -> bool:
        return bool(_SVC.fullmatch(host))

    def port(self, host: str, port: int) -> int:
        """The local port standing for ``host:port`` (stable per name)."""
        key = (host.removesuffix(".cluster.local"), port)
        if key not in self._ports:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                self._ports[key] = s.getsockname()[1]
        return self._ports[key]


def localize(text: str, mounts: Mapping[str, Path]) -> str:
    """A command-line word or env value as the sandbox runs it: mount paths -> pod directories,
    cluster DNS names -> the loopback (every service listens there)."""
    for mount, local in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
        if text == mount or text.startswith(mount + "/") or ("=" + mount) in text:
            text = text.replace(mount, str(local), 1)
    return _SVC.sub("127.0.0.1", text)


def localize_paths(text: str, mounts: Mapping[str, Path]) -> str:
    """Every absolute path under a mount in a file's text (the job's manifest in its ConfigMap
    volume: ``stepLog``, ``checkpoint.path`` on a claim) as the pod's directory."""
    for mount, local in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
        pattern = r"(?<![\w./-])" + re.escape(mount.rstrip("/")) + r"(?=[/\s\"',\]}]|$)"
        text = re.sub(pattern, str(local).replace("\\", "\\\\"), text, flags=re.M)
    return text


def own_address(word: str, ip: str) -> str:
    """``0.0.0.0`` (every address of the pod's network namespace) -> the pod's own address:
    pods share the machine's loopback here, so a listener on a fixed port (kopf's
    ``--liveness=http://0.0.0.0:8080/healthz``) binds to its pod's address only."""
    return _ANY_ADDRESS.sub(ip, word)


def _flag(words: list[str], name: str) -> str | None:
    for i, w in enumerate(words):
        if w.startswith(name + "="):
            return w.split("=", 1)[1]
        if w == name and i + 1 < len(words):
            return words[i + 1]
    return None


def map_service_ports(words: list[str], env: dict[str, str], net: Network) -> None:
    """torchrun's ``--master-addr/--master-port`` and ``MASTER_ADDR/MASTER_PORT`` naming a
    cluster service -> its local port (in place; before the names are localized)."""
    host, port = _flag(words, "--master-addr"), _flag(words, "--master-port")
    if host and port and Network.is_cluster_name(host):
        local = str(net.port(host, int(port)))
        for i, w in enumerate(words):
            if w == f"--master-port={port}":
                words[i] = f"--master-port={local}"
            elif w == port and i > 0 and words[i - 1] == "--master-port":
                words[i] = local
    host, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if host and port and Network.is_cluster_name(host):
        env["MASTER_PORT"] = str(net.port(host, int(port)))
