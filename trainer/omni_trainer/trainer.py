"""The training loop: ``train()`` -> ``train_step()`` -> ``forward_backward()``, read top-down."""

from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import dataclass, field
from functools import partial

import torch

from omni_trainer.checkpoint.checkpointer import Checkpointer, SaveResult
from omni_trainer.checkpoint.config import CheckpointConfig
from omni_trainer.checkpoint.state import ModelState
from omni_trainer.components.dataplane import DataPlane
from omni_trainer.components.encoder_zero import EncoderZero
from omni_trainer.components.graceful_stop import GracefulStop, NullStop, StopDecision
from omni_trainer.components.memory import (
    SavedActivationMeter,
    optimizer_state_bytes,
    tensor_bytes,
)
from omni_trainer.components.metrics import TRAINER_PHASES as PHASES
from omni_trainer.components.metrics import MetricsSink, NullTrainerMetrics
from omni_trainer.components.model_flops import StepFlops, step_flops
from omni_trainer.components.optim import (
    all_reduce_grads,
    build_optimizer,
    check_finite,
    clip_grad_norm,
    lr_at,
)
from omni_trainer.components.precision import MainParams, compute_dtype
from omni_trainer.components.progress import NullReporter, StepReporter
from omni_trainer.components.throughput import resolve_peak_flops
from omni_trainer.components.timing import PhaseTimer
from omni_trainer.config import TrainerConfig
from omni_trainer.data.packing import MicroBatch, PackedSequence, collate, split_micro_batches
from omni_trainer.distributed import comm
from omni_trainer.distributed.layout import check_layout
from omni_trainer.interop.runtime import find_checkpoint
from omni_trainer.mcore.parallel import ProcessGroups, schedule_kwargs, seed_everything
from omni_trainer.models.batch import DeviceBatch, llm_sequence_shape, to_device_batch
from omni_trainer.models.context_parallel import set_rope_positions, shard_for_context
from omni_trainer.models.freeze import parameter_modules
from omni_trainer.models.llm import LLMRuntime, Recompute, all_reduce_tied_embedding_grads
from omni_trainer.models.omni import OmniModel, first_stage_input
from omni_trainer.multiplex.anchor import EncoderAnchor, EncoderWork, build_works
from omni_trainer.multiplex.dataflow import PRE, DataflowTable, plan_dataflow
from omni_trainer.multiplex.workload import encoder_micro_batches, media_encoded_on

_FINGERPRINT_MOD = 1 << 40  # a sum over up to 2**23 ranks still fits an int64


def _id_hash(sample_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(sample_id.encode(), digest_size=8).digest(), "little")


