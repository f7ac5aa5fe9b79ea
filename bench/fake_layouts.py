"""One rank of a large layout on one device, through PyTorch's fake process group.

The fake backend (``torch.testing._internal.distributed.fake_pg``) completes every collective and
point-to-point op at once, on CUDA and CPU tensors, without peers: a single process runs rank
``r`` of a world of 8 with that rank's shapes, buffers and schedule, so what breaks first on a
multi-GPU job (shapes, a group a layout forgets, memory at the first step or checkpoint) shows on
one GPU. Numbers are meaningless (every rank sees its own data echoed back); memory and the code
path are real. ``bench/gpu_check.py`` runs it as its ``layouts`` part.

Inside the fake world three things are adapted, all in :func:`fake_world` and undone after it:
``dist.new_group`` drops an explicit ``backend`` (the fake backend serves every group; gloo
cannot join a fake store); DCP's save planner keeps every item on this rank and skips the
coverage check (each rank's plan is this rank's, echoed, so other ranks' shards are missing by
construction); the trainer's finite-loss check is off (a pipeline stage receives uninitialised
gradients from its fake peer); ``distributed.comm`` keeps tensors on the GPU as it does over
NCCL.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

WORLD = 8

LAYOUTS: dict[str, dict] = {
    "tp2_sp": {"tensor": 2, "sequenceParallel": True},
    "pp2": {"pipeline": 2},
    "dp8_zero1": {"distributedOptimizer": True},
}
"""``spec.trainer.parallelism`` of each checked layout, all at world 8 (the rest is data
parallel: tp2 x dp4, pp2 x dp4, dp8)."""

RECOMPUTE = {"dp8_zero1": "full"}
"""``train.recompute`` per layout where not selective: dp8 holds the whole 7B model per rank
(about 50 GB of weights, fp32 gradients and its optimizer shard)."""


@dataclass(frozen=True)
class LayoutShapes:
    """What the layouts run at: a 7B LLM on a GPU, the tiny preset in the CPU smoke run."""

    llm: dict
    seq_length: int
    global_batch: int
    steps: int


GPU_LAYOUTS = LayoutShapes(llm={"preset": "llama-7b"}, seq_length=4096, global_batch=8, steps=2)
CPU_LAYOUTS = LayoutShapes(llm={"preset": "tiny"}, seq_length=128, global_batch=8, steps=2)


@contextlib.contextmanager
def fake_world(world: int, rank: int) -> Iterator[None]:
    """This process as rank ``rank`` of a fake world of ``world`` (see the module docstring)."""
    from unittest import mock

    import torch.distributed.checkpoint.default_planner as planner
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import omni_trainer.trainer as trainer_module
    from omni_trainer.distributed import comm
    from omni_trainer.mcore.parallel import destroy_distributed

    destroy_distributed()  # a world of one from an earlier part
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0"}
    saved_env = {k: os.environ.get(k) for k in env}
    new_group, dedup = dist.new_group, planner.DefaultSavePlanner._dedup_save_plans
    validate = planner._validate_global_plan

    def any_backend_group(*args, backend=None, **kwargs):
        return new_group(*args, **kwargs)

    os.environ.update(env)
    dist.new_group = any_backend_group
    planner.DefaultSavePlanner._dedup_save_plans = lambda self, plans: planner.dedup_save_plans(
        plans, True
    )
    planner._validate_global_plan = lambda *_, **__: []
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        with (
            mock.patch.object(trainer_module, "check_finite", lambda *_, **__: None),
            mock.patch.object(comm, "comm_device", _fake_comm_device),
        ):
            yield
    finally:
        destroy_distributed()
        dist.new_group = new_group
        planner.DefaultSavePlanner._dedup_save_plans = dedup
        planner._validate_global_plan = validate
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _fake_comm_device(group=None) -> torch.device:
    """Where tensors travel in the fake world: the GPU, as over NCCL (the fake backend serves
    CUDA tensors; staging them through the host would distort time and memory)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class PeakMemory:
    """The device's peak allocated bytes since the last :meth:`reset` (None off CUDA)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int | None:
        if not self.cuda:
            return None
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.max_memory_allocated(self.device))


def layout_manifest(shapes: LayoutShapes, name: str, ckpt: Path) -> dict:
    """A text-only job of ``shapes`` in layout ``name``: bf16, one synchronous checkpoint."""
    return {
        "apiVersion": "omni.megascale.io/v1alpha1",
        "kind": "OmniTrainingJob",
        "metadata": {"name": f"layout-{name.replace('_', '-')}"},
        "spec": {
            "nodes": 1,
            "gpusPerNode": WORLD if torch.cuda.is_available() else 0,
            "trainer": {
                "seed": 0,
                "model": {"llm": shapes.llm},
                "parallelism": LAYOUTS[name],
                "data": {
                    "seqLength": shapes.seq_length,
                    "globalBatchSize": shapes.global_batch,
                    "microBatchSize": 1,
                    "sources": [
                        {
                            "kind": "synthetic",
                            "name": "longtext",
                            "modality": "text",
                            "preset": "longtext",
                            "lengthScale": shapes.seq_length / 6000,
                        },
                    ],
                },
                "optimizer": {"lr": 1e-4, "minLr": 1e-5, "weightDecay": 0.1, "clipGrad": 1.0},
                "checkpoint": {"path": str(ckpt), "intervalSteps": shapes.steps, "async": False},
                "train": {
                    "steps": shapes.steps,
                    "precision": "bf16",
                    "recompute": RECOMPUTE.get(name, "selective"),
                    # MFU means nothing in a fake world: no matmul timing on a CPU
                    **({} if torch.cuda.is_available() else {"peakFlopsPerDevice": 1e12}),
                },
            },
        },
    }


def predicted_bytes(cfg, dims, *, stage: int) -> dict[str, float]:
    """The planner's bytes for one rank of ``stage``: static memory by kind plus the LLM's
    activation peak in the step's 1F1B order, for full sequences of ``seqLength`` tokens."""
    from omni_trainer.costs.step_costs import static_memory
    from omni_trainer.data.packing import PackedSequence, Segment
    from omni_trainer.multiplex.encoder_policy import llm_activation_peaks, trainer_layout

    layout = trainer_layout(cfg, dims)
    seq = cfg.data.seq_length
    row = PackedSequence(seq, [Segment("t", "text", 0, seq, 0)], [])
    per_rank = cfg.data.global_batch_size // (dims.dp * cfg.data.micro_batch_size)
    micro_batches = [[row] * cfg.data.micro_batch_size for _ in range(per_rank)]
    out = dict(static_memory(cfg.model, layout, stage))
    out["llm_activations"] = llm_activation_peaks(cfg, layout, micro_batches, context=dims.cp)[
        stage
    ]
    out["total"] = sum(out.values())
    return out


