"""apps/v1 Deployments, emulated: the sandbox runs the chart's operator as its Deployment's pod.

An emulation of the Deployment controller's documented contract, not kube-controller-manager:
no ReplicaSets (their work is done here directly). Each tick it reads Deployments and Pods over
HTTP and, per Deployment:

* creates ``spec.replicas`` pods from ``spec.template``, named ``<deployment>-<hash>-<suffix>``
  (``hash``: the ``pod-template-hash`` label, of the template; ``suffix``: 5 random characters),
  with an ``ownerReference`` to the Deployment (``controller: true``);
* replaces a pod that is deleted or that ended (a failed pod is deleted, as the pod garbage
  collector would); removes surplus pods;
* rolls out a changed template by deleting the old pods first and then creating the new ones
  (the ``Recreate`` strategy, whichever strategy is named: the chart's operator uses it, and
  kopf must never run twice);
* reports ``status`` through ``/status``: ``replicas``, ``updatedReplicas``, ``readyReplicas``,
  ``availableReplicas`` (``minReadySeconds`` is not counted), ``observedGeneration`` and the
  ``Available`` / ``Progressing`` conditions, so ``kubectl rollout status`` and ``kubectl wait
  --for=condition=Available`` work;
* deletes the pods of a Deployment that is gone (what the garbage collector does through the
  ``ownerReferences``; the emulator does not collect garbage).

Pure helpers (:func:`template_hash`, :func:`pod_for`, :func:`plan`, :func:`deployment_status`)
hold the logic; :class:`DeploymentController` only reads and writes.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import json
import logging
import secrets
from dataclasses import dataclass, field
from typing import Any

import aiohttp

Obj = dict[str, Any]
HASH_LABEL = "pod-template-hash"
SAFE = "bcdfghjklmnpqrstvwxz2456789"
"""The alphabet Kubernetes uses for generated name parts (``rand.SafeEncodeString``)."""
log = logging.getLogger("omni.sandbox")


def _safe(data: bytes, length: int) -> str:
    return "".join(SAFE[b % len(SAFE)] for b in data[:length])


def template_hash(template: Obj) -> str:
    """The ``pod-template-hash`` of a pod template: 10 characters, stable for equal templates."""
    digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).digest()
    return _safe(digest, 10)


def pod_for(deploy: Obj, *, suffix: str | None = None) -> Obj:
    """A new pod of the Deployment's template: its labels plus the template hash, owned by the
    Deployment."""
    meta = deploy["metadata"]
    template = deploy["spec"]["template"]
    digest = template_hash(template)
    tmeta = template.get("metadata") or {}
    suffix = suffix or _safe(secrets.token_bytes(5), 5)
    owner = {"apiVersion": "apps/v1", "kind": "Deployment", "name": meta["name"],
             "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True}  # fmt: skip
    pod_meta: Obj = {
        "name": f"{meta['name']}-{digest}-{suffix}",
        "namespace": meta["namespace"],
        "labels": {**(tmeta.get("labels") or {}), HASH_LABEL: digest},
        "ownerReferences": [owner],
    }
    if tmeta.get("annotations"):
        pod_meta["annotations"] = dict(tmeta["annotations"])
    return {"apiVersion": "v1", "kind": "Pod", "metadata": pod_meta, "spec": template["spec"]}


def owner_uid(pod: Obj) -> str | None:
    """The uid of the Deployment controlling the pod (None: none does)."""
    for ref in (pod.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == "Deployment" and ref.get("controller"):
            return str(ref.get("uid"))
    return None


def _ended(pod: Obj) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def _terminating(pod: Obj) -> bool:
    return bool(pod["metadata"].get("deletionTimestamp"))


def pod_ready(pod: Obj) -> bool:
    """Running with every container ready (the pod's Ready condition)."""
    status = pod.get("status") or {}
    statuses = status.get("containerStatuses") or []
    return (
        status.get("phase") == "Running"
        and bool(statuses)
        and all(cs.get("ready") for cs in statuses)
    )


@dataclass(frozen=True)
class Plan:
    """What to do for one Deployment this tick."""

    create: int = 0
    delete: tuple[str, ...] = ()


def plan(deploy: Obj, pods: list[Obj]) -> Plan:
    """Create / delete to bring ``pods`` (the Deployment's own) to its spec. Ended pods are
    deleted and replaced; a changed template deletes every old pod and creates new ones only
    once they are gone (Recreate). Pure."""
    want = int(deploy["spec"].get("replicas", 1))
    digest = template_hash(deploy["spec"]["template"])
    live = [p for p in pods if not _terminating(p)]
    ended = [p for p in live if _ended(p)]
    old = [p for p in live if not _ended(p) and p["metadata"]["labels"].get(HASH_LABEL) != digest]
    current = [p for p in live if not _ended(p) and p not in old]
    delete = [p["metadata"]["name"] for p in (*ended, *old)]
    if old or any(_terminating(p) and p["metadata"]["labels"].get(HASH_LABEL) != digest
                  for p in pods):  # fmt: skip
        return Plan(0, tuple(delete))  # Recreate: the old ones go first
    surplus = sorted(current, key=lambda p: (pod_ready(p), p["metadata"]["name"]))
    delete += [p["metadata"]["name"] for p in surplus[: max(0, len(current) - want)]]
    return Plan(max(0, want - len(current)), tuple(delete))


def deployment_status(deploy: Obj, pods: list[Obj], *, now: str) -> Obj:
    """The status a Deployment reports for its pods (``now``: the time of a transition). Pure."""
    want = int(deploy["spec"].get("replicas", 1))
    digest = template_hash(deploy["spec"]["template"])
    live = [p for p in pods if not _terminating(p) and not _ended(p)]
    updated = [p for p in live if p["metadata"]["labels"].get(HASH_LABEL) == digest]
    ready = [p for p in live if pod_ready(p)]
    available = len(ready) >= want
    old = {c.get("type"): c for c in (deploy.get("status") or {}).get("conditions") or []}

    def condition(kind: str, ok: bool, reason: str, message: str) -> Obj:
        status = "True" if ok else "False"
        since = old.get(kind, {})
        same = since.get("status") == status
        times = ("lastUpdateTime", "lastTransitionTime")
        return {"type": kind, "status": status, "reason": reason, "message": message,
                **{t: since.get(t, now) if same else now for t in times}}  # fmt: skip

    done = len(updated) == want and available and len(live) == want
    name = deploy["metadata"]["name"]
    return {
        "observedGeneration": deploy["metadata"].get("generation", 1),
        "replicas": len(live),
        "updatedReplicas": len(updated),
        "readyReplicas": len(ready),
        "availableReplicas": len(ready),
        "unavailableReplicas": max(0, want - len(ready)),
        "conditions": [
            condition("Available", available,
                      "MinimumReplicasAvailable" if available else "MinimumReplicasUnavailable",
                      "Deployment has minimum availability." if available
                      else "Deployment does not have minimum availability."),
            condition("Progressing", True,
                      "NewReplicaSetAvailable" if done else "ReplicaSetUpdated",
                      f'Pods of Deployment "{name}" ({digest}) '
                      + ("have successfully progressed." if done else "are progressing.")),
        ],
    }  # fmt: skip


def _same(a: Obj, b: Obj) -> bool:
    """Whether two statuses differ only in their conditions' times."""

    def strip(s: Obj) -> Obj:
        conds = [{k: v for k, v in c.items() if not k.endswith("Time")}
                 for c in s.get("conditions") or []]  # fmt: skip
        return {**s, "conditions": conds}

    return strip(a) == strip(b)


@dataclass
class DeploymentController:
    """The sandbox's Deployment controller (see the module docstring)."""

    api: str
    tick_s: float = 0.5
    _http: aiohttp.ClientSession | None = field(default=None, repr=False)
    _had: bool = False
    """Whether the last tick saw Deployments (with none now, one more tick collects pods)."""

    async def run(self) -> None:
        async with aiohttp.ClientSession() as http:
            self._http = http
            try:
                while True:
                    try:
                        await self.tick()
                    except aiohttp.ClientError as err:
                        log.warning(f"sandbox deployments: API call failed: {err}")
                    await asyncio.sleep(self.tick_s)
            finally:
                self._http = None

    async def tick(self) -> None:
        deploys = await self._list("/apis/apps/v1/deployments")
        if not deploys and not self._had:
            return  # no pods to read (a sandbox without Deployments pays one list a tick)
        self._had = bool(deploys)
        pods = await self._list("/api/v1/pods")
        by_uid = {d["metadata"]["uid"]: d for d in deploys}
        owned: dict[str, list[Obj]] = {uid: [] for uid in by_uid}
        for pod in pods:
            uid = owner_uid(pod)
            if uid is None:
                continue
            if uid in owned:
                owned[uid].append(pod)
            elif not _terminating(pod):  # its Deployment is gone: collected
                await self._delete(pod["metadata"]["namespace"], pod["metadata"]["name"])
        now = dt.datetime.now(tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        for uid, deploy in by_uid.items():
            if deploy["metadata"].get("deletionTimestamp"):
                continue
            ns = deploy["metadata"]["namespace"]
            todo = plan(deploy, owned[uid])
            for name in todo.delete:
                await self._delete(ns, name)
            for _ in range(todo.create):
                await self._post(f"/api/v1/namespaces/{ns}/pods", pod_for(deploy))
            status = deployment_status(deploy, owned[uid], now=now)
            if not _same(status, deploy.get("status") or {}):
                path = f"/apis/apps/v1/namespaces/{ns}/deployments/{deploy['metadata']['name']}"
                await self._patch(path + "/status", {"status": status})

    # -- HTTP ----------------------------------------------------------------------------------
    async def _list(self, path: str) -> list[Obj]:
        assert self._http is not None
        async with self._http.get(self.api + path) as resp:
            resp.raise_for_status()
            return (await resp.json()).get("items") or []

    async def _post(self, path: str, body: Obj) -> None:
        assert self._http is not None
        async with self._http.post(self.api + path, json=body) as resp:
            if resp.status >= 400:
                log.warning(f"sandbox deployments: POST {path}: {resp.status} {await resp.text()}")

    async def _patch(self, path: str, body: Obj) -> None:
        assert self._http is not None
        headers = {"Content-Type": "application/merge-patch+json"}
        async with self._http.patch(self.api + path, json=body, headers=headers) as resp:
            if resp.status not in (200, 404):
                resp.raise_for_status()

    async def _delete(self, namespace: str, name: str) -> None:
        assert self._http is not None
        async with self._http.delete(f"{self.api}/api/v1/namespaces/{namespace}/pods/{name}") as r:
            if r.status not in (200, 404):
                r.raise_for_status()
