"""Placement: which nodes a job runs on and which node rank each gets (a pure function).

Rank layout (megatron's default order tp-cp-dp-pp, pipeline slowest): node rank ``r`` runs global
ranks ``[r * g, (r + 1) * g)``, so a tensor/encoder-SP group (``tp`` consecutive ranks, ``tp``
dividing ``g``) is always inside one node, and pipeline stage ``s`` occupies the node ranks
``[s * N / pp, (s + 1) * N / pp)`` (whole nodes; validated by the spec).

Reorder groups are the consecutive blocks of ``reorderGroupSize`` node ranks; the trainer gets its
group from ``OMNI_REORDER_GROUP``. Every group is placed inside one network domain (its nodes
share the values of all ``topology.networkDomainLabels``). Domains are chosen hierarchically
(best fit at the finest level that can hold everything, so jobs do not spread), and groups are
ordered so that the groups forming one pipeline (same slot in consecutive stages) come from
neighbouring domains, keeping pipeline traffic close too.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from omni_operator.capacity import default_requests, resources, shortfall
from omni_operator.spec import OmniTrainingJobSpec, Toleration

Node = Mapping[str, Any]
Domain = tuple[str, ...]


class PlacementError(Exception):
    """The job cannot be placed now; the message says why, per domain and per node."""


@dataclass(frozen=True)
class PlacedNode:
    name: str
    rank: int
    stages: tuple[int, ...]
    """Pipeline stages whose ranks run on this node."""
    reorder_group: int
    domain: Domain
    allocatable: Mapping[str, str] = field(default_factory=dict)
    """The Node's ``status.allocatable`` (default CPU/memory requests are derived from it)."""


@dataclass(frozen=True)
class Placement:
    nodes: tuple[PlacedNode, ...]
    """By node rank."""
    domain_labels: tuple[str, ...]
    skipped: Mapping[str, str] = field(default_factory=dict)
    """Nodes left out, with the reason."""

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.nodes]

    def explain(self) -> str:
        """Human-readable: one line per reorder group, then the nodes that were skipped."""
        lines = []
        groups: dict[int, list[PlacedNode]] = {}
        for n in self.nodes:
            groups.setdefault(n.reorder_group, []).append(n)
        for gid, members in groups.items():
            stages = sorted({s for m in members for s in m.stages})
            ranks = f"{members[0].rank}-{members[-1].rank}" if len(members) > 1 else members[0].rank
            lines.append(
                f"reorder group {gid} (node ranks {ranks}, pipeline stage"
                f"{'s' if len(stages) > 1 else ''} {','.join(map(str, stages))}) in "
                f"{_domain_str(self.domain_labels, members[0].domain)}: "
                + " ".join(m.name for m in members)
            )
        if self.skipped:
            lines.append("skipped: " + "; ".join(f"{k} {v}" for k, v in _by_name(self.skipped)))
        return "\n".join(lines)


