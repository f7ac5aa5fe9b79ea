"""EncoderAnchor: encoder micro-batches run inside megatron's LLM pipeline, where the table says.

megatron-core's schedules are used as released. The anchor hooks in from outside:

- ``run_slot(i)`` is called by the trainer's forward-step function before the i-th forward op of
  this stage (plus ``PRE`` before the schedule and ``POST`` in finalize). It runs the encoder
  backward and forward work that the :class:`DataflowTable` puts there, encoding with LSSP across
  this stage's group (short samples data parallel, long ones Ulysses sequence parallel), and sends
  each projected output piece, non-blocking, to the tensor-parallel ranks of pipeline stage 0:
  with sequence parallelism each rank gets only the rows of its sequence shard
  (``multiplex.reshard``), without it every rank gets the whole piece.
- ``embeddings(m)`` is called on stage 0 for micro-batch m's first chunk: it receives the pieces,
  makes them autograd leaves and returns them per modality. Gradient hooks on those leaves send
  the embedding gradients back to the rank that encoded each piece once stage 0's backward of m
  has produced them all (with sequence parallelism each rank its rows; without, one rank per
  piece); that rank runs the encoder backward at its next backward slot.

Encoder traffic travels on four process groups of its own
(:meth:`~omni_trainer.mcore.parallel.AnchorGroups.channel`): one per direction (outputs, gradients)
and per way round a pair (lower to higher global rank, higher to lower), as megatron's unbatched
pipeline P2P puts a pair's two ways on two groups. NCCL runs a pair communicator's unbatched ops in
issue order and a send may wait for its receive, so the two ends of a pair must issue mirrored
sequences: on a one-way channel that only needs both ends to issue the same messages in the same
order, which they do (ascending encoder micro-batch, then piece), although one end sends at its
encoder slot and the other receives at its LLM forward or backward. Every message also has a tag,
which gloo matches by.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from omni_trainer.balance.lssp import LSSPPlan, TokenRange, plan_lssp
from omni_trainer.components.precision import encoder_autocast
from omni_trainer.components.timing import ActivationMeter, PhaseTimer
from omni_trainer.distributed import comm
from omni_trainer.mcore.parallel import BACKWARD, FORWARD, AnchorGroups
from omni_trainer.models.batch import MediaRows
from omni_trainer.models.freeze import is_frozen
from omni_trainer.models.ulysses import encode_sequence_parallel
from omni_trainer.multiplex.dataflow.table import POST, PRE, DataflowTable, EncoderMicroBatch
from omni_trainer.multiplex.reshard import Part, plan_parts


def _tag(emb: int, piece: int, direction: int) -> int:
    return ((emb * 4096 + piece) << 1) | direction


@dataclass
class EncoderWork:
    """One encoder micro-batch: the media of one modality of one LLM micro-batch."""

    mb: EncoderMicroBatch
    arrays: list[torch.Tensor]
    plan: LSSPPlan
    pieces: list[TokenRange] = field(init=False)  # consumption order: item, then token range
    items: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.pieces, self.items = [], []
        for item, ranges in enumerate(self.plan.placement):
            for r in ranges:
                if r.stop > r.start:
                    self.pieces.append(r)
                    self.items.append(item)


class EncoderAnchor:
    """Runs one rank's share of the encoder work of a training step."""

    def __init__(
        self,
        *,
        encoders: nn.ModuleDict,
        projectors: nn.ModuleDict,
        groups: AnchorGroups,
        hidden_size: int,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
        timer: PhaseTimer | None = None,
        sequence_shard: int | None = None,
    ) -> None:
        """``sequence_shard``: positions per stage-0 TP rank under sequence parallelism (each
        rank then receives only its rows); None: every stage-0 TP rank takes whole pieces."""
        self.sequence_shard = sequence_shard
        self.timer = timer or PhaseTimer()
        self.memory = ActivationMeter()
        self.encoders = encoders
        self.projectors = projectors
        self.groups = groups
        self.hidden_size = hidden_size
        self.device = device
        self.dtype = dtype  # the LLM's: encoders compute in it under autocast, and send it
        self._reset()

    # -- step lifecycle ----------------------------------------------------------------------
    def begin_step(
        self,
        table: DataflowTable,
        works: list[EncoderWork],
        positions: Sequence[dict[str, np.ndarray]] = (),
    ) -> None:
        """``positions``: per LLM micro-batch, each modality's media token positions in the
        packed row (``models.batch.media_positions``); needed with ``sequence_shard``."""
        self._reset()
        self.table = table
        self.works = {w.mb.id: w for w in works}
        self._by_microbatch: dict[int, list[int]] = {}
        for w in works:
            self._by_microbatch.setdefault(w.mb.microbatch, []).append(w.mb.id)
        if self.sequence_shard is not None:
            for m, embs in self._by_microbatch.items():
                pieces = [
                    ((emb, idx), self.works[emb].mb.modality, piece.stop - piece.start)
                    for emb in embs
                    for idx, piece in enumerate(self.works[emb].pieces)
                ]
                self._parts |= plan_parts(pieces, positions[m], shard=self.sequence_shard)

    def end_step(self) -> None:
        """Run the POST slot, then wait for every outstanding send of this step."""
        self.run_slot(POST)
        for work in self._sends:
            work.wait()
        leftovers = [k for k, v in self._held.items() if v] + list(self._local_grads)
        if leftovers or self._local_outputs:
            raise RuntimeError(f"encoder work left at the end of the step: {leftovers}")
        self._sends = []

    def _reset(self) -> None:
        self.table: DataflowTable | None = None
        self.works: dict[int, EncoderWork] = {}
        self._sends: list[dist.Work] = []
        self._held: dict[int, list[tuple[int | None, int, torch.Tensor, bool]]] = {}
        self._local_outputs: dict[tuple[int, int], torch.Tensor] = {}
        self._local_grads: dict[tuple[int, int], torch.Tensor] = {}
        self._pending_grads: dict[int, dict[tuple[int, int], torch.Tensor]] = {}
        self._parts: dict[tuple[int, int], list[Part]] = {}

    def _parts_of(self, emb: int, idx: int) -> list[Part]:
        """Where piece ``idx`` of ``emb`` goes on stage 0: with sequence parallelism the rows
        each TP rank keeps; without, the whole piece to every TP rank."""
        if self.sequence_shard is not None:
            return self._parts[(emb, idx)]
        piece = self.works[emb].pieces[idx]
        return [Part(t, 0, piece.stop - piece.start, 0) for t in range(self.groups.tp)]

    def _grad_parts(self, emb: int, idx: int) -> list[Part]:
        """Who returns the piece's gradient: each part's rank (sequence parallel), or one of
        the identical whole copies (by piece, to spread the traffic)."""
        parts = self._parts_of(emb, idx)
        return parts if self.sequence_shard is not None else [parts[idx % self.groups.tp]]

    # -- encoder side ------------------------------------------------------------------------
    def run_slot(self, index: int) -> None:
        """Encoder backward then forward work that the table puts at this slot of this stage."""
        stage = self.groups.stage
        for emb in self.table.at(stage, index, "backward"):
            self._backward(emb)
        for emb in self.table.at(stage, index, "forward"):
            self._forward(emb)

    def _forward(self, emb: int) -> None:
        work = self.works[emb]
        encoder = self.encoders[work.mb.modality]
        projector = self.projectors[work.mb.modality]
        with (
            self.timer.span("encoder"),
            self.memory.recording(emb),
            encoder_autocast(self.dtype, self.device),
        ):
            outputs = self._encode(work, encoder, projector)
        self._route(emb, work, outputs)

    def _encode(
        self, work: EncoderWork, encoder: nn.Module, projector: nn.Module
    ) -> dict[tuple[int, int], torch.Tensor]:
        """This rank's outputs of one encoder micro-batch, keyed (item, first token)."""
        me = self.groups.tp_rank
        outputs: dict[tuple[int, int], torch.Tensor] = {}
        short = work.plan.short[me]
        # A frozen encoder keeps no graph: no activations held, no backward through it.
        grad_mode = torch.no_grad() if is_frozen(encoder) else contextlib.nullcontext()
        if short:
            with grad_mode:
                features = encoder([work.arrays[i] for i in short])
            encoded = projector(features)
            for i, out in zip(
                short, encoded.split([work.plan.lengths[i] for i in short]), strict=True
            ):
                outputs[(i, 0)] = out
        for i in work.plan.long:
            with grad_mode:
                shard = encode_sequence_parallel(encoder, work.arrays[i], self.groups.sp_group)
            outputs[(i, work.plan.placement[i][me].start)] = projector(shard)
        return outputs

    def _route(
        self, emb: int, work: EncoderWork, outputs: dict[tuple[int, int], torch.Tensor]
    ) -> None:
        """Keep this rank's outputs for the backward and send them to every stage-0 TP rank."""
        me = self.groups.tp_rank
        # (piece index or None, item, output, long?); an empty shard of a long sample has no
        # piece but still joins its group's backward collectives.
        held: list[tuple[int | None, int, torch.Tensor, bool]] = []
        for i in work.plan.long:
            mine = work.plan.placement[i][me]
            if mine.stop == mine.start:
                held.append((None, i, outputs[(i, mine.start)], True))
        for idx, piece in enumerate(work.pieces):
            if piece.rank != me:
                continue
            item = work.items[idx]
            out = outputs[(item, piece.start)]
            held.append((idx, item, out, item in work.plan.long))
            payload = out.detach().to(self.dtype).contiguous()
            for part in self._parts_of(emb, idx):
                dst = self.groups.stage_ranks[0][part.tp_rank]
                rows = payload[part.lo : part.hi]
                if dst == self.groups.rank:
                    self._local_outputs[(emb, idx)] = rows
                else:
                    self._sends.append(
                        comm.isend(
                            rows,
                            dst=dst,
                            group=self.groups.channel(FORWARD, self.groups.rank, dst),
                            tag=_tag(emb, idx, FORWARD),
                        )
                    )
        self._held[emb] = held

    def _backward(self, emb: int) -> None:
        held = self._held.pop(emb, [])
        if not held:
            self.memory.release(emb)
            return
        grads: list[list[torch.Tensor]] = []  # per held output: its gradient's rows, in order
        requests = []
        for idx, _, out, _ in held:
            if idx is None:
                grads.append([torch.zeros_like(out)])
                continue
            parts = []
            for part in self._grad_parts(emb, idx):
                src = self.groups.stage_ranks[0][part.tp_rank]
                if src == self.groups.rank:
                    parts.append(self._local_grads.pop((emb, idx)))
                    continue
                buf = out.new_empty((part.hi - part.lo, *out.shape[1:]), dtype=self.dtype)
                group = self.groups.channel(BACKWARD, src, self.groups.rank)
                requests.append(comm.irecv(buf, src=src, group=group, tag=_tag(emb, idx, BACKWARD)))
                parts.append(buf)
            grads.append(parts)
        with self.timer.span("encoder_wait"):
            for r in requests:
                r.wait()
        with self.timer.span("encoder"):
            _encoder_backward(held, [g[0] if len(g) == 1 else torch.cat(g) for g in grads])
        self.memory.release(emb)

    # -- stage-0 side ------------------------------------------------------------------------
    def embeddings(self, microbatch: int) -> dict[str, MediaRows]:
        """Receive micro-batch ``microbatch``'s encoder outputs: [tokens, hidden] per modality,
        items in order, as autograd leaves whose gradients flow back to their encoders; with
        sequence parallelism only the rows of this rank's shard, with their positions in it."""
        received: dict[str, list[torch.Tensor]] = {}
        where: dict[str, list[torch.Tensor]] = {}
        requests = []
        leaves: list[tuple[int, int, torch.Tensor]] = []
        for emb in self._by_microbatch.get(microbatch, []):
            work = self.works[emb]
            stage = self.table.forward[emb].stage
            received.setdefault(work.mb.modality, [])
            for idx, piece in enumerate(work.pieces):
                mine = [p for p in self._parts_of(emb, idx) if p.tp_rank == self.groups.tp_rank]
                if not mine:  # sequence parallel: none of its rows are in this shard
                    continue
                part = mine[0]
                src = self.groups.stage_ranks[stage][piece.rank]
                if src == self.groups.rank:
                    buf = self._local_outputs.pop((emb, idx))
                else:
                    buf = torch.empty(
                        part.hi - part.lo, self.hidden_size, device=self.device, dtype=self.dtype
                    )
                    group = self.groups.channel(FORWARD, src, self.groups.rank)
                    requests.append(
                        comm.irecv(buf, src=src, group=group, tag=_tag(emb, idx, FORWARD))
                    )
                leaf = buf.detach().requires_grad_()
                leaves.append((emb, idx, leaf))
                received.setdefault(work.mb.modality, []).append(leaf)
                if self.sequence_shard is not None:
                    at = torch.arange(part.at, part.at + part.hi - part.lo, device=self.device)
                    where.setdefault(work.mb.modality, []).append(at)
        with self.timer.span("encoder_wait"):
            for r in requests:
                r.wait()
        expected = len(leaves)
        self._pending_grads[microbatch] = {}
        for emb, idx, leaf in leaves:
            leaf.register_hook(self._grad_hook(microbatch, emb, idx, expected))
        for m, rows in received.items():
            if not rows:  # sequence parallel: none of its rows are in this shard
                # An empty leaf keeps this rank's graph like its TP peers': with a frozen LLM
                # the backward (and its TP collectives) runs only where the input needs it.
                rows.append(
                    torch.empty(
                        0, self.hidden_size, device=self.device, dtype=self.dtype
                    ).requires_grad_()
                )
                where[m] = [torch.empty(0, dtype=torch.long, device=self.device)]
        return {
            m: MediaRows(torch.cat(p), torch.cat(where[m]) if m in where else None)
            for m, p in received.items()
        }

    def _grad_hook(
        self, microbatch: int, emb: int, idx: int, expected: int
    ) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            pending = self._pending_grads[microbatch]
            pending[(emb, idx)] = grad.detach()
            if len(pending) == expected:
                self._send_grads(self._pending_grads.pop(microbatch))

        return hook

    def _send_grads(self, grads: dict[tuple[int, int], torch.Tensor]) -> None:
        """Return a micro-batch's embedding gradients, in (encoder mb, piece) order."""
        me = self.groups.tp_rank
        for (emb, idx), grad in sorted(grads.items()):
            work = self.works[emb]
            if all(part.tp_rank != me for part in self._grad_parts(emb, idx)):
                continue
            stage = self.table.forward[emb].stage
            dst = self.groups.stage_ranks[stage][work.pieces[idx].rank]
            if dst == self.groups.rank:
                self._local_grads[(emb, idx)] = grad
            else:
                self._sends.append(
                    comm.isend(
                        grad.contiguous(),
                        dst=dst,
                        group=self.groups.channel(BACKWARD, self.groups.rank, dst),
                        tag=_tag(emb, idx, BACKWARD),
                    )
                )