def _samples_per_modality(batch: list[PackedSequence]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for seq in batch:
        for seg, sample in zip(seq.segments, seq.samples, strict=True):
            if sample.chunk <= 0:  # a long text's later chunks are the same sample
                counts[seg.modality] = counts.get(seg.modality, 0) + 1
    return counts


@dataclass
class StepResult:
    step: int
    loss: float
    lr: float
    grad_norm: float
    seconds: float
    tokens: int
    flops: float
    phases: dict[str, float]  # PHASES, seconds
    fingerprint: str  # of the set of samples the global batch consumed
    samples: dict[str, int]  # per modality, this replica's share of the step
    encoder_activation_peak_bytes: int
    activation_peak_bytes: int  # LLM schedule + encoders: saved for the backward, at peak
    media_bytes_read: int  # media arrays this rank loaded during the step (the ones it encodes)


@dataclass
class RunSummary:
    """What ``--summary`` writes; every field is measured in this run."""

    steps: int
    first_step: int
    """0, or the checkpoint step a resumed run continued from."""
    initial_loss: float
    final_loss: float
    loss_curve: list[float]
    batch_fingerprints: list[str]
    """Per step, an order-free fingerprint of the samples consumed (equal: same data)."""
    grad_norm_curve: list[float]
    lr_curve: list[float]
    tokens_per_second: float
    mfu: float
    tokens_per_second_curve: list[float]
    mfu_curve: list[float]
    peak_flops: float
    peak_flops_source: str
    samples_per_modality: dict[str, int]
    tokens_per_modality: dict[str, int]
    world_size: int
    layout: dict[str, object]
    seed: int
    wall_time_s: float
    mean_step_time_s: float
    step_time_curve: list[float] = field(default_factory=list)
    """Seconds of every step, the first (warm-up) included."""
    parameters: dict[str, int] = field(default_factory=dict)
    data_reorder: dict[str, object] = field(default_factory=dict)
    """Reordering of sequences between data-parallel ranks: group size, method, traffic."""
    breakdown: list[dict[str, object]] = field(default_factory=list)
    """Per rank: mean seconds per step in each phase, and the peak encoder activation bytes."""
    memory: dict[str, int] = field(default_factory=dict)
    """The busiest rank's ``rank``, ``params_bytes`` (model weights + fp32 main copies),
    ``grads_bytes``, ``optimizer_state_bytes`` and ``activation_peak_bytes`` (the most bytes
    saved for the backward at once, LLM plus encoders: ``components.memory``)."""
    skipped_samples: dict[str, int] = field(default_factory=dict)
    """Samples the loaders skipped, by reason (missing, corrupt, too_long...), all replicas."""


class Trainer:
    """Multiplexed training of the encoder + LLM model on one rank.

    The LLM runs under megatron-core's own pipeline schedule (1F1B, interleaved, or none when
    PP is 1); the :class:`EncoderAnchor` runs the encoders on every stage at the slots of the
    step's :class:`DataflowTable`. One path serves every layout, a single process included.
    """

    def __init__(
        self,
        cfg: TrainerConfig,
        *,
        groups: ProcessGroups,
        steps: int,
        reporter: StepReporter | None = None,
        resume: bool = False,
        metrics: MetricsSink | None = None,
        stop: GracefulStop | NullStop | None = None,
    ) -> None:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        dims = groups.dims
        check_layout(cfg, dims)
        self.cfg = cfg
        self.groups = groups
        self.steps = steps
        self.reporter = reporter or NullReporter()
        self.metrics = metrics or NullTrainerMetrics()
        self.device = groups.device
        seed_everything(cfg.seed)
        self.dtype = compute_dtype(cfg.train.precision, self.device)
        self.model = OmniModel(
            cfg.model,
            max_sequence_length=cfg.data.seq_length,
            seed=cfg.seed,
            llm_runtime=LLMRuntime(
                params_dtype=self.dtype,
                recompute=Recompute(cfg.train.recompute, cfg.train.recompute_layers),
                sequence_parallel=cfg.parallelism.sequence_parallel_on,
            ),
        ).to(self.device)
        self.chunks = list(self.model.llm_chunks)
        # Frozen parameters (``freeze``) take no part: no gradient, optimizer state or all-reduce.
        self.main = MainParams([p for p in self.model.llm_parameters() if p.requires_grad])
        self.llm_params = self.main.main  # fp32: what the optimizer, sync and clipping see
        self.sequence_parallel_params = [
            p for p in self.llm_params if getattr(p, "sequence_parallel", False)
        ]
        self.encoder_params = [p for p in self.model.encoder_parameters() if p.requires_grad]
        self.activations = SavedActivationMeter(self.model.parameters())
        # Gradients always exist (zeros when a modality is absent from a batch), as in megatron's
        # DDP buffers: every rank all-reduces the same tensors, and the optimizer treats a
        # parameter the same whether its modality showed up on this rank, another, or nowhere.
        for p in self.encoder_params:
            p.grad = torch.zeros_like(p)
        # ZeRO-2 for encoders: only owners keep their gradients and optimizer state.
        self.encoder_zero = (
            EncoderZero(self.encoder_params, group=groups.world)
            if cfg.parallelism.encoder.zero == 2
            else None
        )
        owned = self.encoder_zero.owned if self.encoder_zero else self.encoder_params
        modules = parameter_modules(self.model)  # lrMultipliers, by module: mains included
        modules |= {id(self.main.main_of(p)): modules[id(p)] for p in self.main.model_params}
        self.optimizer = build_optimizer([*self.llm_params, *owned], cfg.optimizer, modules=modules)
        self.timer = PhaseTimer(events=self.device.type == "cuda")
        self.anchor = EncoderAnchor(
            encoders=self.model.encoders,
            projectors=self.model.projectors,
            groups=groups.anchor,
            hidden_size=cfg.model.llm.hidden_size,
            device=self.device,
            dtype=self.dtype,
            timer=self.timer,
        )
        self.forward_backward = get_forward_backward_func()
        self.chunks[0].config.finalize_model_grads_func = self._finalize_grads
        self._schedule_kwargs = schedule_kwargs(self.chunks[0].config, self.timer)
        self.data = DataPlane(
            cfg,
            dp_rank=groups.dp_rank,
            dp_size=dims.dp,
            group=groups.reorder,
            read_ahead=dims.pp == 1,  # then this rank encodes all the media it draws
        )
        self.reorder_bytes: list[int] = []
        self._skipped_exported: dict[str, int] = {}
        self.checkpointer = (
            Checkpointer(cfg.checkpoint, layout=dims.as_dict()) if cfg.checkpoint else None
        )
        self.start_step = self._resume() if resume else self._init_from()
        self.stop = stop or NullStop()
        self.stopped_at: int | None = None
        """The step a SIGTERM stopped the run at (None: it was not stopped)."""
        self._saved_step: int | None = self.start_step
        self._save_seconds = 0.0
        self.peak_flops, self.peak_source = resolve_peak_flops(
            self.device,
            dtype=self.dtype,
            world_size=dims.world_size,
            override_per_device=cfg.train.peak_flops_per_device,
        )

    # -- checkpoints ------------------------------------------------------------------------
    def _resume(self) -> int:
        """Load the latest complete checkpoint, if any; the step to continue from."""
        if self.checkpointer is None:
            return 0
        found = self.checkpointer.load_latest(ModelState.from_trainer(self))
        if found is None:
            return self._init_from()
        self.main.copy_to_model()
        self.data.load_state_dict(found.loader_state)
        return found.step

    def _init_from(self) -> int:
        """``checkpoint.initFrom``: a fresh run starts from another checkpoint's weights only."""
        source = self.cfg.checkpoint.init_from if self.cfg.checkpoint else None
        if source is not None:
            root, step = find_checkpoint(source)
            weights = dataclasses.replace(ModelState.from_trainer(self), optimizer=None)
            Checkpointer(CheckpointConfig(path=root), cache_plans=False).load(step, weights)
            self.main.copy_to_model()
        return 0

    def _save(self, step: int) -> None:
        """Asynchronous checkpoint after ``step`` completed steps; the loop waits for the host
        copy only. The loader state saved is every shard's, so any layout can resume it."""
        with self.timer.span("checkpoint_blocking"):
            previous = self.checkpointer.wait()  # save() would wait for it too; we report it
            everyone = comm.all_gather_object(self.data.state_dict(), group=self.groups.dp)
            shards = {k: v for state in everyone for k, v in state["shards"].items()}
            self.checkpointer.save(step, ModelState.from_trainer(self), {"shards": shards})
            self._saved_step = step
        self._report_save(previous)

    def _report_save(self, result: SaveResult | None) -> None:
        """Export a committed checkpoint (the operator reads it to refill the restart budget)."""
        if result is not None and result.committed:
            self._save_seconds = max(self._save_seconds, result.blocking_s + result.background_s)
            self.metrics.record_checkpoint(
                step=result.step,
                seconds=result.blocking_s + result.background_s,
                blocking_seconds=result.blocking_s,
            )

    # -- the loop ---------------------------------------------------------------------------
    def train(self) -> RunSummary:
        dims = self.groups.dims
        self.reporter.start(
            self.steps,
            f"{self.steps} steps, layout {dims.describe()} (world {dims.world_size}), "
            f"encoder policy {self.cfg.parallelism.encoder.policy}",
        )
        results: list[StepResult] = []
        t0 = time.perf_counter()
        try:
            for step in range(self.start_step, self.steps):
                r = self.train_step(step)
                results.append(r)
                self._export(r)
                if self.checkpointer is not None:
                    self._report_save(self.checkpointer.poll())
                self.reporter.update(
                    step + 1,
                    loss=r.loss,
                    tokens_per_s=r.tokens / r.seconds,
                    mfu=r.flops / r.seconds / self.peak_flops,
                )
                decision = self.stop.decide(save_estimate_s=self._save_seconds)
                if decision is not None:
                    self._stop(step + 1, decision)
                    break
        finally:
            self.reporter.close()
            self.data.close()
            if self.checkpointer:
                last = self.checkpointer.close()
                if last is not None and not last.committed:
                    raise RuntimeError(f"the last checkpoint failed: {last.errors}")
                self._report_save(last)
        return self._summary(results, time.perf_counter() - t0)

    def _stop(self, step: int, decision: StopDecision) -> None:
        """SIGTERM: checkpoint ``step`` unless it is saved already or the grace is too short
        (the ``finally`` of :meth:`train` waits for the save)."""
        self.stopped_at = step
        save = self.checkpointer is not None and self._saved_step != step and decision.can_save
        if save:
            self._save(step)
        if self.groups.rank == 0:
            what = "writing an emergency checkpoint" if save else "no checkpoint written"
            print(f"stopping after step {step} on SIGTERM ({decision.grace_left_s:.0f} s of grace "
                  f"left): {what}", flush=True)  # fmt: skip

    def train_step(self, step: int) -> StepResult:
        start = time.perf_counter()
        media_bytes = self.data.media.bytes_read
        with self.timer.span("data"):
            local = self.data.next_local_batch()
            tokens, training_flops, fingerprint = self._global_work(
                step_flops(self.cfg.model, local), local
            )
            if self.data.last_stats is not None:
                self.reorder_bytes.append(self.data.last_stats.bytes_moved)
        lr = lr_at(step, opt=self.cfg.optimizer, sched=self.cfg.lr_schedule, total_steps=self.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group["lr_multiplier"]
        self.optimizer.zero_grad(set_to_none=False)  # at the start: grads stay inspectable
        loss = self.forward_backward_step(local)
        with self.timer.span("sync"):
            grad_norm = clip_grad_norm(
                self.llm_params,
                self.encoder_params,
                self.cfg.optimizer.clip_grad,
                tp_rank=self.groups.tp_rank,
                model_parallel_group=self.groups.model_parallel,
                sharded_replicated_group=self.groups.world if self.encoder_zero else None,
            )
            check_finite(step + 1, loss, grad_norm)
            self.optimizer.step()
            self.main.copy_to_model()
            if self.encoder_zero:
                self.encoder_zero.broadcast_parameters()
        if self.checkpointer and self.cfg.checkpoint.due(step + 1):
            self._save(step + 1)
        seconds = time.perf_counter() - start
        encoder_peak = self.anchor.memory.take_peak()
        phases = self.timer.take()
        # What no span covers is the LLM's own forward/backward compute (and Python overhead).
        phases["llm"] = max(seconds - sum(phases.values()), 0.0)
        return StepResult(
            step=step,
            loss=loss,
            lr=lr,
            grad_norm=grad_norm,
            seconds=seconds,
            tokens=tokens,
            flops=training_flops,
            fingerprint=fingerprint,
            samples=_samples_per_modality(local),
            phases=phases,
            encoder_activation_peak_bytes=encoder_peak,
            # the encoders' saved tensors are counted by their own meter (inner hooks win)
            activation_peak_bytes=self.activations.take_peak() + encoder_peak,
            media_bytes_read=self.data.media.bytes_read - media_bytes,
        )

    def _global_work(self, flops: StepFlops, local: list[PackedSequence]) -> tuple[int, float, str]:
        """Tokens, training FLOPs and sample fingerprint of the whole global batch (each replica
        saw its share). The fingerprint is order-free, so it names the set of samples a step
        consumed whatever rank consumed them: equal fingerprints, equal data."""
        ids = [s.sample_id for seq in local for s in seq.samples]
        work = torch.tensor([float(flops.tokens), flops.training], dtype=torch.float64)
        digest = torch.tensor([sum(_id_hash(i) for i in ids) % _FINGERPRINT_MOD], dtype=torch.int64)
        comm.all_reduce(work, group=self.groups.dp)
        comm.all_reduce(digest, group=self.groups.dp)
        fingerprint = int(digest.item()) % _FINGERPRINT_MOD
        return int(work[0].item()), float(work[1].item()), f"{fingerprint:010x}"

    def forward_backward_step(self, local: list[PackedSequence]) -> float:
        """Forward and backward of this replica's micro-batches; returns the global mean loss.

        Every micro-batch loss is a sum over text targets divided by the number of text targets in
        the WHOLE global batch, so summing gradients over micro-batches and data-parallel ranks
        gives exactly the gradient of the global-batch mean, whatever the layout.
        """
        with self.timer.span("data"):
            table, works, micro = self._prepare(local)
        self.anchor.begin_step(table, works)
        self.anchor.run_slot(PRE)
        self._forward_calls = 0
        iterators = [iter(range(len(micro))) for _ in self.chunks]
        with self.activations.recording():
            outputs = self.forward_backward(
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
            loss_sum += sum(float(o["loss_sum"]) for o in outputs)
        with self.timer.span("sync"):
            comm.all_reduce(loss_sum)
        return float(loss_sum.item()) / self._global_tokens

    def _prepare(
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
        table = plan_dataflow(
            self.cfg.parallelism.encoder.policy,
            pp=dims.pp,
            vpp=dims.vpp,
            num_microbatches=len(micro),
            encoder_mbs=encoder_mbs,
        )
        mine = media_encoded_on(table, self.groups.anchor.stage)
        self.data.media.prefetch(  # decoded in parallel by the workers while this thread waits
            item.ref
            for m, mb in enumerate(micro)
            for item in mb.media
            if item.modality in mine.get(m, ())
        )
        self._batches = [
            to_device_batch(mb, self.device, load=self.data.media.load, media=mine.get(m, ()))
            for m, mb in enumerate(micro)
        ]
        if dims.cp > 1:  # adaptive sample sharding: this CP rank's tokens of every micro-batch
            self._batches = [
                shard_for_context(b, mb.segment_ids, cp=dims.cp, cp_rank=self.groups.cp_rank)
                for b, mb in zip(self._batches, micro, strict=True)
            ]
        encoders = self.cfg.model.encoders
        works = build_works(
            encoder_mbs,
            {e.id: self._batches[e.microbatch].media[e.modality].arrays for e in encoder_mbs},
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
        batch = self._batches[m]
        labels = batch.labels if model.post_process else None
        set_rope_positions(model, batch.position_ids)  # context parallel: positions in the row
        if model.pre_process:
            decoder_input = first_stage_input(model, batch, self.anchor.embeddings(m))
            output = model(
                input_ids=batch.tokens,
                position_ids=batch.position_ids,
                attention_mask=None,
                packed_seq_params=batch.packed_seq_params,
                decoder_input=decoder_input,
                labels=labels,
            )
        else:  # positions: M-RoPE's angles come from them on every stage
            output = model(
                input_ids=None,
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

    def _finalize_grads(self, *_args, **_kwargs) -> None:
        """Called by megatron after the last backward: the anchor's POST slot, then grad sync."""
        self.anchor.end_step()
        with self.timer.span("sync"):
            # sequence parallel: each TP rank's norms saw only its positions
            all_reduce_grads(self.sequence_parallel_params, self.groups.tp)
            all_reduce_grads(self.llm_params, self.groups.dp_cp)  # CP ranks hold partial sums
            all_reduce_tied_embedding_grads(self.chunks, main_of=self.main.main_of)
            if self.encoder_zero:
                self.encoder_zero.reduce_gradients()
            else:
                all_reduce_grads(self.encoder_params, self.groups.world)

    # -- results ----------------------------------------------------------------------------
    def _export(self, r: StepResult) -> None:
        """Prometheus figures of a finished step (the same ones the summary is built from)."""
        stream = self.data.streams[0]
        self.metrics.record_step(
            step=r.step + 1,
            loss=r.loss,
            lr=r.lr,
            tokens_per_s=r.tokens / r.seconds,
            mfu=r.flops / r.seconds / self.peak_flops,
            step_seconds=r.seconds,
            phases={k: v for k, v in r.phases.items() if k != "checkpoint_blocking"},
            samples=r.samples,
            mixture=stream.mixer.schedule.weights(stream.mixer.total),
            encoder_activation_peak_bytes=r.encoder_activation_peak_bytes,
            media_bytes_read=r.media_bytes_read,
        )
        if self.groups.tp_rank == self.groups.cp_rank == self.groups.anchor.stage == 0:
            skipped = self.data.counters["skipped_samples"]
            self.metrics.record_skipped(
                {k: v - self._skipped_exported.get(k, 0) for k, v in skipped.items()}
            )
            self._skipped_exported = skipped

    def _global_counters(self) -> dict[str, dict[str, int]]:
        """Samples and tokens per modality over all data-parallel replicas."""
        mine = self.data.counters
        everyone = comm.all_gather_object(mine, group=self.groups.dp)
        total: dict[str, dict[str, int]] = {}
        for counters in everyone:
            for key in ("samples_per_modality", "tokens_per_modality", "skipped_samples"):
                bucket = total.setdefault(key, {})
                for m, v in counters.get(key, {}).items():
                    bucket[m] = bucket.get(m, 0) + v
        return total

    def _memory(self, results: list[StepResult]) -> dict[str, int]:
        figures = self.main.bytes()
        figures["params_bytes"] += tensor_bytes(self.encoder_params)
        figures["grads_bytes"] += tensor_bytes(p.grad for p in self.encoder_params)
        figures["optimizer_state_bytes"] = optimizer_state_bytes(self.optimizer)
        figures["activation_peak_bytes"] = max(r.activation_peak_bytes for r in results)
        return figures

    def _summary(self, results: list[StepResult], wall: float) -> RunSummary:
        timed = results[1:] if len(results) > 1 else results  # step 1 pays one-off warmup
        seconds = sum(r.seconds for r in timed)
        tokens_per_s = sum(r.tokens for r in timed) / seconds
        achieved = sum(r.flops for r in timed) / seconds
        dims = self.groups.dims
        counters = self._global_counters()
        llm_params = torch.tensor(
            [
                float(
                    sum(  # each weight once over TP shards and stages (frozen ones too)
                        p.numel()
                        for p in self.model.llm_parameters()
                        if (getattr(p, "tensor_model_parallel", False) or self.groups.tp_rank == 0)
                        and not getattr(p, "shared", False)  # a tied embedding's 2nd copy
                    )
                )
            ],
            dtype=torch.float64,
        )
        comm.all_reduce(llm_params, group=self.groups.model_parallel)
        enc_params = sum(p.numel() for p in self.model.encoder_parameters())
        mine = {
            "rank": self.groups.rank,
            "stage": self.groups.anchor.stage,
            "tp_rank": self.groups.tp_rank,
            "dp_rank": self.groups.dp_rank,
            **{
                f"{phase}_s": sum(r.phases.get(phase, 0.0) for r in timed) / len(timed)
                for phase in PHASES
            },
            "encoder_activation_peak_bytes": max(r.encoder_activation_peak_bytes for r in results),
            "media_bytes_read": sum(r.media_bytes_read for r in results),
            "memory": self._memory(results),
        }
        breakdown = comm.all_gather_object(mine)
        busiest = max(breakdown, key=lambda row: sum(row["memory"].values()))
        return RunSummary(
            steps=len(results),
            first_step=self.start_step,
            initial_loss=results[0].loss,
            final_loss=results[-1].loss,
            loss_curve=[r.loss for r in results],
            batch_fingerprints=[r.fingerprint for r in results],
            grad_norm_curve=[r.grad_norm for r in results],
            lr_curve=[r.lr for r in results],
            tokens_per_second=tokens_per_s,
            mfu=achieved / self.peak_flops,
            tokens_per_second_curve=[r.tokens / r.seconds for r in results],
            mfu_curve=[r.flops / r.seconds / self.peak_flops for r in results],
            peak_flops=self.peak_flops,
            peak_flops_source=self.peak_source,
            samples_per_modality=dict(sorted(counters["samples_per_modality"].items())),
            tokens_per_modality=dict(sorted(counters["tokens_per_modality"].items())),
            world_size=dims.world_size,
            layout={
                **dims.as_dict(),
                "name": dims.describe(),
                "encoder_policy": self.cfg.parallelism.encoder.policy,
                "encoder_eta": self.cfg.parallelism.encoder.eta,
            },
            seed=self.cfg.seed,
            wall_time_s=wall,
            mean_step_time_s=seconds / len(timed),
            step_time_curve=[r.seconds for r in results],
            parameters={"llm": int(llm_params.item()), "encoders": enc_params},
            breakdown=breakdown,
            memory={"rank": busiest["rank"], **busiest["memory"]},
            skipped_samples=dict(sorted(counters["skipped_samples"].items())),
            data_reorder={
                "group_size": self.cfg.data.reorder.group_size,
                "method": self.cfg.data.reorder.method,
                "loader_shards": self.cfg.data.shards_for(dims.dp),
                "bytes_moved_per_step": (
                    sum(self.reorder_bytes) / len(self.reorder_bytes) if self.reorder_bytes else 0
                ),
            },
        )
