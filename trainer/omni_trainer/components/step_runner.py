"""The forward and backward of one step: megatron-core's pipeline schedule for the LLM with the
:class:`EncoderAnchor` hooked in from outside (its forward-step function and its finalize hook),
so megatron's code runs as released.

The LLM runs under megatron's own schedule (1F1B, interleaved, or none when PP is 1); the anchor
runs the encoders on every stage at the slots of the step's :class:`DataflowTable`. One path
serves every layout, a single process included.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import torch

from omni_trainer.components.anchor import EncoderAnchor
from omni_trainer.components.anchor_work import EncoderWork, build_works
from omni_trainer.components.dataplane import DataPlane
from omni_trainer.components.memory import SavedActivationMeter
from omni_trainer.components.model_parts import ModelParts
from omni_trainer.components.timing import PhaseTimer
from omni_trainer.config import TrainerConfig
from omni_trainer.data.packing import MicroBatch, PackedSequence, collate, split_micro_batches
from omni_trainer.distributed import comm, strict
from omni_trainer.mcore.parallel import ProcessGroups, schedule_kwargs
from omni_trainer.models.batch import (
    DeviceBatch,
    llm_sequence_shape,
    media_positions,
    to_device_batch,
)
from omni_trainer.models.context_parallel import set_rope_positions, shard_for_context
from omni_trainer.models.omni import first_stage_input
from omni_trainer.multiplex.dataflow.table import PRE, DataflowTable
from omni_trainer.multiplex.encoder_policy import device_memory_bytes, shares_cores, step_table
from omni_trainer.multiplex.workload import encoder_micro_batches, media_encoded_on


class StepRunner:
    """Runs a replica's micro-batches through megatron's schedule and the encoder anchor."""

    def __init__(
        self,
        cfg: TrainerConfig,
        *,
        groups: ProcessGroups,
        parts: ModelParts,
        data: DataPlane,
        timer: PhaseTimer,
    ) -> None:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.cfg, self.groups, self.parts, self.data, self.timer = cfg, groups, parts, data, timer
        self.device = groups.device
        self.chunks = parts.chunks
        self.activations = SavedActivationMeter(parts.model.parameters())
        self.anchor = EncoderAnchor(
            encoders=parts.model.encoders,
            projectors=parts.model.projectors,
            groups=groups.anchor,
            hidden_size=cfg.model.llm.hidden_size,
            device=self.device,
            dtype=parts.dtype,
            timer=timer,
            sequence_shard=(
                cfg.data.seq_length * cfg.data.micro_batch_size // groups.dims.tp
                if cfg.parallelism.sequence_parallel_on
                else None
            ),
        )
        self.shared_cores = shares_cores(cfg.parallelism.encoder, self.device)
        self.forward_backward_func = get_forward_backward_func()
        self.chunks[0].config.finalize_model_grads_func = self._finalize_grads
        self._schedule_kwargs = schedule_kwargs(self.chunks[0].config, timer)
        self.batches: list[DeviceBatch] = []
        self._global_tokens = 1.0
        self._forward_calls = 0
        self._arrival = torch.zeros(1, device=comm.comm_device(groups.world))

    def forward_backward(self, local: list[PackedSequence]) -> float:
        """Forward and backward of this replica's micro-batches; returns the global mean loss.

        Every micro-batch loss is a sum over text targets divided by the number of text targets in
        the WHOLE global batch, so summing gradients over micro-batches and data-parallel ranks
        gives exactly the gradient of the global-batch mean, whatever the layout.
        """
        with self.timer.span("data"):
            table, works, micro = self.prepare(local)
        self.anchor.begin_step(table, works, [media_positions(mb) for mb in micro])
        self.parts.expect_backwards(len(micro))
        self.anchor.run_slot(PRE)
        self._forward_calls = 0
        iterators = [iter(range(len(micro))) for _ in self.chunks]
        with self.activations.recording():
            outputs = self.forward_backward_func(
                forward_step_func=self._forward_step,
                data_iterator=iterators if len(self.chunks) > 1 else iterators[0],
                model=self.chunks,
                num_microbatches=len(micro),
                **llm_sequence_shape(self.cfg.data.seq_length, self.cfg.data.micro_batch_size),
                forward_only=False,
                **self._schedule_kwargs,
            )
        loss_sum = torch.zeros(1, dtype=torch.float64)
        if self.chunks[-1].post_process and self.groups.tp_rank == 0:
            # summed where the losses are: one host copy per step, not one per micro-batch
            loss_sum += torch.stack([o["loss_sum"] for o in outputs]).sum().cpu()
        with self.timer.span("sync"):
            comm.all_reduce(loss_sum)
        return float(loss_sum.item()) / self._global_tokens

    def prepare(
        self, local: list[PackedSequence]
    ) -> tuple[DataflowTable, list[EncoderWork], list[MicroBatch]]:
        """The step's dataflow table (planned from metadata alone), then this replica's
        micro-batches on the device, with media only where this stage encodes it, and the LSSP
        plan of every encoder micro-batch; also the global count of text targets."""
        dims = self.groups.dims
        groups_of_seqs = split_micro_batches(local, self.cfg.data.micro_batch_size)
        micro = [collate(seqs, self.cfg.data.seq_length) for seqs in groups_of_seqs]
        if self.cfg.model.llm.mrope_section is not None:  # Qwen2.5-VL: 3D positions of media
            from omni_trainer.interop.qwen2_5_vl import batch_positions

            side = self.cfg.model.encoders.image.position_side
            micro = [
                dataclasses.replace(mb, position_ids=batch_positions(mb, side=side)) for mb in micro
            ]
        counts = torch.tensor([float(sum(mb.num_loss_tokens for mb in micro))], dtype=torch.float64)
        comm.all_reduce(counts, group=self.groups.dp)
        self._global_tokens = max(float(counts.item()), 1.0)

        encoder_mbs, lengths = encoder_micro_batches(
            self.cfg.model, groups_of_seqs, stages=dims.pp * dims.vpp
        )
        table = step_table(
            self.cfg,
            dims,
            groups_of_seqs,
            encoder_mbs,
            device_bytes=partial(device_memory_bytes, self.device),
            shared_cores=self.shared_cores,
        )
        mine = media_encoded_on(table, self.groups.anchor.stage)
        self.data.media.prefetch(  # decoded in parallel by the workers while this thread waits
            item.ref
            for m, mb in enumerate(micro)
            for item in mb.media
            if item.modality in mine.get(m, ())
        )
        self.batches = [
            to_device_batch(mb, self.device, load=self.data.media.load, media=mine.get(m, ()))
            for m, mb in enumerate(micro)
        ]
        if dims.cp > 1:  # adaptive sample sharding: this CP rank's tokens of every micro-batch
            self.batches = [
                shard_for_context(b, mb.segment_ids, cp=dims.cp, cp_rank=self.groups.cp_rank)
                for b, mb in zip(self.batches, micro, strict=True)
            ]
        encoders = self.cfg.model.encoders
        works = build_works(
            encoder_mbs,
            {e.id: self.batches[e.microbatch].media[e.modality].arrays for e in encoder_mbs},
            lengths,
            eta=self.cfg.parallelism.encoder.eta,
            group_size=dims.tp,
            cost=lambda modality, n: getattr(encoders, modality).flops([n]),
        )
        return table, works, micro

    def _forward_step(self, data_iterator, model):
        """megatron's forward-step hook: the anchor's slot, then this chunk's forward."""
        m = next(data_iterator)
        self.anchor.run_slot(self._forward_calls)
        self._forward_calls += 1
        batch = self.batches[m]
        labels = batch.labels if model.post_process else None
        set_rope_positions(model, batch.position_ids)  # context parallel: positions in the row
        inputs = {"input_ids": None}  # later stages: positions only (M-RoPE's angles)
        if model.pre_process:
            decoder_input = first_stage_input(model, batch, self.anchor.embeddings(m))
            inputs = {"input_ids": batch.tokens, "decoder_input": decoder_input}
        with self.timer.mark("llm_forward"):
            output = model(
                **inputs,
                position_ids=batch.position_ids,
                attention_mask=None,
                packed_seq_params=batch.packed_seq_params,
                labels=labels,
            )
        return output, partial(self._loss, batch)

    def _loss(self, batch: DeviceBatch, per_token: torch.Tensor):
        loss_sum = (per_token.float() * batch.loss_mask).sum()
        num_tokens = torch.tensor(batch.num_loss_tokens, dtype=torch.int)
        # reported in float64: an fp32 sum's rounding depends on how tokens are split over ranks
        reported = (per_token.detach().double() * batch.loss_mask.double()).sum()
        return loss_sum / self._global_tokens, num_tokens, {"loss_sum": reported}

    def arrive(self) -> None:
        """An arrival barrier: a one-element all-reduce over the world. The time a rank waits
        there for the slowest one is its ``peer_wait``, not busy time (see
        ``components/stragglers.py``). A step has one at each end of a rank's own work: its
        start, before the gradient reduction, after the optimizer; otherwise the ranks would
        wait out a slow one inside the next collective (the data plane's exchange, the
        parameters' all-gather) and count it as their own busy time."""
        with self.timer.span("peer_wait"):
            comm.all_reduce(self._arrival, group=self.groups.world)

    def _finalize_grads(self, *_args, **_kwargs) -> None:
        """Called by megatron after the last backward: the anchor's POST slot, the arrival
        barrier, then the gradient reduction (which so starts together on every rank)."""
        self.anchor.end_step()
        self.arrive()
        # OMNI_STRICT_COLLECTIVES: this step's P2P, the last step's collectives. After the
        # arrival, so a slow rank's lateness is waited out there (peer_wait), not in the audit.
        strict.audit()
        with self.timer.span("sync"):
            self.parts.reduce_gradients()
