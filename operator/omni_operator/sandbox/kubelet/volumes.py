"""A pod's volumes and the configuration its container reads, as a kubelet provides them.

ConfigMap, Secret and downwardAPI volumes become files, emptyDirs directories of the pod, a
PersistentVolumeClaim one directory every pod shares (the sandbox's storage), a hostPath a
directory of the pod's node (gone when the node is lost); ``envFrom`` reads Secrets and
ConfigMaps. Unless ``automountServiceAccountToken: false``, the service account's credentials
are mounted and handed over (:meth:`Volumes.in_cluster`). A running pod's ConfigMap and
downwardAPI volumes follow their sources when the kubelet syncs the pod (a container starts,
the pod's labels or annotations change, or ``sync_s`` passes: a kubelet's ``syncFrequency``,
1 min), so a ConfigMap update alone reaches a running pod as late as on a cluster.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yarl

from omni_operator.sandbox import downward
from omni_operator.sandbox.kubelet.api import ApiClient
from omni_operator.sandbox.kubelet.container import Container
from omni_operator.sandbox.kubelet.network import localize_paths

Obj = dict[str, Any]
SYNC_S = 60.0
"""A kubelet's default ``syncFrequency`` (1 min)."""
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


class ConfigMissing(LookupError):
    """A Secret or ConfigMap a container's environment needs does not exist (yet)."""


def automount(pod: Obj) -> bool:
    """Whether the pod gets its service account's credentials (the pod's
    ``automountServiceAccountToken``, default true)."""
    return (pod.get("spec") or {}).get("automountServiceAccountToken", True) is not False


