"""Strict collectives: on CPU, fail a run that NCCL would hang or refuse but gloo forgives.

On when ``OMNI_STRICT_COLLECTIVES=1`` (the test suite sets it):
:func:`omni_trainer.mcore.parallel.init_distributed` calls :func:`install`, which wraps
``torch.distributed``'s point-to-point functions and collectives so every call is logged
(megatron-core's own pipeline P2P and gradient reductions included: they call
``torch.distributed`` directly). Off, nothing is wrapped and nothing is logged.

:func:`audit` (every rank, at the end of each step's backward) gathers the logs over gloo and
raises :class:`StrictCollectiveError` naming ranks, op index and sizes when:

- **unbatched point-to-point ops do not mirror.** NCCL runs a pair's unbatched ops in issue order
  on one stream of the group's pair communicator, and a send may wait for its receive; gloo
  buffers sends. So, per (group, pair), rank a's k-th op must meet rank b's k-th op: a send
  against a receive of the same element count. A ``batch_isend_irecv`` is one unit per peer
  (its ops run together): a's k-th unit with b must hold b's k-th unit's receives as its
  sends, in order, and the other way round. An audit rather than rendezvous semantics: it
  is deterministic (it does not depend on timing or message sizes, as NCCL's eager sends do)
  and names the first op that differs.
- **a group-wide operation is not entered by every rank of its group**: per group, every
  member must issue the same sequence of collectives (kind and element count; object and
  uneven all-to-all exchanges by kind only). A ``batch_isend_irecv`` that is the first
  operation on its group creates the group's communicator, so it too must be entered by
  every member (PyTorch leaves it undefined otherwise).
- **a point-to-point communicator is first used after the warm-up** (:func:`end_warm_up`):
  NCCL would create it lazily inside a step, where two pairs created in opposite orders on
  two ranks deadlock.

Only the main thread's calls are logged. What only a GPU can prove: that NCCL itself completes
(message sizes, streams, cross-group ordering between communicators); the audit checks the
per-pair order that NCCL's progress depends on, not the streams.
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

ENV = "OMNI_STRICT_COLLECTIVES"

# collective -> the argument whose element count every member must agree on (None: kind only)
_COLLECTIVES: dict[str, str | None] = {
    "all_reduce": "tensor",
    "all_gather": "tensor",
    "all_gather_into_tensor": "input_tensor",
    "reduce_scatter": "output",
    "reduce_scatter_tensor": "input",
    "all_to_all_single": None,
    "all_to_all": None,
    "broadcast": "tensor",
    "reduce": "tensor",
    "gather": "tensor",
    "scatter": "tensor",
    "barrier": None,
    "monitored_barrier": None,
    "all_gather_object": None,
    "broadcast_object_list": None,
    "gather_object": None,
    "scatter_object_list": None,
}
_P2P = ("isend", "irecv", "send", "recv")

Op = tuple[str, int]  # ("send" | "recv", element count)


class StrictCollectiveError(AssertionError):
    """Communication that NCCL would hang on or refuse (see the module docstring)."""


@dataclass
class _Log:
    """This process's communication since the last audit."""

    p2p: dict[tuple[str, int], list[tuple[bool, tuple[Op, ...]]]] = field(default_factory=dict)
    collectives: dict[str, list[tuple[str, int | None]]] = field(default_factory=dict)
    members: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # group -> the peers of its first use when that was a batch (None: a collective)
    first_batch: dict[str, tuple[int, ...] | None] = field(default_factory=dict)
    used: set[tuple] = field(default_factory=set)  # communicators used so far (never cleared)
    late: list[str] = field(default_factory=list)
    warm: bool = True  # inside the warm-up: first uses are expected
    audited: dict[str, int] = field(
        default_factory=lambda: {"audits": 0, "p2p": 0, "collectives": 0}
    )


_log = _Log()
_local = threading.local()
_main = threading.main_thread()
_installed: dict[tuple[Any, str], Callable] = {}


def enabled() -> bool:
    return os.environ.get(ENV) == "1"


def install() -> None:
    """Wrap torch.distributed's P2P functions and collectives (idempotent; a no-op when off).
    P2P functions are replaced in ``distributed_c10d`` too: ``P2POp`` and
    ``batch_isend_irecv`` compare an op against those."""
    if not enabled() or _installed:
        return
    for name in _P2P:
        wrapper = _wrap(getattr(c10d, name), _record_p2p(name))
        for module in (dist, c10d):
            _installed[(module, name)] = getattr(module, name)
            setattr(module, name, wrapper)
    batch = "batch_isend_irecv"
    _installed[(dist, batch)] = getattr(dist, batch)
    setattr(dist, batch, _wrap(getattr(dist, batch), _record_batch))
    for name, sized in _COLLECTIVES.items():
        original = getattr(dist, name)
        _installed[(dist, name)] = original
        setattr(dist, name, _wrap(original, _record_collective(name, sized, original)))


