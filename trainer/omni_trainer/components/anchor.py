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

The work is split by side: :mod:`.anchor_work` (the step's encoder work, where pieces go, what
is in flight), :mod:`.anchor_encoder` (encode, send, backward) and :mod:`.anchor_stage0`
(receive, return gradients); :class:`EncoderAnchor` is what the step runner calls.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from omni_trainer.components.anchor_encoder import EncoderSide
from omni_trainer.components.anchor_stage0 import StageZeroSide
from omni_trainer.components.anchor_work import AnchorStep, EncoderWork
from omni_trainer.components.timing import ActivationMeter, PhaseTimer
from omni_trainer.mcore.parallel import AnchorGroups
from omni_trainer.models.batch import MediaRows
from omni_trainer.multiplex.dataflow.table import POST, DataflowTable


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
        rank then receives only its rows); None: every stage-0 TP rank takes whole pieces.
        ``dtype``: the LLM's, which encoders compute in under autocast and send."""
        self.sequence_shard = sequence_shard
        self.timer = timer or PhaseTimer()
        self.memory = ActivationMeter()
        self.groups = groups
        self._encoder = EncoderSide(
            encoders=encoders,
            projectors=projectors,
            groups=groups,
            device=device,
            dtype=dtype,
            timer=self.timer,
            memory=self.memory,
        )
        self._stage0 = StageZeroSide(
            groups=groups, hidden_size=hidden_size, device=device, dtype=dtype, timer=self.timer
        )
        self._step = AnchorStep(sequence_shard=sequence_shard, tp=groups.tp)

    def begin_step(
        self,
        table: DataflowTable,
        works: list[EncoderWork],
        positions: Sequence[dict[str, np.ndarray]] = (),
    ) -> None:
        """``positions``: per LLM micro-batch, each modality's media token positions in the
        packed row (``models.batch.media_positions``); needed with ``sequence_shard``."""
        self._step = AnchorStep.plan(
            table, works, positions, sequence_shard=self.sequence_shard, tp=self.groups.tp
        )

    def end_step(self) -> None:
        """Run the POST slot, then wait for every outstanding send of this step."""
        self.run_slot(POST)
        step = self._step
        for work in step.sends:
            work.wait()
        leftovers = [k for k, v in step.held.items() if v] + list(step.local_grads)
        if leftovers or step.local_outputs:
            raise RuntimeError(f"encoder work left at the end of the step: {leftovers}")
        step.sends = []

    def run_slot(self, index: int) -> None:
        """Encoder backward then forward work that the table puts at this slot of this stage."""
        step, stage = self._step, self.groups.stage
        for emb in step.table.at(stage, index, "backward"):
            self._encoder.backward(step, emb)
        for emb in step.table.at(stage, index, "forward"):
            self._encoder.forward(step, emb)

    def embeddings(self, microbatch: int) -> dict[str, MediaRows]:
        """Receive micro-batch ``microbatch``'s encoder outputs on stage 0: [tokens, hidden] per
        modality, items in order, as autograd leaves whose gradients flow back to their
        encoders; with sequence parallelism only the rows of this rank's shard, with their
        positions in it."""
        return self._stage0.embeddings(self._step, microbatch)
