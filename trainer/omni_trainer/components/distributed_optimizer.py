"""ZeRO-1 for the LLM (``parallelism.distributedOptimizer``): main weights and optimizer state
sharded over the data-parallel ranks, megatron's distributed-optimizer layout.

Why our own rather than megatron-core's ``DistributedDataParallel`` + ``DistributedOptimizer``:
the step keeps one torch AdamW over the LLM shards and the encoders (LR multipliers per module,
ZeRO-2 encoders, frozen parameters), one gradient norm clipped jointly over LLM and encoders,
and the per-parameter checkpoint format (``checkpoint/state.py``) that loads in any layout;
megatron's optimizer would bring its own parameter groups, clipping and checkpoint layout (a
second format beside the one every other layout, export and ``initFrom`` read), and on CPU it
runs only through a patch of ``device="cuda"`` in several modules, so the equivalence tests would
exercise the patch rather than the GPU code path.

Layout (as megatron's): the trainable LLM parameters are laid end to end in one fp32 gradient
buffer, cut into buckets (each padded to a multiple of the group size); rank r of the group owns
the r-th equal slice of every bucket. After the backward each bucket is reduce-scattered, so a
rank holds the summed gradient of its slices only; AdamW keeps state for those slices only
(fp32 *main* slices of bf16 weights, or views of fp32 weights); after the step every bucket's
updated slices are all-gathered into the model weights. Adam is elementwise, so the update is
the unsharded one: only memory and communication change.

Overlap (``parallelism.overlapGradReduce``, megatron DDP's ``overlap_grad_reduce``): during the
step's last micro-batch backward a bucket's reduce-scatter starts as soon as each of its
parameters has accumulated its last gradient, so the sync runs behind the rest of the backward.
Buckets are laid out in forward order, so the backward fills the last one first; they are
started strictly from the last bucket to the first on every rank (a ready bucket waits for the
one after it), since NCCL and gloo pair collectives by the order ranks issue them and
readiness may differ between ranks (a parameter without a gradient in a micro-batch). As in
megatron, the partial sums over other groups (sequence parallel norms over TP, tied embeddings
over the first and last stage) are added after the reduce-scatter: sums commute, and the
slices line up across those groups (TP ranks have equal shapes; a tied weight takes a bucket
of its own, so both stages own the same rows of it).

Checkpoints stay per parameter (one logical tensor per name, loadable in any layout), but each
rank saves and loads only its own ranges (:meth:`DistributedMainParams.checkpoint_view`,
``checkpoint/flat_shards.py``): no rank materialises whole fp32 weights or Adam moments; after
a load the model weights are all-gathered bucket by bucket, as after a step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from omni_trainer.checkpoint.flat_shards import FlatShard
from omni_trainer.components.precision import CheckpointView, copy_sharding_attrs
from omni_trainer.distributed import comm

BUCKET_ALIGN = 16  # elements: every rank's slice of a bucket starts 64-byte aligned (fp32)


@dataclass(frozen=True)
class Bucket:
    """A range ``[start, start + size)`` of the flat buffer holding ``members`` (param indices)."""

    start: int
    size: int
    members: tuple[int, ...]


@dataclass(frozen=True)
class Piece:
    """The part ``[lo, hi)`` of parameter ``index`` (flattened) this rank owns, at ``at`` in its
    slice of ``bucket``."""

    bucket: int
    index: int
    lo: int
    hi: int
    at: int


def plan_buckets(
    numels: list[int], *, shards: int, bucket_numel: int, alone: frozenset[int] = frozenset()
) -> tuple[list[int], list[Bucket]]:
    """Flat offsets of each parameter and the buckets: parameters in order, a bucket closed once
    it holds ``bucket_numel`` elements, padded to a multiple of ``shards`` x ``BUCKET_ALIGN``.
    The parameters in ``alone`` (indices) each take a bucket of their own."""
    offsets: list[int] = []
    buckets: list[Bucket] = []
    start, members, filled = 0, [], 0
    align = shards * BUCKET_ALIGN

    def close() -> None:
        nonlocal start, members, filled
        size = -(-filled // align) * align
        buckets.append(Bucket(start, size, tuple(members)))
        start, members, filled = start + size, [], 0

    for i, n in enumerate(numels):
        if i in alone and members:
            close()
        offsets.append(start + filled)
        members.append(i)
        filled += n
        if filled >= bucket_numel or i in alone or i == len(numels) - 1:
            close()
    return offsets, buckets


def plan_pieces(
    numels: list[int], offsets: list[int], buckets: list[Bucket], *, shards: int, rank: int
) -> list[Piece]:
    """What ``rank`` owns: per bucket, the parameters its slice overlaps, and where."""
    pieces = []
    for b, bucket in enumerate(buckets):
        width = bucket.size // shards
        lo_flat = bucket.start + rank * width
        hi_flat = lo_flat + width
        for i in bucket.members:
            lo, hi = max(lo_flat, offsets[i]), min(hi_flat, offsets[i] + numels[i])
            if lo < hi:
                pieces.append(Piece(b, i, lo - offsets[i], hi - offsets[i], lo - lo_flat))
    return pieces


class DistributedMainParams:
    """The LLM's gradient buffer, this rank's main slices and the three collectives of a step.

    The interface is :class:`omni_trainer.components.precision.MainParams`'s (the unsharded
    case): the trainer uses either.
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        *,
        group: dist.ProcessGroup,
        bucket_numel: int,
        overlap: bool = False,
        alone: frozenset[int] = frozenset(),
        reduce_dtype: torch.dtype = torch.float32,
    ) -> None:
        """``overlap``: reduce-scatter each bucket behind the last backward; ``alone``: ids of
        parameters that take a bucket of their own (tied embedding copies); ``reduce_dtype``:
        what the buckets travel in (the sums land in the fp32 buffer)."""
        self.model_params = params
        self.reduce_dtype = reduce_dtype
        self.group = group
        self.shards = comm.size(group)
        self.rank = dist.get_rank(group) if self.shards > 1 else 0
        self.numels = [p.numel() for p in params]
        self.offsets, self.buckets = plan_buckets(
            self.numels,
            shards=self.shards,
            bucket_numel=bucket_numel,
            alone=frozenset(i for i, p in enumerate(params) if id(p) in alone),
        )
        device = params[0].device if params else torch.device("cpu")
        total = self.buckets[-1].start + self.buckets[-1].size if self.buckets else 0
        self.grad_buffer = torch.zeros(total, dtype=torch.float32, device=device)
        self._grads = [
            self.grad_buffer[o : o + p.numel()].view_as(p)
            for p, o in zip(params, self.offsets, strict=True)
        ]
        self._overlap = _BucketOverlap(self) if overlap and self.shards > 1 else None
        for i, (p, g) in enumerate(zip(params, self._grads, strict=True)):
            p.register_post_accumulate_grad_hook(_accumulate_into(g, i, self._overlap))
        self._index = {id(p): i for i, p in enumerate(params)}
        self.pieces = plan_pieces(
            self.numels, self.offsets, self.buckets, shards=self.shards, rank=self.rank
        )
        self.main: list[nn.Parameter] = [self._main_slice(piece) for piece in self.pieces]
        self._origin = {
            id(m): params[pc.index] for m, pc in zip(self.main, self.pieces, strict=True)
        }
        if self.shards > 1:
            ranks = dist.get_process_group_ranks(group)
            self._peer = ranks[(self.rank + 1) % self.shards]  # where checkpoints place the rest
        else:
            self._peer = dist.get_rank() if dist.is_initialized() else 0

    def _main_slice(self, piece: Piece) -> nn.Parameter:
        """fp32 main slice: a view of an fp32 weight (updated in place), a copy of a bf16 one."""
        p = self.model_params[piece.index]
        flat = p.detach().view(-1)[piece.lo : piece.hi]
        main = nn.Parameter(flat if p.dtype == torch.float32 else flat.float())
        copy_sharding_attrs(p, main)
        start = self.offsets[piece.index]
        main.grad = self.grad_buffer[start + piece.lo : start + piece.hi]
        return main

    # -- the step -----------------------------------------------------------------------------
    @property
    def norm_group(self) -> dist.ProcessGroup | None:
        """Where the squares of :attr:`main`'s gradients are summed into the global norm."""
        return self.group if self.shards > 1 else None

    def origin_of(self, main: nn.Parameter) -> nn.Parameter:
        """The model parameter a main slice belongs to (its LR group, weight decay)."""
        return self._origin[id(main)]

    def grad_of(self, param: nn.Parameter) -> torch.Tensor | None:
        """This rank's fp32 gradient of ``param`` (whole until :meth:`reduce_gradients`)."""
        i = self._index.get(id(param))
        return None if i is None else self._grads[i]

    def zero_grad(self) -> None:
        self.grad_buffer.zero_()

    def expect_backwards(self, micro_batches: int) -> None:
        """Arm the overlap for a step of ``micro_batches`` backwards (no-op without it)."""
        if self._overlap is not None:
            self._overlap.arm(micro_batches)

    @property
    def buckets_overlapped(self) -> int:
        """Buckets whose reduce-scatter the last step started during its backward."""
        return self._overlap.early if self._overlap is not None else 0

    def bucket_view(self, b: int) -> torch.Tensor:
        bucket = self.buckets[b]
        return self.grad_buffer[bucket.start : bucket.start + bucket.size]

    def wire_view(self, b: int) -> torch.Tensor:
        """Bucket ``b`` as it travels: the fp32 buffer itself, or a ``reduce_dtype`` copy."""
        return self.bucket_view(b).to(self.reduce_dtype)

    def reduce_gradients(self) -> None:
        """Bucket by bucket, the group's summed gradient of this rank's slices (reduce-scatter):
        the ones the overlap started are waited for, the rest run now."""
        if self.shards == 1:
            return
        if self._overlap is not None:
            reduced = self._overlap.finish()
        else:
            reduced = [
                comm.reduce_scatter(self.wire_view(b), group=self.group)
                for b in range(len(self.buckets))
            ]
        for b, mine in enumerate(reduced):
            full = self.bucket_view(b)
            full[self.rank * mine.numel() : (self.rank + 1) * mine.numel()].copy_(mine)

    @torch.no_grad()
    def step_done(self) -> None:
        """The updated main slices into the model weights everywhere (bucketed all-gather)."""
        for b, bucket in enumerate(self.buckets):
            dtype = self.model_params[bucket.members[0]].dtype
            full = comm.all_gather_flat(self._local_slice(b, self.main, dtype), group=self.group)
            for i in bucket.members:
                at = self.offsets[i] - bucket.start
                self.model_params[i].view(-1).copy_(full[at : at + self.numels[i]])
            del full  # one bucket in flight: freed before the next one's buffer

    def _local_slice(self, b: int, values: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """This rank's slice of bucket ``b`` filled from per-piece ``values`` (padding zero)."""
        out = torch.zeros(self.buckets[b].size // self.shards, dtype=dtype, device=self.device)
        for piece, v in zip(self.pieces, values, strict=True):
            if piece.bucket == b:
                out[piece.at : piece.at + piece.hi - piece.lo].copy_(v)
        return out

    @property
    def device(self) -> torch.device:
        return self.grad_buffer.device

    def bytes(self) -> dict[str, int]:
        """Bytes of model weights, fp32 main slices (bf16 only: fp32 ones are views) and the
        gradient buffer."""
        model = sum(p.numel() * p.element_size() for p in self.model_params)
        copies = sum(
            m.numel() * m.element_size()
            for m, pc in zip(self.main, self.pieces, strict=True)
            if self.model_params[pc.index].dtype != torch.float32
        )
        return {
            "params_bytes": model + copies,
            "grads_bytes": self.grad_buffer.numel() * self.grad_buffer.element_size(),
        }

    # -- whole tensors: checkpoints and tests (collectives over the group) ---------------------
    def _gather(self, values: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
        """Per parameter, the whole tensor assembled from every rank's per-piece ``values``."""
        out: list[torch.Tensor] = [torch.empty(0)] * len(self.model_params)
        for b, bucket in enumerate(self.buckets):
            full = comm.all_gather_flat(self._local_slice(b, values, dtype), group=self.group)
            for i in bucket.members:
                at = self.offsets[i] - bucket.start
                out[i] = full[at : at + self.numels[i]].view_as(self.model_params[i]).clone()
        return out

    def full_grads(self) -> dict[int, torch.Tensor]:
        """id(model param) -> its whole reduced (and clipped) gradient, after a step."""
        grads = self._gather([m.grad for m in self.main], torch.float32)
        return {id(p): g for p, g in zip(self.model_params, grads, strict=True)}

    def checkpoint_view(self, optimizer: torch.optim.Optimizer) -> CheckpointView:
        """This rank's ranges of the main weights (and their state in ``optimizer``) per
        parameter; a load fills them, then the model weights are gathered bucket by bucket."""
        mine = {pc.index: (pc, m) for pc, m in zip(self.pieces, self.main, strict=True)}
        flat = {}
        for i, p in enumerate(self.model_params):
            piece, main = mine.get(i, (None, None))
            flat[id(p)] = FlatShard(
                lo=piece.lo if piece else 0,
                hi=piece.hi if piece else 0,
                main=main,
                peer=self._peer,
            )
        return CheckpointView(full={}, optimizer=optimizer, loaded=self.step_done, flat=flat)

    def full_state(self, optimizer: torch.optim.Optimizer) -> dict[int, dict[str, torch.Tensor]]:
        """id(model param) -> its whole fp32 main weight (``param``) and optimizer slots,
        gathered over the group (tests compare layouts with it; checkpoints never gather)."""
        out: dict[int, dict[str, torch.Tensor]] = {}
        for p, t in zip(self.model_params, self._gather(self.main, torch.float32), strict=True):
            out[id(p)] = {"param": t}
        mine = [optimizer.state.get(m) for m in self.main]
        local = next((s for s in mine if s), {})
        everyone = comm.all_gather_object(
            {k: (v.ndim, float(v) if v.ndim == 0 else None) for k, v in local.items()},
            group=self.group,
        )
        for key, (ndim, scalar) in sorted({k: v for e in everyone for k, v in e.items()}.items()):
            if ndim == 0:
                for entry in out.values():
                    entry[key] = torch.tensor(scalar, dtype=torch.float32)
                continue
            values = [
                s[key] if s else torch.zeros_like(m) for s, m in zip(mine, self.main, strict=True)
            ]
            for p, v in zip(self.model_params, self._gather(values, torch.float32), strict=True):
                out[id(p)][key] = v
        return out


class _BucketOverlap:
    """Which buckets' gradients are final in this step, and their reduce-scatters under way.

    A parameter's gradient is final once it has accumulated ``arm``'s count of micro-batch
    gradients; a bucket is ready once all its parameters are; ready buckets start from the last
    bucket down (the same order on every rank)."""

    def __init__(self, params: DistributedMainParams) -> None:
        self.params = params
        self.bucket_of = {i: b for b, bk in enumerate(params.buckets) for i in bk.members}
        self.expected = 0
        self.seen: list[int] = []
        self.waiting: list[int] = []  # per bucket: parameters whose gradient is not final yet
        self.pending: dict[int, comm.PendingReduceScatter] = {}
        self.next = -1  # the bucket to start next (counting down)
        self.late: list[int] = []
        self.early = 0  # buckets the last step started during its backward

    def arm(self, micro_batches: int) -> None:
        self.expected = micro_batches
        self.seen = [0] * len(self.params.model_params)
        self.waiting = [len(bk.members) for bk in self.params.buckets]
        self.pending, self.late = {}, []
        self.next = len(self.params.buckets) - 1

    def arrived(self, i: int) -> None:
        """Parameter ``i`` accumulated one more micro-batch gradient."""
        if not self.expected:
            return
        self.seen[i] += 1
        if self.seen[i] > self.expected:
            self.late.append(i)
        elif self.seen[i] == self.expected:
            self.waiting[self.bucket_of[i]] -= 1
            while self.next >= 0 and self.waiting[self.next] == 0:
                self._start(self.next)

    def _start(self, b: int) -> None:
        self.pending[b] = comm.reduce_scatter_start(
            self.params.wire_view(b), group=self.params.group
        )
        self.next = b - 1

    def finish(self) -> list[torch.Tensor]:
        """Every bucket's reduced slice: the rest started (same order), then all waited for."""
        if not self.expected:  # not armed (e.g. a test's own backward): start them all now
            self.arm(1)
        self.early = len(self.pending)
        while self.next >= 0:
            self._start(self.next)
        reduced = [self.pending[b].wait() for b in range(len(self.params.buckets))]
        late, self.expected = self.late, 0
        if late:
            names = ", ".join(str(tuple(self.params.model_params[i].shape)) for i in late[:3])
            raise RuntimeError(
                f"{len(late)} LLM gradient(s) arrived after their bucket's reduce-scatter had "
                f"started (parameter shapes {names}): a parameter took more backwards than the "
                "step has micro-batches; set parallelism.overlapGradReduce: false"
            )
        return reduced


def _accumulate_into(main_grad: torch.Tensor, i: int, overlap: _BucketOverlap | None):
    """Autograd hook: the micro-batch gradient into the fp32 buffer (fp32 accumulation); with
    the overlap, the bucket of a final gradient may start its reduce-scatter."""

    def hook(p: nn.Parameter) -> None:
        main_grad.add_(p.grad)
        p.grad = None
        if overlap is not None:
            overlap.arrived(i)

    return hook
