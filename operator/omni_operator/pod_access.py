"""What a trainer pod reaches besides its GPUs: credentials from Secrets (``spec.envFrom``),
shared storage (``spec.volumes``: PersistentVolumeClaims for datasets, models and checkpoints)
and private registries (``spec.imagePullSecrets``). Credentials never appear in the manifest."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from omni_trainer.config_base import Spec
from omni_trainer.path_rules import parent_step

DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
SCRATCH_DIR = "/var/tmp/omni"
"""The trainer pod's writable scratch (an emptyDir; the root filesystem is read-only): TMPDIR,
caches (torch, Triton, Hugging Face) and S3 checkpoint staging."""
RESERVED_MOUNTS = ("/dev/shm", "/etc/omni", SCRATCH_DIR)
"""Mounted by the operator in every trainer pod."""
RESERVED_VOLUMES = ("dshm", "config", "scratch")


class ObjectRef(Spec):
    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)


class EnvFromSource(Spec):
    """A Secret's (or ConfigMap's) keys as the trainer's environment, e.g. a Secret with
    AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY for ``s3://`` data, models and checkpoints."""

    secret_ref: ObjectRef | None = None
    config_map_ref: ObjectRef | None = None
    prefix: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")

    @model_validator(mode="after")
    def _one_source(self) -> EnvFromSource:
        if (self.secret_ref is None) == (self.config_map_ref is None):
            raise ValueError("set exactly one of secretRef and configMapRef")
        return self


class VolumeConfig(Spec):
    """A PersistentVolumeClaim mounted at the same path in every trainer pod (local paths in
    ``spec.trainer``: sources, ``model.llm.hf``, ``checkpoint.path`` live under it), or a
    Secret's keys as files (credentials as files, e.g. for AWS_SHARED_CREDENTIALS_FILE)."""

    name: str = Field(min_length=1, max_length=63, pattern=DNS_LABEL)
    claim_name: str | None = Field(None, min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)
    secret_name: str | None = Field(None, min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)
    mount_path: str = Field(pattern=r"^/", description="absolute path in the container")
    read_only: bool = Field(False, description="true for datasets and models (Secrets always)")
    sub_path: str | None = Field(None, pattern=r"^[^/]", description="a directory of the claim")

    @model_validator(mode="after")
    def _one_source(self) -> VolumeConfig:
        if (self.claim_name is None) == (self.secret_name is None):
            raise ValueError("set exactly one of claimName and secretName")
        return self

    def render(self) -> dict[str, Any]:
        if self.secret_name is not None:
            return {"name": self.name, "secret": {"secretName": self.secret_name}}
        claim = {"claimName": self.claim_name, "readOnly": self.read_only}
        return {"name": self.name, "persistentVolumeClaim": claim}


def volume_problems(volumes: list[VolumeConfig]) -> list[tuple[int, str, str]]:
    """(index, field, message) for names or mount paths that collide with each other or with
    what the operator mounts."""
    out: list[tuple[int, str, str]] = []
    names: set[str] = set()
    paths: list[str] = []
    for i, v in enumerate(volumes):
        if v.name in RESERVED_VOLUMES or v.name in names:
            taken = "the operator's" if v.name in RESERVED_VOLUMES else "another volume's"
            out.append((i, "name", f"{v.name!r} is {taken} name; choose another"))
        names.add(v.name)
        path = v.mount_path.rstrip("/") or "/"
        for other in (*RESERVED_MOUNTS, *paths):
            if path == other or path.startswith(other + "/") or other.startswith(path + "/"):
                out.append((i, "mountPath", f"{v.mount_path} overlaps {other}; mount elsewhere"))
                break
        if path == "/":
            out.append((i, "mountPath", "/ cannot be mounted over; mount elsewhere"))
        for field, value in (("mountPath", v.mount_path), ("subPath", v.sub_path or "")):
            if parent_step(value):
                out.append((i, field, f"{value!r} has a '..' component; name the path without it"))
        paths.append(path)
    return out


def render_access(
    env_from: list[EnvFromSource], volumes: list[VolumeConfig], pull_secrets: list[str]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(container fields, pod spec fields) to merge into a trainer pod."""
    container: dict[str, Any] = {}
    pod: dict[str, Any] = {}
    if env_from:
        container["envFrom"] = [e.model_dump(by_alias=True, exclude_none=True) for e in env_from]
    if volumes:
        container["volumeMounts"] = [
            {"name": v.name, "mountPath": v.mount_path,
             "readOnly": v.read_only or v.secret_name is not None}
            | ({"subPath": v.sub_path} if v.sub_path else {})
            for v in volumes
        ]  # fmt: skip
        pod["volumes"] = [v.render() for v in volumes]
    if pull_secrets:
        pod["imagePullSecrets"] = [{"name": n} for n in pull_secrets]
    return container, pod