def audited() -> dict[str, int]:
    """What this rank's audits have checked so far: audits, P2P units, collectives."""
    return dict(_log.audited)


def begin_warm_up() -> None:
    """Communicators used for the first time from here on are expected (groups being built)."""
    _log.warm = True


def end_warm_up() -> None:
    """From here on a point-to-point communicator used for the first time is an error."""
    _log.warm = False


def _wrap(original: Callable, record: Callable[..., None]) -> Callable:
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        # Inside a batch, a collective or the audit; or on another thread (the background
        # checkpoint writer), whose progress at an audit differs from rank to rank.
        if getattr(_local, "depth", 0) or threading.current_thread() is not _main:
            return original(*args, **kwargs)
        record(*args, **kwargs)
        _local.depth = 1
        try:
            return original(*args, **kwargs)
        finally:
            _local.depth = 0

    return wrapper


def _group_name(group: dist.ProcessGroup | None) -> str:
    group = group if group is not None else c10d._get_default_group()
    name = group.group_name
    if name not in _log.members:
        _log.members[name] = tuple(dist.get_process_group_ranks(group))
    return name


def _first_use(key: tuple, what: str) -> bool:
    """Note a communicator's use; True when this is its first."""
    if key in _log.used:
        return False
    _log.used.add(key)
    if not _log.warm:
        _log.late.append(f"rank {dist.get_rank()}: {what} first used after the warm-up")
    return True


def _record_p2p(name: str) -> Callable[..., None]:
    signature = inspect.signature(getattr(c10d, name))
    peer_arg, group_peer_arg = ("dst", "group_dst") if "send" in name else ("src", "group_src")

    def record(*args, **kwargs) -> None:
        bound = signature.bind(*args, **kwargs).arguments
        group = bound.get("group")
        peer = bound.get(peer_arg)
        if peer is None:
            peer = dist.get_global_rank(group or c10d._get_default_group(), bound[group_peer_arg])
        op = ("send" if "send" in name else "recv", bound["tensor"].numel())
        _add_p2p(_group_name(group), peer, (False, (op,)))

    return record


def _add_p2p(group: str, peer: int, unit: tuple[bool, tuple[Op, ...]]) -> None:
    me = dist.get_rank()
    _log.p2p.setdefault((group, peer), []).append(unit)
    if not unit[0]:
        lo, hi = min(me, peer), max(me, peer)
        _first_use(
            ("pair", group, lo, hi), f"the communicator of pair {lo}<->{hi} of group {group}"
        )


def _record_batch(ops: list[c10d.P2POp]) -> None:
    group = _group_name(ops[0].group)
    if _first_use(("group", group), f"the communicator of group {group} (batched P2P)"):
        _log.first_batch[group] = tuple(sorted({op.peer for op in ops}))
    per_peer: dict[int, list[Op]] = {}
    for op in ops:
        kind = "send" if op.op is c10d.isend else "recv"
        per_peer.setdefault(op.peer, []).append((kind, op.tensor.numel()))
    for peer, unit in per_peer.items():
        _add_p2p(group, peer, (True, tuple(unit)))


def _record_collective(name: str, sized: str | None, original: Callable) -> Callable[..., None]:
    signature = inspect.signature(original)

    def record(*args, **kwargs) -> None:
        bound = signature.bind(*args, **kwargs).arguments
        group = _group_name(bound.get("group"))
        if ("group", group) not in _log.used:  # collectives create it wherever they run
            _log.used.add(("group", group))
            _log.first_batch[group] = None
        count = (
            bound[sized].numel() if sized and isinstance(bound.get(sized), torch.Tensor) else None
        )
        _log.collectives.setdefault(group, []).append((name, count))

    return record


# -- the audit ----------------------------------------------------------------------------------
_audit_group: list[dist.ProcessGroup | None] = []


