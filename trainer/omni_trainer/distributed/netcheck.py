"""The network preflight: before the model is built, the gang times an all-reduce and an
all-gather over the world and each node leader times its links in a ring (rules and attribution
in :mod:`omni_trainer.distributed.netcheck_rules`). A slow or silent node ends the attempt with
:data:`EXIT_PREFLIGHT` and a termination message naming it; the operator replaces the node.

Every wait is bounded by ``timeoutSeconds``: a node that does not answer is named by its ring
neighbours, each from what it saw alone when the figures cannot be gathered any more.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Mapping

import torch

from omni_trainer.distributed import comm, strict
from omni_trainer.distributed.netcheck_rules import (
    EXIT_PREFLIGHT,
    Link,
    PreflightConfig,
    PreflightResult,
    all_gather_bus_gbps,
    all_reduce_bus_gbps,
    failure_message,
    judge,
    link_gbps,
    node_leaders,
    reference_node,
    ring_phases,
)
from omni_trainer.termination import report


def node_name() -> str:
    """This pod's node (the operator sets ``OMNI_NODE_NAME`` from ``spec.nodeName``)."""
    return os.environ.get("OMNI_NODE_NAME") or socket.gethostname()


class _Gang:
    """Who is where: node names in order, their leader ranks, this rank's node."""

    def __init__(self, names: list[str], rank: int) -> None:
        self.leaders = node_leaders(names)
        self.nodes = list(self.leaders)
        self.rank, self.node = rank, names[rank]

    def leads(self, node: str) -> bool:
        return self.leaders[node] == self.rank


def run_preflight(cfg: PreflightConfig, *, rank: int, node: str) -> PreflightResult | None:
    """The check on every rank (a collective); None when it does not apply (one node)."""
    start = time.perf_counter()
    gang = _Gang(comm.all_gather_object(node), rank)
    if not cfg.applies(len(gang.nodes)):
        return None
    try:
        groups = preflight_groups(cfg)
    except RuntimeError:  # a rank never joined: nothing can be timed, nobody can be named
        return PreflightResult(nodes={}, complete=False, seconds=time.perf_counter() - start)
    mine = _ring(gang, cfg, groups)
    try:
        result = _gathered(gang, cfg, groups, mine)
    except RuntimeError:  # a peer stopped answering: each leader names its silent neighbours
        result = _alone(gang, mine)
    else:
        strict.audit()  # OMNI_STRICT_COLLECTIVES: every rank answered, so every rank is here
    result.seconds = time.perf_counter() - start
    return result


def preflight_groups(cfg: PreflightConfig) -> tuple[comm.Group, comm.Group]:
    """Two groups over the world whose operations give up after ``timeoutSeconds`` (every rank
    creates them): collectives run on the first, a link's two ways on one each."""
    return (
        comm.new_group(timeout_s=cfg.timeout_seconds),
        comm.new_group(timeout_s=cfg.timeout_seconds),
    )


def _exchange(
    gang: _Gang, other: str, cfg: PreflightConfig, groups: tuple[comm.Group, comm.Group]
) -> float | None:
    seconds = comm.timed_exchange(
        gang.leaders[other],
        nbytes=cfg.nbytes,
        iterations=cfg.iterations,
        groups=groups,
        timeout_s=cfg.timeout_seconds,
    )
    return link_gbps(cfg.nbytes, seconds)


def _ring(
    gang: _Gang, cfg: PreflightConfig, groups: tuple[comm.Group, comm.Group]
) -> dict[Link, float | None]:
    """This leader's ring links (GB/s, None: no answer); empty on other ranks."""
    mine: dict[Link, float | None] = {}
    if not gang.leads(gang.node):
        return mine
    me = gang.nodes.index(gang.node)
    for phase in ring_phases(len(gang.nodes)):
        for a, b in phase:
            if me in (a, b):
                other = gang.nodes[b if me == a else a]
                mine[(gang.nodes[a], gang.nodes[b])] = _exchange(gang, other, cfg, groups)
    return mine


def _merged(parts: list[Mapping]) -> dict:
    """One mapping from every rank's; a link timed by both ends keeps the slower figure."""
    out: dict = {}
    for part in parts:
        for key, g in part.items():
            out[key] = g if key not in out else _slower(out[key], g)
    return out


def _slower(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else min(a, b)


def _gathered(
    gang: _Gang,
    cfg: PreflightConfig,
    groups: tuple[comm.Group, comm.Group],
    mine: dict[Link, float | None],
) -> PreflightResult:
    """The verdict every rank agrees on: world figures, ring links, suspects retimed."""
    group = groups[0]
    n = comm.size(group)
    slowest = torch.tensor(
        [
            comm.timed_collective(kind, nbytes=cfg.nbytes, iterations=cfg.iterations, group=group)
            for kind in ("all_reduce", "all_gather")
        ],
        dtype=torch.float64,
    )
    comm.all_reduce(slowest, group=group, op="max")
    links = _merged(comm.all_gather_object(mine, group=group))
    result = judge(gang.nodes, links, cfg)
    reference = reference_node(result.nodes, result.failed)
    if result.failed and result.attributed and reference is not None:
        retimed: dict[str, float | None] = {}
        for suspect in result.failed:  # one pair at a time: the reference is in every pair
            if result.nodes[suspect] is None:
                continue  # it did not answer on either link: no second chance
            if gang.leads(suspect) or gang.leads(reference):
                other = reference if gang.leads(suspect) else suspect
                retimed[suspect] = _exchange(gang, other, cfg, groups)
        result = judge(
            gang.nodes, links, cfg, retimed=_merged(comm.all_gather_object(retimed, group=group))
        )
    result.all_reduce_gbps = all_reduce_bus_gbps(cfg.nbytes, float(slowest[0]), n)
    result.all_gather_gbps = all_gather_bus_gbps(cfg.nbytes, float(slowest[1]), n)
    return result


def _alone(gang: _Gang, mine: dict[Link, float | None]) -> PreflightResult:
    """What this rank saw by itself: the neighbours that did not answer it."""
    silent = sorted({n for link, g in mine.items() if g is None for n in link} - {gang.node})
    return PreflightResult(nodes={n: None for n in silent}, failed=silent, complete=False)


def enforce(result: PreflightResult | None) -> None:
    """Say the result (rank 0's log); a failure ends this process with :data:`EXIT_PREFLIGHT`,
    its message in the pod's termination message when this rank names a node."""
    if result is None:
        return
    if result.passed:
        if int(os.environ.get("RANK", "0")) == 0:
            print(result.describe(), flush=True)
        return
    print(result.describe(), flush=True)
    if result.failed:  # a rank that names nobody leaves the message to one that does
        report(failure_message(result))
    sys.stdout.flush()
    sys.stderr.flush()
    # Out at once: tearing the process group down against peers that already left can abort
    # the process (gloo), which would turn a named slow node into an unexplained crash.
    os._exit(EXIT_PREFLIGHT)
