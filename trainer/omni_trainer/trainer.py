"""The training loop: ``train()`` -> ``train_step()`` -> ``forward_backward()``, read top-down."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from omni_trainer.components.optim import (
    all_reduce_grads,
    build_optimizer,
    clip_grad_norm,
    lr_at,
)
from omni_trainer.components.progress import NullReporter, StepReporter
from omni_trainer.components.throughput import StepFlops, resolve_peak_flops, step_flops
from omni_trainer.config import ManifestError, TrainerConfig
from omni_trainer.data.loader import MultimodalStream
from omni_trainer.data.packing import collate, dp_slice, split_micro_batches
from omni_trainer.data.sample import MediaGeometry
from omni_trainer.mcore.parallel import ProcessGroups, seed_everything
from omni_trainer.models.omni import OmniModel, to_device_batch


@dataclass
class StepResult:
    step: int
    loss: float
    lr: float
    grad_norm: float
    seconds: float
    tokens: int
    flops: float


@dataclass
class RunSummary:
    """What ``--summary`` writes; every field is measured in this run."""

    steps: int
    initial_loss: float
    final_loss: float
    loss_curve: list[float]
    grad_norm_curve: list[float]
    lr_curve: list[float]
    tokens_per_second: float
    mfu: float
    peak_flops: float
    peak_flops_source: str
    samples_per_modality: dict[str, int]
    tokens_per_modality: dict[str, int]
    world_size: int
    layout: dict[str, object]
    seed: int
    wall_time_s: float
    mean_step_time_s: float
    parameters: dict[str, int] = field(default_factory=dict)


def media_geometry(cfg: TrainerConfig) -> MediaGeometry:
    """The data pipeline's view of the encoders: pixels per patch, frames per token, mel bins."""
    image, audio = cfg.model.encoders.image, cfg.model.encoders.audio
    return MediaGeometry(
        patch_size=image.patch_size if image else 14,
        audio_subsampling=audio.subsampling if audio else 4,
        n_mels=audio.n_mels if audio else 80,
    )


def autocast_context(cfg: TrainerConfig, device: torch.device):
    precision = cfg.train.precision
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return torch.autocast(device_type=device.type, enabled=False)