def audit() -> None:
    """Every rank, at the same point: compare the logs since the last audit, then clear them.
    Raises :class:`StrictCollectiveError` on every rank when any rule is broken."""
    if not _installed or not dist.is_initialized():
        return
    if dist.get_world_size() == 1 or "fake" in str(dist.get_backend()):  # nothing to compare
        _log.p2p, _log.collectives, _log.first_batch, _log.late = {}, {}, {}, []
        return
    from omni_trainer.distributed import comm

    _local.depth = 1
    try:
        if not _audit_group:  # the object exchange must not touch NCCL
            gloo = dist.get_backend() == "gloo"
            _audit_group.append(None if gloo else dist.new_group(backend="gloo"))
        mine = (_log.p2p, _log.collectives, _log.members, _log.first_batch, _log.late)
        logs = comm.all_gather_object(mine, group=_audit_group[0])
    finally:
        _local.depth = 0
    _log.audited["audits"] += 1
    _log.audited["p2p"] += sum(map(len, _log.p2p.values()))
    _log.audited["collectives"] += sum(map(len, _log.collectives.values()))
    _log.p2p, _log.collectives, _log.first_batch, _log.late = {}, {}, {}, []
    problems = _mismatched_pairs(logs) + _skipped_collectives(logs) + _late(logs)
    if problems:
        raise StrictCollectiveError(
            "communication NCCL would hang on or refuse (OMNI_STRICT_COLLECTIVES):\n  "
            + "\n  ".join(problems[:20])
        )


def _mismatched_pairs(logs: list) -> list[str]:
    pairs = {(g, min(a, b), max(a, b)) for a, log in enumerate(logs) for g, b in log[0]}
    problems = []
    for group, a, b in sorted(pairs):
        problems += _pair_problems(
            group, a, logs[a][0].get((group, b), []), b, logs[b][0].get((group, a), [])
        )
    return problems


def _pair_problems(group: str, a: int, mine: list, b: int, theirs: list) -> list[str]:
    def show(unit) -> str:
        return ("batch " if unit[0] else "") + " ".join(f"{k} {n}" for k, n in unit[1])

    for k in range(max(len(mine), len(theirs))):
        ua = mine[k] if k < len(mine) else None
        ub = theirs[k] if k < len(theirs) else None
        if ua is None or ub is None or not _mirrors(ua, ub):
            return [
                f"group {group}, pair {a}<->{b}, op {k}: rank {a} "
                f"{show(ua) if ua else 'nothing'}, rank {b} {show(ub) if ub else 'nothing'}"
                f" ({len(mine)} vs {len(theirs)} ops)"
            ]
    return []


def _mirrors(ua: tuple, ub: tuple) -> bool:
    def part(unit, kind: str) -> list[int]:
        return [n for k, n in unit[1] if k == kind]

    return (
        ua[0] == ub[0]
        and part(ua, "send") == part(ub, "recv")
        and part(ua, "recv") == part(ub, "send")
    )


def _skipped_collectives(logs: list) -> list[str]:
    problems = []
    names = {g: m for log in logs for g, m in log[2].items()}
    for group, members in sorted(names.items()):
        seqs = {r: logs[r][1].get(group, []) for r in members}
        problems += _first_batch_problems(group, members, [logs[r][3] for r in members])
        ref = seqs[members[0]]
        for r in members[1:]:
            if seqs[r] != ref:
                k = next(
                    (i for i, (x, y) in enumerate(zip(ref, seqs[r], strict=False)) if x != y),
                    min(len(ref), len(seqs[r])),
                )
                got = [s[k] if k < len(s) else "nothing" for s in (ref, seqs[r])]
                problems.append(
                    f"group {group} {list(members)}: collective {k}: rank {members[0]} "
                    f"{got[0]}, rank {r} {got[1]} ({len(ref)} vs {len(seqs[r])} collectives)"
                )
    return problems


def _first_batch_problems(group: str, members: tuple[int, ...], firsts: list[dict]) -> list[str]:
    """A batch that creates its group's communicator must be one call entered by every member:
    each member's first use a batch, its peers' first batches naming it, all members linked."""
    peers = {r: f.get(group) or () for r, f in zip(members, firsts, strict=True)}
    batched = {r for r, f in zip(members, firsts, strict=True) if f.get(group) is not None}
    if not batched:
        return []
    reached, todo = set(), [min(batched)]
    while todo:
        r = todo.pop()
        if r not in reached:
            reached.add(r)
            todo += [p for p in peers[r] if r in peers.get(p, ())]
    if reached == set(members):
        return []
    return [
        f"group {group} {list(members)}: its first operation is a batch_isend_irecv that ranks "
        f"{sorted(reached)} enter together ({len(batched)} of {len(members)} ranks start with "
        "a batch); it creates the group's communicator, so every member must enter it"
    ]


def _late(logs: list) -> list[str]:
    return [line for log in logs for line in log[4]]
