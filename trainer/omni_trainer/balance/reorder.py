"""Decentralized grouped reordering: one group's plan from its all-gathered sample metadata.

The paper's recipe (its technique 7): ranks are split into small network-local groups;
inside a group every rank all-gathers the metadata of the samples it drew for the step (id,
length, modality, bytes), every rank computes the *same* Karmarkar-Karp plan from it (pure and
deterministic, so no rank has to broadcast a decision), and one all-to-all moves the samples.
No central loader and no global all-to-all: cost and traffic grow with the group, not the job.

This module is the pure middle step; the collectives live with the data loader.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from omni_trainer.balance.cost import EncoderCost
from omni_trainer.balance.partition import (
    Partition,
    greedy_lpt,
    improve_by_swaps,
    karmarkar_karp,
)

Method = Literal["kk", "lpt", "none"]
CostFn = Callable[["ItemMeta"], float]


@dataclass(frozen=True)
class ItemMeta:
    """What one rank tells its group about one sample: enough to plan, nothing to train on."""

    sample_id: str
    """Stable id, for logs and checks (the plan refers to items by position)."""
    length: int
    """Tokens the cost model is evaluated at (encoder tokens for encoder balancing)."""
    modality: str
    """Selects the cost model (``image``, ``audio``, ``text``...)."""
    nbytes: int = 0
    """Bytes the all-to-all moves if the sample changes rank (token ids + media references)."""


@dataclass(frozen=True)
class ReorderPlan:
    """Where every sample of one group goes, and what that costs in traffic.

    Ranks are positions inside the group (0 .. k-1), not global ranks.
    """

    assignments: tuple[tuple[tuple[int, int], ...], ...]
    """Per destination rank, its items as ``(source rank, index on the source)``, sorted: the
    order in which an all-to-all delivers them (by source, each source in its own order)."""
    send_bytes: tuple[tuple[int, ...], ...]
    """``send_bytes[src][dst]``: bytes ``src`` sends to ``dst``; the diagonal is 0 (kept items
    move nothing). The all-to-all's split sizes."""
    loads: tuple[float, ...]
    """Cost on each destination rank after the move."""
    loads_before: tuple[float, ...]
    """Cost on each rank as the data came, for logging the gain."""

    @property
    def bytes_moved(self) -> int:
        """Bytes crossing the network for this group and step."""
        return sum(map(sum, self.send_bytes))

    @property
    def max_over_mean(self) -> float:
        """Balance after the move (1.0 is perfect)."""
        total = sum(self.loads)
        return max(self.loads) * len(self.loads) / total if total > 0 else 1.0

    def sends(self, src: int) -> tuple[tuple[int, ...], ...]:
        """For rank ``src``: per destination, the local indices to send, in order.

        The entry for ``src`` itself lists the items it keeps.
        """
        out: list[list[int]] = [[] for _ in self.assignments]
        for dst, items in enumerate(self.assignments):
            out[dst] = [index for source, index in items if source == src]
        return tuple(tuple(x) for x in out)


def modality_cost(costs: Mapping[str, EncoderCost]) -> CostFn:
    """A cost function that looks up the item's modality; unknown modalities cost nothing.

    For encoder balancing: a text sample has no encoder, so it adds no encoder load (it still
    counts towards equal cardinality).
    """

    def cost(item: ItemMeta) -> float:
        model = costs.get(item.modality)
        return model(item.length) if model is not None else 0.0

    return cost