class Trainer:
    """Data-parallel x tensor-parallel training of the encoder + LLM model on one rank."""

    def __init__(
        self,
        cfg: TrainerConfig,
        *,
        groups: ProcessGroups,
        steps: int,
        reporter: StepReporter | None = None,
    ) -> None:
        dims = groups.dims
        if dims.pp > 1 or dims.cp > 1:
            raise ManifestError(
                f"spec.trainer.parallelism.pipeline={dims.pp}, context={dims.cp}: pipeline "
                "and context parallel training run on the multiplexed (EncoderAnchor) path, "
                "which this trainer does not have yet; use tensor and data parallelism"
            )
        per_step = cfg.data.micro_batch_size * dims.dp
        if cfg.data.global_batch_size % per_step:
            raise ManifestError(
                f"spec.trainer.data.globalBatchSize ({cfg.data.global_batch_size}) must be a "
                f"multiple of microBatchSize x data-parallel size "
                f"({cfg.data.micro_batch_size} x {dims.dp} = {per_step}); "
                "change the batch sizes or --nproc"
            )
        self.cfg = cfg
        self.groups = groups
        self.steps = steps
        self.reporter = reporter or NullReporter()
        self.device = groups.device
        seed_everything(cfg.seed)
        self.model = OmniModel(cfg.model, max_sequence_length=cfg.data.seq_length).to(self.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # Gradients always exist (zeros when a modality is absent from a batch), as in megatron's
        # DDP buffers: every rank all-reduces the same tensors, and the optimizer treats a
        # parameter the same whether its modality showed up on this rank, another, or nowhere.
        for p in self.params:
            p.grad = torch.zeros_like(p)
        self.optimizer = build_optimizer(self.model, cfg.optimizer)
        self.stream = MultimodalStream(
            cfg.data,
            seed=cfg.seed,
            vocab_size=cfg.model.llm.vocab_size,
            geometry=media_geometry(cfg),
        )
        self.peak_flops, self.peak_source = resolve_peak_flops(
            self.device,
            world_size=dims.world_size,
            override_per_device=cfg.train.peak_flops_per_device,
        )

    # -- the loop ---------------------------------------------------------------------------
    def train(self) -> RunSummary:
        dims = self.groups.dims
        self.reporter.start(
            self.steps, f"{self.steps} steps, layout {dims.describe()} (world {dims.world_size})"
        )
        results: list[StepResult] = []
        t0 = time.perf_counter()
        try:
            for step in range(self.steps):
                r = self.train_step(step)
                results.append(r)
                self.reporter.update(
                    step + 1,
                    loss=r.loss,
                    tokens_per_s=r.tokens / r.seconds,
                    mfu=r.flops / r.seconds / self.peak_flops,
                )
        finally:
            self.reporter.close()
        return self._summary(results, time.perf_counter() - t0)

    def train_step(self, step: int) -> StepResult:
        start = time.perf_counter()
        global_batch = self.stream.next_global_batch()
        flops: StepFlops = step_flops(self.cfg.model, global_batch)
        lr = lr_at(step, opt=self.cfg.optimizer, sched=self.cfg.lr_schedule, total_steps=self.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss = self.forward_backward(global_batch)
        all_reduce_grads(self.params, self.groups.dp)
        grad_norm = clip_grad_norm(
            self.params, self.cfg.optimizer.clip_grad, tp_group=self.groups.tp
        )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return StepResult(
            step=step,
            loss=loss,
            lr=lr,
            grad_norm=grad_norm,
            seconds=time.perf_counter() - start,
            tokens=flops.tokens,
            flops=flops.training,
        )

    def forward_backward(self, global_batch) -> float:
        """Accumulate gradients of this rank's micro-batches; returns the global mean loss.

        Every micro-batch loss is a sum over text targets divided by the number of text targets in
        the WHOLE global batch, so summing gradients over micro-batches and data-parallel ranks
        gives exactly the gradient of the global-batch mean, whatever the layout.
        """
        local = dp_slice(global_batch, self.groups.dp_rank, self.groups.dims.dp)
        micro_batches = [
            collate(mbs, self.cfg.data.seq_length)
            for mbs in split_micro_batches(local, self.cfg.data.micro_batch_size)
        ]
        counts = torch.tensor(
            [float(sum(int(mb.loss_mask.sum()) for mb in micro_batches))], dtype=torch.float64
        )
        dist.all_reduce(counts, group=self.groups.dp) if self.groups.dims.dp > 1 else None
        global_tokens = max(float(counts.item()), 1.0)
        loss_sum = torch.zeros((), dtype=torch.float64)
        for mb in micro_batches:
            batch = to_device_batch(mb, self.device)
            with autocast_context(self.cfg, self.device):
                mb_loss = self.model(batch)
            (mb_loss / global_tokens).backward()
            loss_sum += mb_loss.detach().double().cpu()
        if self.groups.dims.dp > 1:
            dist.all_reduce(loss_sum, group=self.groups.dp)
        return float(loss_sum.item()) / global_tokens

    # -- results ----------------------------------------------------------------------------
    def _summary(self, results: list[StepResult], wall: float) -> RunSummary:
        timed = results[1:] if len(results) > 1 else results  # step 1 pays one-off warmup
        seconds = sum(r.seconds for r in timed)
        tokens_per_s = sum(r.tokens for r in timed) / seconds
        achieved = sum(r.flops for r in timed) / seconds
        dims = self.groups.dims
        counters = self.stream.counters
        llm_params = sum(  # TP shards counted whole, replicated weights once
            p.numel() * (dims.tp if getattr(p, "tensor_model_parallel", False) else 1)
            for p in self.model.llm.parameters()
        )
        enc_params = sum(p.numel() for p in self.model.encoder_parameters())
        return RunSummary(
            steps=len(results),
            initial_loss=results[0].loss,
            final_loss=results[-1].loss,
            loss_curve=[r.loss for r in results],
            grad_norm_curve=[r.grad_norm for r in results],
            lr_curve=[r.lr for r in results],
            tokens_per_second=tokens_per_s,
            mfu=achieved / self.peak_flops,
            peak_flops=self.peak_flops,
            peak_flops_source=self.peak_source,
            samples_per_modality=dict(sorted(counters["samples_per_modality"].items())),
            tokens_per_modality=dict(sorted(counters["tokens_per_modality"].items())),
            world_size=dims.world_size,
            layout={**dims.as_dict(), "name": dims.describe()},
            seed=self.cfg.seed,
            wall_time_s=wall,
            mean_step_time_s=seconds / len(timed),
            parameters={"llm": llm_params, "encoders": enc_params},
        )
