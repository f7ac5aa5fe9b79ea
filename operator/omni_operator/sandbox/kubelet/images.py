"""Images as the sandbox's nodes pull them.

A pod's images must be in the sandbox's :class:`Registry`; any other image fails as a real
kubelet reports it: the container waits in ``ErrImagePull`` at each pull attempt and in
``ImagePullBackOff`` between them (the delay doubles up to a cap), the pod stays Pending. A node
pulls an image it does not hold yet in ``Registry.pull_s`` seconds (the container waits in
``ContainerCreating``; pods of one node share the pull) and keeps it, as a node's image cache
does: a pod recreated on a fresh node pays the pull, one restarted in place does not.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from omni_operator.sandbox.kubelet.api import ApiClient, pod_key
from omni_operator.sandbox.kubelet.node import SimNode

Obj = dict[str, Any]
PULL_BACKOFF_S = 1.0
"""The first delay between pull attempts of a missing image (a kubelet's is 10 s)."""
PULL_BACKOFF_MAX_S = 8.0
log = logging.getLogger("omni.sandbox")


def image_ref(image: str) -> str:
    """A reference as a container runtime resolves it: ``busybox`` ->
    ``docker.io/library/busybox:latest``; a host with a dot, a port or ``localhost`` is a
    registry; no tag or digest means ``latest``."""
    first, _, rest = image.partition("/")
    if not rest or ("." not in first and ":" not in first and first != "localhost"):
        image = "docker.io/" + (image if rest else "library/" + image)
    last = image.rsplit("/", 1)[-1]
    return image if ("@" in last or ":" in last) else image + ":latest"


@dataclass(frozen=True)
class ImageConfig:
    """What an image runs when a container names no ``command`` (its Dockerfile's)."""

    entrypoint: tuple[str, ...]
    cmd: tuple[str, ...] = ()


@dataclass(frozen=True)
class Registry:
    """The images the sandbox's nodes can pull (``omni sandbox up --image``)."""

    images: frozenset[str]
    pull_s: float = 0.0
    """How long a node takes to pull one of them that it does not hold yet."""
    configs: Mapping[str, ImageConfig] = field(default_factory=dict)
    """Image reference -> its ``ENTRYPOINT`` and ``CMD``, for images a container runs without
    a ``command`` (the sandbox runs their local equivalents: the same console scripts)."""

    @classmethod
    def of(
        cls,
        images: Iterable[str],
        *,
        pull_s: float = 0.0,
        configs: Mapping[str, ImageConfig] | None = None,
    ) -> Registry:
        refs = {image_ref(i): c for i, c in (configs or {}).items()}
        return cls(frozenset(image_ref(i) for i in images), pull_s, refs)

    def config(self, image: str) -> ImageConfig | None:
        return self.configs.get(image_ref(image))

    def has(self, image: str) -> bool:
        return image_ref(image) in self.images

    def not_found(self, image: str) -> str:
        """containerd's words for a reference the registry does not hold."""
        ref = image_ref(image)
        return (
            f'rpc error: code = NotFound desc = failed to pull and unpack image "{ref}": '
            f'failed to resolve reference "{ref}": {ref}: not found'
        )


@dataclass
class Pull:
    """A pod whose image pulls fail: attempts so far, when the next may run, what was said."""

    failures: int = 0
    next_try: float = 0.0
    reported: str = ""


@dataclass
class ImagePuller:
    """The nodes' image pulls from :attr:`registry`, and the pods waiting on them."""

    client: ApiClient
    registry: Registry | None = None
    """Images the nodes can pull; None: every image, at once."""
    pulls: dict[str, Pull] = field(default_factory=dict)
    """Pods (``<namespace>/<name>``) waiting on a pull that failed or is under way."""

    def config(self, image: str) -> ImageConfig | None:
        """The image's ENTRYPOINT and CMD, when the registry knows them."""
        return self.registry.config(image) if self.registry else None

    def forget(self, live: set[str]) -> None:
        """Drop the pulls of pods that are gone."""
        for key in [k for k in self.pulls if k not in live]:
            del self.pulls[key]

    async def pulled(self, pod: Obj, sim: SimNode) -> bool:
        """Whether the pod's images are on its node; else report the pull under way, or the
        failed pull or its back-off."""
        key = pod_key(pod)
        containers = pod["spec"].get("containers") or []
        missing = [
            c for c in containers if self.registry and not self.registry.has(c.get("image", ""))
        ]
        if not missing:
            cached = await self._cached(pod, sim, containers)
            if cached:
                self.pulls.pop(key, None)
            return cached
        assert self.registry is not None
        (c, *_) = missing
        pull = self.pulls.setdefault(key, Pull())
        now = asyncio.get_running_loop().time()
        error = self.registry.not_found(c["image"])
        if now >= pull.next_try:  # a pull attempt: it fails
            pull.failures += 1
            delay = min(PULL_BACKOFF_S * 2 ** (pull.failures - 1), PULL_BACKOFF_MAX_S)
            pull.next_try = now + delay
            reason, message = "ErrImagePull", error
        else:
            reason, message = "ImagePullBackOff", f'Back-off pulling image "{c["image"]}": {error}'
        if pull.reported != f"{reason}/{pull.failures}":
            pull.reported = f"{reason}/{pull.failures}"
            await self.client.report_waiting(pod, c["name"], c.get("image", ""), reason, message)
            if pull.failures == 1 and reason == "ErrImagePull":
                log.warning(f"sandbox: {key}: image {c['image']} is not in the registry")
        return False

    async def _cached(self, pod: Obj, sim: SimNode, containers: list[Obj]) -> bool:
        """Whether the node holds the pod's images; the first pod that needs one starts its
        pull (``Registry.pull_s``), every pod of the node waits in ``ContainerCreating``."""
        if self.registry is None or self.registry.pull_s <= 0:
            return True
        now = asyncio.get_running_loop().time()
        pulling = []
        for c in containers:
            ref = image_ref(c.get("image", ""))
            if now < sim.pulled.setdefault(ref, now + self.registry.pull_s):
                pulling.append(c)
        if not pulling:
            return True
        key, (c, *_) = pod_key(pod), pulling
        pull = self.pulls.setdefault(key, Pull())
        if pull.reported != "Pulling":
            pull.reported = "Pulling"
            message = f'Pulling image "{c["image"]}" on {sim.name}'
            await self.client.report_waiting(
                pod, c["name"], c.get("image", ""), "ContainerCreating", message
            )
        return False