def _encoder_backward(held: list, grads: list[torch.Tensor]) -> None:
    """Encoder backward of one micro-batch's outputs held by this rank (gradients arrive in the
    LLM's dtype, outputs are in the encoder's compute dtype)."""
    # Short samples share one graph; each long one has its own, with collectives inside, so
    # they run one by one in the same order on every rank of the group.
    # Outputs of a frozen encoder + projector have no graph: their gradients end here.
    kept = [(h, g) for h, g in zip(held, grads, strict=True) if h[2].requires_grad]
    held, grads = [h for h, _ in kept], [g for _, g in kept]
    short = [(o, g) for (_, _, o, is_long), g in zip(held, grads, strict=True) if not is_long]
    if short:
        torch.autograd.backward([o for o, _ in short], [g.to(o.dtype) for o, g in short])
    long = sorted(
        (
            (item, out, grad)
            for (_, item, out, is_long), grad in zip(held, grads, strict=True)
            if is_long
        ),
        key=lambda t: t[0],
    )
    for _, out, grad in long:
        torch.autograd.backward(out, grad.to(out.dtype))


def build_works(
    encoder_mbs: list[EncoderMicroBatch],
    arrays: dict[int, list[torch.Tensor]],
    lengths: dict[int, list[int]],
    *,
    eta: int,
    group_size: int,
    cost: Callable[[str, int], float],
) -> list[EncoderWork]:
    """The LSSP plan of every encoder micro-batch (identical on every rank of the replica)."""
    return [
        EncoderWork(
            mb=mb,
            arrays=arrays[mb.id],
            plan=plan_lssp(
                lengths[mb.id],
                eta=eta,
                group_size=group_size,
                cost=lambda n, m=mb.modality: cost(m, n),
            ),
        )
        for mb in encoder_mbs
    ]


__all__ = ["PRE", "EncoderAnchor", "EncoderWork", "build_works"]