def plan_reorder(
    group_items: Sequence[Sequence[ItemMeta]],
    *,
    cost: CostFn | Mapping[str, EncoderCost],
    k: int | None = None,
    equal_cardinality: bool,
    method: Method = "kk",
    refine: bool = True,
    min_gain: float = 0.0,
) -> ReorderPlan:
    """Plan one group's reordering for one step; every rank of the group gets the same answer.

    Args:
        group_items: per rank of the group (in group order), the metadata of its samples, as the
            metadata all-gather delivers it.
        cost: per-item cost, or per-modality cost models (see :func:`modality_cost`).
        k: destination ranks; defaults to (and must equal) ``len(group_items)``, since every
            rank of a group both sends and receives.
        equal_cardinality: every rank ends with the same number of samples (+-1), so micro-batch
            counts and memory stay even across data-parallel ranks.
        method: ``kk`` (Karmarkar-Karp), ``lpt`` (greedy) or ``none`` (keep the data in place).
        refine: follow the planner with :func:`~omni_trainer.balance.partition.improve_by_swaps`
            (needed for the balanced KK with few samples per rank; cheap otherwise).
        min_gain: keep the data in place unless the plan lowers the max rank load by more than
            this fraction; at 0, a plan no better than the arrival split moves nothing. (With
            ``equal_cardinality`` and uneven arrival counts the data always moves.)

    Returns:
        The plan. Parts are mapped to ranks by overlap (bytes, then item count already on the
        rank; greedy, then pairwise exchanges), so samples stay home where balance allows it.
    """
    ranks = len(group_items)
    if k is None:
        k = ranks
    if k != ranks or k < 1:
        raise ValueError(
            f"k ({k}) must equal the number of ranks in the group ({ranks}), at least 1: "
            "every rank of a reorder group is both a source and a destination"
        )
    cost_fn = modality_cost(cost) if isinstance(cost, Mapping) else cost
    flat = [(src, index) for src, items in enumerate(group_items) for index in range(len(items))]
    metas = [group_items[src][index] for src, index in flat]
    weights = [float(cost_fn(m)) for m in metas]
    source_of = [src for src, _ in flat]

    before = _arrival_split(group_items, weights)
    sizes = sorted(len(items) for items in group_items)
    partition = _partition(
        weights, before, sizes, k=k, method=method, equal_cardinality=equal_cardinality,
        refine=refine, min_gain=min_gain,
    )  # fmt: skip
    rank_of_part = _assign_parts(partition, source_of, [m.nbytes for m in metas], k)

    assignments: list[list[tuple[int, int]]] = [[] for _ in range(k)]
    loads = [0.0] * k
    send = [[0] * k for _ in range(k)]
    for p, part in enumerate(partition.parts):
        dst = rank_of_part[p]
        loads[dst] = partition.loads[p]
        for i in part:
            assignments[dst].append(flat[i])
            if source_of[i] != dst:
                send[source_of[i]][dst] += metas[i].nbytes
    return ReorderPlan(
        assignments=tuple(tuple(sorted(a)) for a in assignments),
        send_bytes=tuple(tuple(row) for row in send),
        loads=tuple(loads),
        loads_before=before.loads,
    )


def _partition(
    weights: Sequence[float],
    before: Partition,
    sizes: Sequence[int],
    *,
    k: int,
    method: Method,
    equal_cardinality: bool,
    refine: bool,
    min_gain: float,
) -> Partition:
    """The items' split into ``k`` parts by ``method`` (see :func:`plan_reorder`), or the arrival
    split ``before`` where it is allowed and the plan does not gain ``min_gain``; ``sizes``: the
    arrival counts, sorted."""
    if method == "none":
        if equal_cardinality and sizes[-1] - sizes[0] > 1:
            raise ValueError(
                f"method 'none' keeps the arrival counts {sizes}, which are not equal; "
                "use kk or lpt, or equal_cardinality=False"
            )
        partition = before
    elif method == "kk":
        partition = karmarkar_karp(weights, k, equal_cardinality=equal_cardinality)
    elif method == "lpt":
        partition = greedy_lpt(weights, k, equal_cardinality=equal_cardinality)
    else:
        raise ValueError(f"method must be 'kk', 'lpt' or 'none', got {method!r}")
    if refine and method != "none":
        partition = improve_by_swaps(weights, partition)
    arrival_allowed = not equal_cardinality or sizes[-1] - sizes[0] <= 1
    if arrival_allowed and partition.max_load >= before.max_load * (1.0 - min_gain):
        partition = before  # not worth the traffic
    return partition


def _arrival_split(
    group_items: Sequence[Sequence[ItemMeta]], weights: Sequence[float]
) -> Partition:
    """The arrival split as a :class:`Partition` over the flattened items (rank by rank)."""
    parts: list[tuple[int, ...]] = []
    start = 0
    for items in group_items:
        parts.append(tuple(range(start, start + len(items))))
        start += len(items)
    return Partition(
        parts=tuple(parts), loads=tuple(math.fsum(weights[i] for i in p) for p in parts)
    )


