"""Rules for the filesystem paths a manifest names (torch-free: the operator validates with it).

A path in a manifest becomes a directory the trainer writes or a volume the kubelet mounts on a
node. ``..`` would leave the directory the reader sees (``/mnt/ckpt/../../etc``), and a few
directories belong to the system or the kubelet: writing a checkpoint there, or mounting a
node's ``/`` or ``/var/lib/kubelet`` into a pod, is never what a job means.
"""

from __future__ import annotations

import posixpath

SYSTEM_DIRS = (
    "/bin",
    "/boot",
    "/dev",
    "/etc",
    "/lib",
    "/lib32",
    "/lib64",
    "/proc",
    "/run",
    "/sbin",
    "/sys",
    "/usr",
    "/var/lib/containerd",
    "/var/lib/docker",
    "/var/lib/kubelet",
    "/var/log",
    "/var/run",
)
"""The system's and the node agents' directories (and everything under them)."""


def parent_step(path: str) -> bool:
    """Whether ``path`` has a ``..`` component (it may leave the directory it names)."""
    return ".." in path.replace("\\", "/").split("/")


def under(path: str, prefix: str) -> bool:
    """Whether ``path`` is ``prefix`` or inside it, component by component (``/mnt`` holds
    ``/mnt/x``, not ``/mntx``)."""
    path, prefix = posixpath.normpath(path), posixpath.normpath(prefix)
    return path == prefix or path.startswith(prefix.rstrip("/") + "/")


def system_dir(path: str) -> str | None:
    """The system directory ``path`` is or lies in (``/`` itself counts), or None."""
    if posixpath.normpath(path) == "/":
        return "/"
    return next((d for d in SYSTEM_DIRS if under(path, d)), None)


def path_problem(path: str, *, local: bool = True) -> str | None:
    """Why ``path`` cannot be a directory a job writes, or None: a ``..`` component, or (for
    ``local`` paths, not URLs) the root or a system directory."""
    if parent_step(path):
        return f"{path!r} has a '..' component; name the directory without it"
    if local and path.startswith("/") and (where := system_dir(path)) is not None:
        what = "the root directory" if where == "/" else f"the system directory {where}"
        return f"{path!r} is {what}; use a directory of its own (e.g. under a volume's mount)"
    return None
