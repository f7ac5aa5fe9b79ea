"""Which node directories a job may mount from the host: ``checkpoint.fast.path``.

The fast checkpoint tier is a hostPath volume (``DirectoryOrCreate``; created as root when
RDMA runs the pod privileged), so its path is a directory on the node itself. It must lie under
one of the prefixes the cluster's admin allows (the chart's ``operator.fastPathPrefixes``, passed to
the operator as :data:`PREFIXES_ENV`), never at ``/``, in a system or kubelet directory, or
reached through ``..``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from omni_trainer.path_rules import path_problem, under

PREFIXES_ENV = "OMNI_FAST_PATH_PREFIXES"
"""Comma-separated node directories under which ``checkpoint.fast.path`` may lie."""
DEFAULT_PREFIXES = ("/mnt", "/local", "/scratch", "/var/lib/omni", "/var/lib/omni-fast")
"""Node-local data disks by convention, and the operator's own directories."""


def allowed_prefixes(env: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The prefixes the operator's environment allows (default :data:`DEFAULT_PREFIXES`)."""
    raw = (os.environ if env is None else env).get(PREFIXES_ENV, "")
    given = tuple(p.strip() for p in raw.split(",") if p.strip())
    return given or DEFAULT_PREFIXES


def fast_path_problem(path: str, prefixes: Sequence[str]) -> str | None:
    """Why ``checkpoint.fast.path`` may not be mounted from the node, or None."""
    if (problem := path_problem(path)) is not None:
        return problem
    if not any(under(path, p) for p in prefixes):
        return (
            f"{path!r} is not under an allowed node directory ({', '.join(prefixes)}); choose "
            f"one under them, or ask the cluster's admin to add it (chart value "
            f"operator.fastPathPrefixes)"
        )
    return None