@dataclass
class Volumes:
    """The pods' volumes under :attr:`workdir` and the objects they are made of."""

    client: ApiClient
    workdir: Path
    sync_s: float = SYNC_S
    """A kubelet's ``syncFrequency``: how often a running pod's ConfigMap and downwardAPI
    volumes are refreshed when nothing else makes the kubelet sync it."""

    def node_disk(self, node: str) -> Path:
        """A node's local disk (its hostPath volumes live here; gone when the node is lost)."""
        return self.workdir / "nodes" / node

    async def config_data(self, namespace: str, kind: str, name: str) -> dict[str, bytes]:
        """A ConfigMap's or Secret's keys (Secrets base64-decoded), as the kubelet reads them.

        Raises:
            ConfigMissing: worded as a kubelet words it (``secret "x" not found``).
        """
        plural = "secrets" if kind == "secret" else "configmaps"
        obj = await self.client.get(f"/api/v1/namespaces/{namespace}/{plural}/{name}")
        if obj is None:
            raise ConfigMissing(f'{kind} "{name}" not found')
        if kind == "secret":
            out = {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
            out.update({k: str(v).encode() for k, v in (obj.get("stringData") or {}).items()})
            return out
        return {k: str(v).encode() for k, v in (obj.get("data") or {}).items()}

    async def env_from(self, pod: Obj, container: Obj) -> dict[str, str]:
        """``envFrom``: every key of the named Secrets and ConfigMaps, with its prefix."""
        env: dict[str, str] = {}
        for ref in container.get("envFrom") or []:
            kind = "secret" if "secretRef" in ref else "configmap"
            name = (ref.get("secretRef") or ref.get("configMapRef") or {})["name"]
            data = await self.config_data(pod["metadata"]["namespace"], kind, name)
            env.update({ref.get("prefix", "") + k: v.decode() for k, v in data.items()})
        return env

    async def mount(self, pod: Obj, root: Path) -> dict[str, Path]:
        """The pod's volumes under its directory ``root``, as mount path -> local directory
        (``/dev/shm`` stays the host's); a ConfigMap's files name the pod's directories."""
        meta, spec = pod["metadata"], pod["spec"]
        dirs: dict[str, Path] = {}
        for vol in spec.get("volumes") or []:
            dirs[vol["name"]] = await self._volume(vol, meta, spec, root)
        mounts: dict[str, Path] = {}
        if automount(pod):  # the projected service account volume a kubelet mounts
            mounts[SERVICE_ACCOUNT_DIR] = root / "volumes" / "kube-api-access"
            mounts[SERVICE_ACCOUNT_DIR].mkdir(parents=True, exist_ok=True)
        for c in spec["containers"]:
            for m in c.get("volumeMounts") or []:
                if m["mountPath"] != "/dev/shm":
                    mounts[m["mountPath"]] = dirs[m["name"]] / m.get("subPath", "")
                    mounts[m["mountPath"]].mkdir(parents=True, exist_ok=True)
        for vol in spec.get("volumes") or []:
            if "configMap" in vol:  # what the trainer reads: its paths on this pod's mounts
                for file in dirs[vol["name"]].iterdir():
                    file.write_text(localize_paths(file.read_text(), mounts))
        return mounts

    async def _volume(self, vol: Obj, meta: Obj, spec: Obj, root: Path) -> Path:
        """One volume's directory, with its files."""
        path = root / "volumes" / vol["name"]
        if "persistentVolumeClaim" in vol:
            claim = vol["persistentVolumeClaim"]["claimName"]
            path = self.workdir / "claims" / meta["namespace"] / claim
        if "hostPath" in vol:  # the node's own disk: it goes when the node is lost
            host = vol["hostPath"]["path"].lstrip("/")
            path = self.node_disk(spec["nodeName"]) / host
        path.mkdir(parents=True, exist_ok=True)
        if "downwardAPI" in vol:
            for file, content in downward.downward_files(vol["downwardAPI"], meta).items():
                (path / file).write_bytes(content)
        for kind in ("configMap", "secret"):
            if kind in vol:
                name = vol[kind].get("name") or vol[kind].get("secretName")
                try:
                    data = await self.config_data(meta["namespace"], kind.lower(), name)
                except ConfigMissing as err:
                    raise ValueError(str(err)) from None
                for file, content in data.items():
                    (path / file).write_bytes(content)
        return path

    async def sync(self, pod: Obj, c: Container) -> None:
        """A running pod's ConfigMap and downwardAPI volumes follow their sources when the
        kubelet syncs the pod: its labels or annotations changed (a pod update), or
        :attr:`sync_s` passed since the last sync (a container's start is one too,
        :meth:`mount`). A ConfigMap written alone can take a sync period to show."""
        now = asyncio.get_running_loop().time()
        version = downward.metadata_version(pod["metadata"])
        if version == c.synced_meta and now - c.synced_at < self.sync_s:
            return
        c.synced_at, c.synced_meta = now, version
        root = self.workdir / "pods" / c.pod
        for vol in pod["spec"].get("volumes") or []:
            if "downwardAPI" in vol:
                data = downward.downward_files(vol["downwardAPI"], pod["metadata"])
            elif "configMap" in vol:
                try:
                    data = await self.config_data(c.pod.split("/")[0], "configmap",
                                                  vol["configMap"]["name"])  # fmt: skip
                except ConfigMissing:
                    continue
                data = {f: localize_paths(v.decode(), c.mounts).encode() for f, v in data.items()}
            else:
                continue
            for file, text in data.items():
                path = root / "volumes" / vol["name"] / file
                if not path.exists() or path.read_bytes() != text:
                    tmp = path.with_name(f".{file}.tmp")
                    tmp.write_bytes(text)
                    tmp.replace(path)  # atomic, like the kubelet's symlink swap

    def in_cluster(self, pod: Obj, mounts: Mapping[str, Path]) -> dict[str, str]:
        """The API server as a pod sees it: ``KUBERNETES_SERVICE_HOST`` / ``_PORT`` (every
        pod), and unless ``automountServiceAccountToken: false`` the service account's files
        (``token``, ``namespace``) in :data:`SERVICE_ACCOUNT_DIR`'s pod directory. A local
        process cannot open that fixed path (kopf's and client-go's in-cluster login do), so
        the same credentials are handed over as ``KUBECONFIG`` too (the API server is plain
        HTTP on the loopback, and does not check tokens)."""
        api = self.client.url
        url = yarl.URL(api)
        env = {"KUBERNETES_SERVICE_HOST": str(url.host), "KUBERNETES_SERVICE_PORT": str(url.port),
               "KUBERNETES_PORT": f"tcp://{url.host}:{url.port}"}  # fmt: skip
        local = mounts.get(SERVICE_ACCOUNT_DIR)
        if local is None:
            return env
        meta = pod["metadata"]
        account = pod["spec"].get("serviceAccountName") or "default"
        token = f"sandbox:{meta['namespace']}:{account}"
        (local / "token").write_text(token)
        (local / "namespace").write_text(meta["namespace"])
        config = {"apiVersion": "v1", "kind": "Config", "current-context": "in-cluster",
                  "clusters": [{"name": "in-cluster", "cluster": {"server": api}}],
                  "users": [{"name": account, "user": {"token": token}}],
                  "contexts": [{"name": "in-cluster", "context": {
                      "cluster": "in-cluster", "user": account,
                      "namespace": meta["namespace"]}}]}  # fmt: skip
        (local.parent / "kubeconfig").write_text(json.dumps(config))
        return {**env, "KUBECONFIG": str(local.parent / "kubeconfig")}