def run_layout(name: str, shapes: LayoutShapes, tmp: Path, *, rank: int = 0) -> dict:
    """Rank ``rank`` of layout ``name``: build, ``shapes.steps`` training steps, one checkpoint
    save and its load into the same model; each phase's peak device memory beside the
    planner's prediction for that rank."""
    from omni_trainer.checkpoint.state import ModelState
    from omni_trainer.config import parse_manifest
    from omni_trainer.distributed.layout import layout_for
    from omni_trainer.mcore.parallel import build_process_groups, init_distributed
    from omni_trainer.trainer import Trainer

    doc = layout_manifest(shapes, name, tmp / "ckpt")
    cfg = parse_manifest(doc).spec.trainer
    out: dict = {"world": WORLD, "rank": rank, "parallelism": LAYOUTS[name]}
    with fake_world(WORLD, rank):
        _, world, device = init_distributed()
        dims = layout_for(cfg, world)
        groups = build_process_groups(dims, device)
        memory = PeakMemory(device)
        memory.reset()
        t0 = time.perf_counter()
        trainer = Trainer(cfg, groups=groups, steps=shapes.steps)
        out["build_s"] = round(time.perf_counter() - t0, 1)
        out["built_peak_bytes"] = memory.peak()
        memory.reset()
        with _measured_save(memory, out):
            summary = trainer.train()  # saves after its last step
        out["step_time_s"] = summary.step_time_curve
        out["layout"] = summary.layout["name"]
        out["summary_memory"] = summary.memory
        stage = groups.anchor.stage
        saved = trainer.checkpointer.latest_step()
        memory.reset()
        t0 = time.perf_counter()
        resumed = trainer.checkpointer.load_latest(ModelState.from_trainer(trainer))
        out["load"] = {"seconds": round(time.perf_counter() - t0, 2), "peak_bytes": memory.peak()}
    out["save"]["step"] = saved
    out["load"]["step"] = None if resumed is None else resumed.step
    predicted = predicted_bytes(cfg, dims, stage=stage)
    out["stage"] = stage
    out["predicted_bytes"] = predicted
    if out["train_peak_bytes"] is not None:
        out["measured_over_predicted"] = round(out["train_peak_bytes"] / predicted["total"], 3)
    if saved != shapes.steps or out["load"]["step"] != shapes.steps:
        out["mismatch"] = True
    return out


@contextlib.contextmanager
def _measured_save(memory: PeakMemory, out: dict) -> Iterator[None]:
    """Inside: the training peak up to the checkpoint save (``train_peak_bytes``), then the
    save's own peak and seconds (``save``)."""
    from unittest import mock

    from omni_trainer.checkpoint.checkpointer import Checkpointer

    save = Checkpointer.save

    def measured(self, *args, **kwargs):
        out["train_peak_bytes"] = memory.peak()
        memory.reset()
        t0 = time.perf_counter()
        try:
            return save(self, *args, **kwargs)
        finally:
            out["save"] = {"seconds": round(time.perf_counter() - t0, 2),
                           "peak_bytes": memory.peak()}  # fmt: skip

    with mock.patch.object(Checkpointer, "save", measured):
        yield


def part_layouts(shapes: LayoutShapes, tmp: Path) -> dict:
    """Every layout of :data:`LAYOUTS`, each as rank 0 of its fake world."""
    out: dict = {}
    for name in LAYOUTS:
        out[name] = run_layout(name, shapes, tmp / name)
        print(f"[gpu_check]   {name}: {_describe(out[name])}", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if any(r.pop("mismatch", False) for r in out.values()):
        out["mismatch"] = True
    return out


def _describe(r: dict) -> str:
    gib = 2**30
    if r["train_peak_bytes"] is None:
        return f"{r['layout']}: ran (no device memory figures on CPU)"
    return (
        f"{r['layout']} stage {r['stage']}: peak {r['train_peak_bytes'] / gib:.1f} GiB train, "
        f"{r['save']['peak_bytes'] / gib:.1f} save, {r['load']['peak_bytes'] / gib:.1f} load; "
        f"planner {r['predicted_bytes']['total'] / gib:.1f} GiB"
    )
