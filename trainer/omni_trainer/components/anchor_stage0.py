"""The stage-0 side of the anchor: receive a micro-batch's encoder outputs as autograd leaves
of the LLM's input, and send their gradients back to the ranks that encoded them once the
stage's backward of that micro-batch has produced them all.

With sequence parallelism each stage-0 TP rank receives and returns only the rows of its
sequence shard (``multiplex.reshard``); without, every rank receives whole pieces and one rank
per piece returns its gradient."""

from __future__ import annotations

from collections.abc import Callable

import torch

from omni_trainer.components.anchor_work import AnchorStep, message_tag
from omni_trainer.components.timing import PhaseTimer
from omni_trainer.distributed import comm
from omni_trainer.mcore.parallel import BACKWARD, FORWARD, AnchorGroups
from omni_trainer.models.batch import MediaRows


class StageZeroSide:
    """Receives encoder outputs on stage 0 and returns their gradients."""

    def __init__(
        self,
        *,
        groups: AnchorGroups,
        hidden_size: int,
        device: torch.device,
        dtype: torch.dtype,
        timer: PhaseTimer,
    ) -> None:
        self.groups = groups
        self.hidden_size = hidden_size
        self.device = device
        self.dtype = dtype
        self.timer = timer

    def embeddings(self, step: AnchorStep, microbatch: int) -> dict[str, MediaRows]:
        """Receive micro-batch ``microbatch``'s encoder outputs: [tokens, hidden] per modality,
        items in order, as autograd leaves whose gradients flow back to their encoders; with
        sequence parallelism only the rows of this rank's shard, with their positions in it."""
        received: dict[str, list[torch.Tensor]] = {}
        where: dict[str, list[torch.Tensor]] = {}
        requests = []
        leaves: list[tuple[int, int, torch.Tensor]] = []
        for emb in step.by_microbatch.get(microbatch, []):
            work = step.works[emb]
            stage = step.table.forward[emb].stage
            received.setdefault(work.mb.modality, [])
            for idx, piece in enumerate(work.pieces):
                mine = [p for p in step.parts_of(emb, idx) if p.tp_rank == self.groups.tp_rank]
                if not mine:  # sequence parallel: none of its rows are in this shard
                    continue
                part = mine[0]
                src = self.groups.stage_ranks[stage][piece.rank]
                if src == self.groups.rank:
                    buf = step.local_outputs.pop((emb, idx))
                else:
                    buf = torch.empty(
                        part.hi - part.lo, self.hidden_size, device=self.device, dtype=self.dtype
                    )
                    group = self.groups.channel(FORWARD, src, self.groups.rank)
                    tag = message_tag(emb, idx, FORWARD)
                    requests.append(comm.irecv(buf, src=src, group=group, tag=tag))
                leaf = buf.detach().requires_grad_()
                leaves.append((emb, idx, leaf))
                received.setdefault(work.mb.modality, []).append(leaf)
                if step.sequence_shard is not None:
                    at = torch.arange(part.at, part.at + part.hi - part.lo, device=self.device)
                    where.setdefault(work.mb.modality, []).append(at)
        with self.timer.span("encoder_wait"):
            for r in requests:
                r.wait()
        expected = len(leaves)
        step.pending_grads[microbatch] = {}
        for emb, idx, leaf in leaves:
            leaf.register_hook(self._grad_hook(step, microbatch, emb, idx, expected))
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
        self, step: AnchorStep, microbatch: int, emb: int, idx: int, expected: int
    ) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            pending = step.pending_grads[microbatch]
            pending[(emb, idx)] = grad.detach()
            if len(pending) == expected:
                self._send_grads(step, step.pending_grads.pop(microbatch))

        return hook

    def _send_grads(self, step: AnchorStep, grads: dict[tuple[int, int], torch.Tensor]) -> None:
        """Return a micro-batch's embedding gradients, in (encoder mb, piece) order."""
        me = self.groups.tp_rank
        for (emb, idx), grad in sorted(grads.items()):
            work = step.works[emb]
            if all(part.tp_rank != me for part in step.grad_parts(emb, idx)):
                continue
            stage = step.table.forward[emb].stage
            dst = self.groups.stage_ranks[stage][work.pieces[idx].rank]
            if dst == self.groups.rank:
                step.local_grads[(emb, idx)] = grad
            else:
                step.sends.append(
                    comm.isend(
                        grad.contiguous(),
                        dst=dst,
                        group=self.groups.channel(BACKWARD, self.groups.rank, dst),
                        tag=message_tag(emb, idx, BACKWARD),
                    )
                )