def place(
    nodes: Iterable[Node],
    spec: OmniTrainingJobSpec,
    *,
    quarantined: Iterable[str] = (),
    free: Mapping[str, Mapping[str, float]] | None = None,
) -> Placement:
    """Choose ``spec.nodes`` nodes and their ranks, or raise :class:`PlacementError` explaining
    per domain how many usable nodes there are and why the others are not usable.

    Args:
        nodes: Node objects as dicts (``kubectl get nodes -o yaml`` items).
        spec: the validated job spec.
        quarantined: node names the operator must avoid (repeated failures).
        free: each node's free capacity (:func:`omni_operator.capacity.free`); a node that
            cannot hold the job's pod beside what runs there is not usable. None: the nodes'
            allocatable (whether the job could ever fit).

    Returns:
        The placement, deterministic for the same inputs (in any order).
    """
    labels = tuple(spec.topology.network_domain_labels)
    nodes = list(nodes)
    allocatable = {
        n["metadata"]["name"]: dict((n.get("status") or {}).get("allocatable") or {}) for n in nodes
    }
    scan = usable_nodes(nodes, spec, quarantined=quarantined, free=free)
    usable, skipped, domain_of = scan.usable, scan.skipped, scan.domain_of

    G = spec.group_size
    need = spec.nodes // G
    capacity = {d: len(names) // G for d, names in usable.items()}
    chosen = _choose(capacity, need, level=0, prefix=())
    if chosen is None:
        raise PlacementError(
            _why_not(spec, labels, capacity, usable, skipped, domain_of, fit=sum(capacity.values()))
        )

    # chosen: one domain per group, in domain order; take nodes from each domain in name order.
    taken: dict[Domain, int] = {}
    groups: list[tuple[Domain, list[str]]] = []
    for d in chosen:
        start = taken.get(d, 0)
        groups.append((d, usable[d][start : start + G]))
        taken[d] = start + G
    return Placement(_number(groups, spec, allocatable), labels, skipped)


def _number(
    groups: list[tuple[Domain, list[str]]],
    spec: OmniTrainingJobSpec,
    allocatable: Mapping[str, Mapping[str, str]],
) -> tuple[PlacedNode, ...]:
    """Node ranks for reorder groups in domain order: pipeline neighbours first
    (:func:`_order_for_pipeline`), then rank by rank through each group."""
    pp = spec.trainer.parallelism.pipeline
    placed: list[PlacedNode] = []
    for gid, (d, names) in enumerate(_order_for_pipeline(groups, spec)):
        for name in names:
            rank = len(placed)
            placed.append(
                PlacedNode(
                    name=name,
                    rank=rank,
                    stages=_stages_of(rank, spec.nodes, pp),
                    reorder_group=gid,
                    domain=d,
                    allocatable=dict(allocatable.get(name, {})),
                )
            )
    return tuple(placed)


def rank_bound(nodes: Sequence[Node], spec: OmniTrainingJobSpec) -> Placement:
    """Node ranks for pods a scheduler bound (``scheduling.placement: scheduler``), one pod per
    node of ``nodes``: the nodes sorted by network domain, then name, cut into reorder groups
    of consecutive ranks, which the pipeline order then arranges as :func:`place` does. Each
    group lands in one domain when the scheduler kept the pods' constraints (every domain then
    holds whole groups), and neighbouring ranks stay close.

    Args:
        nodes: the Node objects the job's pods are bound to (``spec.nodes`` of them).
        spec: the validated job spec.

    Returns:
        The placement, deterministic for the same nodes in any order.
    """
    labels = tuple(spec.topology.network_domain_labels)
    domain = {n["metadata"]["name"]: node_domain(n, labels) or () for n in nodes}
    names = sorted(domain, key=lambda n: (tuple(map(_natural, domain[n])), _natural(n)))
    G = spec.group_size
    groups = [(domain[names[i]], names[i : i + G]) for i in range(0, len(names), G)]
    allocatable = {
        n["metadata"]["name"]: dict((n.get("status") or {}).get("allocatable") or {}) for n in nodes
    }
    return Placement(_number(groups, spec, allocatable), labels)


@dataclass(frozen=True)
class Scan:
    """The nodes that could host a pod of the job, by network domain, and why the others not."""

    usable: dict[Domain, list[str]]
    skipped: dict[str, str]
    domain_of: dict[str, Domain]


def usable_nodes(
    nodes: Iterable[Node],
    spec: OmniTrainingJobSpec,
    *,
    quarantined: Iterable[str] = (),
    free: Mapping[str, Mapping[str, float]] | None = None,
) -> Scan:
    """Usable nodes per domain in name order (``free``: as :func:`place`)."""
    labels = tuple(spec.topology.network_domain_labels)
    avoid = set(quarantined)
    usable: dict[Domain, list[str]] = {}
    skipped: dict[str, str] = {}
    domain_of: dict[str, Domain] = {}
    for node in sorted(nodes, key=lambda n: _natural(n["metadata"]["name"])):
        name = node["metadata"]["name"]
        node_labels = node["metadata"].get("labels") or {}
        missing = [k for k in labels if k not in node_labels]
        if missing:
            skipped[name] = f"no label {', '.join(missing)}"
            continue
        domain = tuple(node_labels[k] for k in labels)
        domain_of[name] = domain
        reason = _unusable(node, spec, avoid)
        if reason is None and free is not None:
            reason = _busy(node, spec, free.get(name, {}))
        if reason:
            skipped[name] = reason
        else:
            usable.setdefault(domain, []).append(name)
    return Scan(usable, skipped, domain_of)


def node_requests(spec: OmniTrainingJobSpec, allocatable: Mapping[str, str]) -> dict[str, str]:
    """The requests of the job's pod on a node with ``allocatable``: its GPUs and RDMA devices,
    ``resources.cpu``/``memory`` or else the default share of the node
    (:func:`omni_operator.capacity.default_requests`)."""
    res = spec.resources
    out: dict[str, str] = {}
    if spec.gpus_per_node:
        out[res.gpu_resource_name] = str(spec.gpus_per_node)
    if res.rdma is not None:
        out[res.rdma.resource_name] = str(res.rdma.count)
    if res.cpu is not None:
        out["cpu"] = str(res.cpu)
    if res.memory is not None:
        out["memory"] = str(res.memory)
    for key, value in default_requests(allocatable).items():
        out.setdefault(key, value)  # never BestEffort: the first evicted under pressure
    return out


def _busy(node: Node, spec: OmniTrainingJobSpec, free: Mapping[str, float]) -> str | None:
    """What the job's pod would lack on ``node`` beside the pods already there, or None."""
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    short = shortfall(resources(node_requests(spec, allocatable)), free)
    return f"busy ({short})" if short else None


def _choose(
    capacity: Mapping[Domain, int], need: int, *, level: int, prefix: Domain
) -> list[Domain] | None:
    """Domains for ``need`` groups, keeping them under the longest common label prefix that can
    hold them all; within a level, one child if one fits (the smallest that fits), else the
    largest children first. Returns one domain per group, or None if they do not fit."""
    below = {d: c for d, c in capacity.items() if d[:level] == prefix and c > 0}
    if sum(below.values()) < need:
        return None
    if not below or level == len(next(iter(below))):
        return [prefix] * need if need else []
    children: dict[str, int] = {}
    for d, c in below.items():
        children[d[level]] = children.get(d[level], 0) + c
    fitting = sorted((c, _natural(v), v) for v, c in children.items() if c >= need)
    if fitting:
        value = fitting[0][2]
        return _choose(capacity, need, level=level + 1, prefix=(*prefix, value))
    out: list[Domain] = []
    for value, cap in sorted(children.items(), key=lambda kv: (-kv[1], _natural(kv[0]))):
        take = min(cap, need - len(out))
        sub = _choose(capacity, take, level=level + 1, prefix=(*prefix, value))
        assert sub is not None  # take <= the child's capacity
        out += sub
        if len(out) == need:
            break
    return sorted(out, key=lambda d: tuple(_natural(v) for v in d))


def _order_for_pipeline(
    groups: list[tuple[Domain, list[str]]], spec: OmniTrainingJobSpec
) -> list[tuple[Domain, list[str]]]:
    """Reorder groups so that the groups holding one pipeline (slot k of every stage) are
    consecutive in domain order: group position ``s * slots + k`` gets chosen group
    ``k * pp + s``. Identity when a group spans whole stages, or all share one domain."""
    pp, N, G = spec.trainer.parallelism.pipeline, spec.nodes, spec.group_size
    if pp == 1 or N % pp or G % (N // pp) == 0 or len({d for d, _ in groups}) == 1:
        return groups
    slots = (N // pp) // G  # groups per stage
    return [groups[k * pp + s] for s in range(pp) for k in range(slots)]


def _stages_of(rank: int, nodes: int, pp: int) -> tuple[int, ...]:
    if nodes >= pp:
        return (rank // (nodes // pp),)
    per_node = pp // nodes
    return tuple(range(rank * per_node, (rank + 1) * per_node))


def _unusable(node: Node, spec: OmniTrainingJobSpec, quarantined: set[str]) -> str | None:
    """Why this node cannot host a pod of the job, or None."""
    name = node["metadata"]["name"]
    if name in quarantined:
        return "quarantined"
    status = node.get("status") or {}
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    if ready is None or ready.get("status") != "True":
        return "NotReady" if ready else "no Ready condition"
    node_spec = node.get("spec") or {}
    if node_spec.get("unschedulable"):
        return "cordoned"
    for taint in node_spec.get("taints") or []:
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not _tolerated(
            taint, spec.scheduling.tolerations
        ):
            value = f"={taint['value']}" if taint.get("value") else ""
            return f"taint {taint.get('key')}{value}:{taint['effect']} not tolerated"
    node_labels = node["metadata"].get("labels") or {}
    for key, value in spec.scheduling.node_selector.items():
        if node_labels.get(key) != value:
            return f"nodeSelector {key}={value} does not match"
    allocatable = status.get("allocatable") or {}
    res = spec.resources
    if spec.gpus_per_node:
        have = _count(allocatable.get(res.gpu_resource_name))
        if have < spec.gpus_per_node:
            return f"{have} of {spec.gpus_per_node} {res.gpu_resource_name} allocatable"
    if res.rdma is not None:
        have = _count(allocatable.get(res.rdma.resource_name))
        if have < res.rdma.count:
            return f"{have} of {res.rdma.count} {res.rdma.resource_name} allocatable"
    return None


def _tolerated(taint: Mapping[str, Any], tolerations: Sequence[Toleration]) -> bool:
    for t in tolerations:
        if t.effect is not None and t.effect != taint.get("effect"):
            continue
        if t.operator == "Exists" and (t.key is None or t.key == taint.get("key")):
            return True
        if (
            t.operator == "Equal"
            and t.key == taint.get("key")
            and ((t.value or "") == (taint.get("value") or ""))
        ):
            return True
    return False


def _count(quantity: Any) -> int:
    """Extended resources are integers; a malformed value counts as none."""
    try:
        return int(str(quantity))
    except ValueError:
        return 0


def _why_not(
    spec: OmniTrainingJobSpec,
    labels: tuple[str, ...],
    capacity: Mapping[Domain, int],
    usable: Mapping[Domain, list[str]],
    skipped: Mapping[str, str],
    domain_of: Mapping[str, Domain],
    *,
    fit: int,
) -> str:
    G, N = spec.group_size, spec.nodes
    need = N // G
    what = f"{spec.gpus_per_node} GPUs" if spec.gpus_per_node else "CPU only"
    if labels:
        head = (
            f"cannot place {N} nodes ({what} each): {need} reorder group"
            f"{'s' if need > 1 else ''} of {G} nodes, each inside one network domain "
            f"({', '.join(labels)}); {fit} fit"
        )
    else:
        head = f"cannot place {N} nodes ({what} each): {sum(map(len, usable.values()))} usable"
    lines = [head]
    domains = sorted(
        set(usable) | {domain_of[n] for n in skipped if n in domain_of},
        key=lambda d: tuple(_natural(v) for v in d),
    )
    for d in domains:
        bad = [f"{n} {r}" for n, r in _by_name(skipped) if domain_of.get(n) == d]
        n_ok = len(usable.get(d, []))
        line = f"  {_domain_str(labels, d)}: {n_ok} usable"
        if labels:
            line += f", fits {capacity.get(d, 0)} group{'s' if capacity.get(d, 0) != 1 else ''}"
        lines.append(line + (f" ({'; '.join(bad)})" if bad else ""))
    unlabelled = [f"{n} {r}" for n, r in _by_name(skipped) if n not in domain_of]
    if unlabelled:
        lines.append(f"  outside any domain: {'; '.join(unlabelled)}")
    if not domains and not unlabelled:
        lines.append("  the cluster has no nodes")
    return "\n".join(lines)


def _by_name(reasons: Mapping[str, str]) -> list[tuple[str, str]]:
    return sorted(reasons.items(), key=lambda kv: _natural(kv[0]))


def _domain_str(labels: Sequence[str], domain: Domain) -> str:
    if not labels:
        return "the cluster"
    return ",".join(f"{k.rsplit('/', 1)[-1]}={v}" for k, v in zip(labels, domain, strict=True))


def _natural(s: str) -> tuple[Any, ...]:
    """Sort key where n2 < n10; ties broken by the raw string so the key is injective."""
    parts = re.split(r"(\d+)", s)
    return (*((0, int(p), "") if p.isdigit() else (1, 0, p) for p in parts), s)


def node_domain(node: Node | None, labels: Sequence[str]) -> Domain | None:
    """The node's network domain (its values of ``labels``); None when it lacks one of them
    or is unknown (gone from the API)."""
    if node is None:
        return None
    node_labels = node["metadata"].get("labels") or {}
    if any(k not in node_labels for k in labels):
        return None
    return tuple(node_labels[k] for k in labels)


def place_rank(spec: OmniTrainingJobSpec, rank: int, node: Node) -> PlacedNode:
    """Node rank ``rank`` of :func:`place`'s layout on ``node`` (a spare taking the rank over):
    the same stages and reorder group, the new node's name, domain and allocatable."""
    labels = tuple(spec.topology.network_domain_labels)
    return PlacedNode(
        name=node["metadata"]["name"],
        rank=rank,
        stages=_stages_of(rank, spec.nodes, spec.trainer.parallelism.pipeline),
        reorder_group=rank // spec.group_size,  # place() numbers ranks group by group
        domain=node_domain(node, labels) or (),
        allocatable=dict((node.get("status") or {}).get("allocatable") or {}),
    )


def place_spares(
    nodes: Iterable[Node],
    spec: OmniTrainingJobSpec,
    *,
    want: int,
    domains: Iterable[Domain],
    taken: Iterable[str] = (),
    quarantined: Iterable[str] = (),
) -> list[Node]:
    """Up to ``want`` usable nodes for hot spares, inside the job's network ``domains`` (a
    spare takes over a rank of its own domain, keeping reorder groups network-local), none of
    ``taken`` (the job's and the other spares' nodes); the domains with the fewest spares
    first, then by name, so spares spread over the domains the job runs in."""
    labels = tuple(spec.topology.network_domain_labels)
    avoid, skip = set(quarantined), set(taken)
    count: dict[Domain, int] = {d: 0 for d in domains}
    free: dict[Domain, list[Node]] = {d: [] for d in count}
    for node in sorted(nodes, key=lambda n: _natural(n["metadata"]["name"])):
        domain = node_domain(node, labels)
        if node["metadata"]["name"] in skip or domain not in free:
            continue
        if _unusable(node, spec, avoid) is None:
            free[domain].append(node)
    chosen: list[Node] = []
    while len(chosen) < want:
        open_ = [d for d in free if free[d]]
        if not open_:
            break
        d = min(open_, key=lambda d: (count[d], tuple(map(_natural, d))))
        chosen.append(free[d].pop(0))
        count[d] += 1
    return chosen