def _assign_parts(
    partition: Partition, source_of: Sequence[int], nbytes: Sequence[int], k: int
) -> list[int]:
    """Part -> rank, keeping as many bytes (then items) at home as a cheap search finds.

    Greedy by overlap (the largest part-on-rank share first), then pairwise exchanges of two
    parts' ranks while one raises the kept total. A maximum-weight matching would be optimal;
    this is O(k^2) per pass, deterministic, and keeps almost everything that can stay.
    """
    overlap: dict[tuple[int, int], tuple[int, int]] = {}
    for p, part in enumerate(partition.parts):
        for i in part:
            b, c = overlap.get((p, source_of[i]), (0, 0))
            overlap[(p, source_of[i])] = (b + nbytes[i], c + 1)
    pairs = sorted(overlap.items(), key=lambda kv: (-kv[1][0], -kv[1][1], kv[0]))
    rank_of_part = [-1] * k
    taken = [False] * k
    for (p, r), _ in pairs:
        if rank_of_part[p] < 0 and not taken[r]:
            rank_of_part[p] = r
            taken[r] = True
    free = iter(r for r in range(k) if not taken[r])
    for p in range(k):
        if rank_of_part[p] < 0:
            rank_of_part[p] = next(free)

    def kept(p: int, r: int) -> tuple[int, int]:
        return overlap.get((p, r), (0, 0))

    # An exchange of p's and q's ranks can only help if p has items on q's rank or vice versa,
    # so candidates come from the (sparse) overlap, not from all k^2 pairs.
    homes: list[list[int]] = [[] for _ in range(k)]
    for p, r in sorted(overlap):
        homes[p].append(r)
    for _ in range(k):  # passes; each accepted exchange strictly raises the kept total
        improved = False
        part_at = {r: p for p, r in enumerate(rank_of_part)}
        for p in range(k):
            for r in homes[p]:
                q = part_at[r]
                rp, rq = rank_of_part[p], rank_of_part[q]
                if q == p:
                    continue
                if _add(kept(p, rq), kept(q, rp)) > _add(kept(p, rp), kept(q, rq)):
                    rank_of_part[p], rank_of_part[q] = rq, rp
                    part_at[rq], part_at[rp] = p, q
                    improved = True
        if not improved:
            break
    return rank_of_part


def _add(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    return (a[0] + b[0], a[1] + b[1])


def split_groups(
    size: int,
    group_size: int | None = None,
    *,
    groups: Sequence[Sequence[int]] | None = None,
) -> tuple[tuple[int, ...], ...]:
    """Reorder groups over ``size`` data-parallel ranks: contiguous blocks, or given explicitly.

    Contiguous blocks are network-local when ranks are numbered node by node; the operator can
    hand in its own topology-aware groups instead (``groups``), which are validated here.

    Args:
        size: data-parallel ranks (or world size) to cover.
        group_size: ranks per group; must divide ``size``. Exclusive with ``groups``.
        groups: explicit groups of rank ids; together they must cover ``range(size)`` once.

    Returns:
        Groups as sorted tuples of rank ids, ordered by their lowest rank.
    """
    if (group_size is None) == (groups is None):
        raise ValueError("give exactly one of group_size or groups")
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    if group_size is not None:
        if group_size < 1 or size % group_size:
            raise ValueError(
                f"group_size ({group_size}) must be >= 1 and divide the {size} ranks; "
                f"divisors: {[d for d in range(1, size + 1) if size % d == 0]}"
            )
        return tuple(tuple(range(s, s + group_size)) for s in range(0, size, group_size))
    assert groups is not None
    out = sorted(tuple(sorted(g)) for g in groups)
    seen = [r for g in out for r in g]
    if any(not g for g in out):
        raise ValueError("reorder groups must not be empty")
    if sorted(seen) != list(range(size)):
        missing = sorted(set(range(size)) - set(seen))
        dup = sorted({r for r in seen if seen.count(r) > 1})
        extra = sorted(r for r in set(seen) if not 0 <= r < size)
        raise ValueError(
            f"reorder groups must cover ranks 0..{size - 1} exactly once; "
            f"missing {missing}, duplicated {dup}, out of range {extra}"
        )
    return tuple(out)


def group_of(rank: int, groups: Sequence[Sequence[int]]) -> tuple[int, int]:
    """``(group index, position inside the group)`` of a rank: its place in the plan."""
    for g, members in enumerate(groups):
        if rank in members:
            return g, list(members).index(rank)
    raise ValueError(f"rank {rank} is in no reorder group")
