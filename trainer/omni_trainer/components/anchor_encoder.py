"""The encoder side of the anchor: on any stage, encode an encoder micro-batch at its forward
slot and send its pieces to stage 0; at its backward slot, receive their gradients and run the
encoder backward.

Short samples encode data parallel in one batch, long ones with Ulysses sequence parallelism
across the stage's group (``models.ulysses``), as the step's LSSP plan says."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from omni_trainer.components.anchor_work import AnchorStep, EncoderWork, Held, message_tag
from omni_trainer.components.precision import encoder_autocast
from omni_trainer.components.timing import ActivationMeter, PhaseTimer
from omni_trainer.distributed import comm
from omni_trainer.mcore.parallel import BACKWARD, FORWARD, AnchorGroups
from omni_trainer.models.freeze import is_frozen
from omni_trainer.models.ulysses import encode_sequence_parallel


class EncoderSide:
    """Runs this rank's encoder forward and backward work of a step."""

    def __init__(
        self,
        *,
        encoders: nn.ModuleDict,
        projectors: nn.ModuleDict,
        groups: AnchorGroups,
        device: torch.device,
        dtype: torch.dtype,
        timer: PhaseTimer,
        memory: ActivationMeter,
    ) -> None:
        self.encoders = encoders
        self.projectors = projectors
        self.groups = groups
        self.device = device
        self.dtype = dtype  # the LLM's: encoders compute in it under autocast, and send it
        self.timer = timer
        self.memory = memory

    def forward(self, step: AnchorStep, emb: int) -> None:
        """Encode ``emb``, keep this rank's outputs for the backward and send them on."""
        work = step.works[emb]
        encoder = self.encoders[work.mb.modality]
        projector = self.projectors[work.mb.modality]
        with (
            self.timer.span("encoder"),
            self.memory.recording(emb),
            encoder_autocast(self.dtype, self.device),
        ):
            outputs = self._encode(work, encoder, projector)
        self._route(step, emb, work, outputs)

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
        self,
        step: AnchorStep,
        emb: int,
        work: EncoderWork,
        outputs: dict[tuple[int, int], torch.Tensor],
    ) -> None:
        """Keep this rank's outputs for the backward and send them to every stage-0 TP rank."""
        me = self.groups.tp_rank
        held: list[Held] = []
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
            for part in step.parts_of(emb, idx):
                dst = self.groups.stage_ranks[0][part.tp_rank]
                rows = payload[part.lo : part.hi]
                if dst == self.groups.rank:
                    step.local_outputs[(emb, idx)] = rows
                else:
                    step.sends.append(
                        comm.isend(
                            rows,
                            dst=dst,
                            group=self.groups.channel(FORWARD, self.groups.rank, dst),
                            tag=message_tag(emb, idx, FORWARD),
                        )
                    )
        step.held[emb] = held

    def backward(self, step: AnchorStep, emb: int) -> None:
        """Receive the gradients of ``emb``'s outputs held here and run the encoder backward."""
        held = step.held.pop(emb, [])
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
            for part in step.grad_parts(emb, idx):
                src = self.groups.stage_ranks[0][part.tp_rank]
                if src == self.groups.rank:
                    parts.append(step.local_grads.pop((emb, idx)))
                    continue
                buf = out.new_empty((part.hi - part.lo, *out.shape[1:]), dtype=self.dtype)
                group = self.groups.channel(BACKWARD, src, self.groups.rank)
                tag = message_tag(emb, idx, BACKWARD)
                requests.append(comm.irecv(buf, src=src, group=group, tag=tag))
                parts.append(buf)
            grads.append(parts)
        with self.timer.span("encoder_wait"):
            for r in requests:
                r.wait()
        with self.timer.span("encoder"):
            _encoder_backward(held, [g[0] if len(g) == 1 else torch.cat(g) for g in grads])
        self.memory.release(emb)


def _encoder_backward(held: list[Held], grads: list[torch.Tensor]) -> None:
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
