"""Where a failed container's end came from: the infrastructure, a node, or the trainer itself.

Resiliency tooling (NVIDIA's among it) separates the two sides because they call for opposite
answers. A container killed or lost from outside (the kubelet lost its state after a restart,
the node shut down, something sent SIGKILL) says nothing about the job: it is restarted at any
step, within the restart budget, even before the first step while a large model still loads.
A trainer that ended with its own error before its first step is a configuration or code error.
Only failures a node can be blamed for (lost or NotReady, device, NCCL or InfiniBand errors, a
straggler, a failed network preflight) count towards its quarantine; a crash of the trainer's
own code never does.
"""

from __future__ import annotations

import re

EXIT_SIGKILL = 137
"""128 + SIGKILL: the container's main process was killed (the kubelet, the runtime, a node
shutdown, an operator); the kernel's OOM killer says ``OOMKilled`` instead."""

LOST_REASONS = frozenset(
    {"ContainerStatusUnknown", "NodeLost", "Shutdown", "NodeShutdown", "Terminated", "Unknown"}
)
"""Termination and pod reasons the kubelet writes for a container whose end it did not see:
its state was lost with a kubelet restart, or the node shut down under it."""

APPLICATION_REASONS = frozenset({"OOMKilled"})
"""A SIGKILL the job's own settings caused (memory limit): the job's, not the cluster's."""

DEVICE_ERROR = re.compile(
    r"uncorrectable ECC|ECC error|\bXid\b|GPU is lost|fallen off the bus|cudaErrorECCUncorrectable"
    r"|CUDA error: (?:an illegal instruction|unspecified launch failure|uncorrectable)"
    r"|NET/IB|ibv_\w+ failed|IBV_WC_\w+|mlx5\w*: |NVLink (?:error|down)|NCCL WARN .*(?:IB|RoCE)",
    re.IGNORECASE,
)
"""A device or fabric fault in a trainer's fatal error: a bad GPU, NVLink, or InfiniBand port
on the node it ran on (NCCL's ``NET/IB`` and verbs errors, Xid, ECC)."""

NODE_FAULT_REASONS = frozenset({"NodeLost", "DeviceError", "Straggler", "PreflightFailed"})
"""Failure reasons that blame their nodes: only these count towards a node's quarantine."""


def infrastructure_cause(code: int | None, reason: str, message: str = "") -> str | None:
    """Why a container's end came from outside the trainer (in words), or None when it is the
    trainer's own: a lost container state or node (any exit code), or SIGKILL not from the OOM
    killer. The trainer's own fatal error in ``message`` does not change a lost state: the
    kubelet writes none for it."""
    if reason in LOST_REASONS:
        return f"was lost ({reason}{f', exit code {code}' if code is not None else ''})"
    if code == EXIT_SIGKILL and reason not in APPLICATION_REASONS:
        return f"was killed from outside the trainer (exit code {code}, SIGKILL)"
    return None


def device_error(message: str) -> str | None:
    """The device or fabric error a trainer's fatal error names (its first line), or None."""
    m = DEVICE_ERROR.search(message)
    if m is None:
        return None
    start = message.rfind("\n", 0, m.start()) + 1
    end = message.find("\n", m.end())
    return message[start : end if end >= 0 else None].strip()


def blames_nodes(reason: str) -> bool:
    """Whether a failure with this reason counts against the nodes it names (quarantine)."""
    return reason in NODE_FAULT_REASONS
