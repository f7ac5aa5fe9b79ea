"""torchrun worker: save the real trainer's state in one layout, load it into others.

Per scenario: build the trainer in the save layout, train ``steps`` steps, save (async), train
one more step (its loss is the reference continuation); then for every load layout build a fresh
trainer, load the checkpoint and the loader state, dump the full state and train the same step.
Full states (TP shards gathered, keyed by global name) go to ``<out>/<name>/<phase>-rank<r>.pt``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def full_state(trainer) -> dict[str, torch.Tensor]:
    """Parameters and optimizer slots by global name, TP shards gathered, each once globally."""
    from omni_trainer.checkpoint.state import ModelState
    from omni_trainer.models.init import global_llm_names

    state = ModelState.from_trainer(trainer)
    opt = state.optimizer.state
    whole = trainer.main.full_state(trainer.optimizer)  # gathered under ZeRO-1
    models = {n: p for c in trainer.chunks for n, p in global_llm_names(c).items()}
    tp, tp_group = trainer.groups.dims.tp, trainer.groups.tp
    out: dict[str, torch.Tensor] = {}
    for name, p in state.llm.items():
        for key, t in whole.get(id(models[name]), {"param": p.detach()}).items():
            if tp > 1 and getattr(p, "tensor_model_parallel", False) and t.shape == p.shape:
                shards = [torch.empty_like(t) for _ in range(tp)]
                dist.all_gather(shards, t.contiguous(), group=tp_group)
                stride = getattr(p, "partition_stride", 1)
                pieces = [s.chunk(stride, dim=p.partition_dim) for s in shards]
                t = torch.cat(
                    [pieces[j % tp][j // tp] for j in range(tp * stride)], dim=p.partition_dim
                )
            out[f"llm.{name}.{key}"] = t.clone()
    if state.tp_rank != 0 or state.dp_rank != 0:
        out = {}
    for name, p in state.replicated.items():
        if state.rank == 0:
            out[f"{name}.param"] = p.detach().clone()
        if (state.owned is None and state.rank == 0) or (state.owned and name in state.owned):
            for key, t in opt.get(p, {}).items():
                out[f"{name}.{key}"] = t.clone()
    return out


def loader_of(trainer):
    """The trainer's data stream (``data`` in the data-plane trainer, ``stream`` before it)."""
    return getattr(trainer, "data", None) or trainer.stream


def every_loader(trainer) -> dict:
    """Every data-parallel rank's loader shards (as ``CheckpointSession.save`` writes them), so
    a layout with another data-parallel size can resume them."""
    everyone = [None] * trainer.groups.dims.dp
    dist.all_gather_object(everyone, loader_of(trainer).state_dict(), group=trainer.groups.dp)
    return {"shards": {k: v for state in everyone for k, v in state["shards"].items()}}


def build(doc: dict, steps: int):
    from omni_trainer.config import parse_manifest
    from omni_trainer.distributed.config import ParallelDims
    from omni_trainer.mcore.parallel import build_process_groups, init_distributed
    from omni_trainer.trainer import Trainer

    cfg = parse_manifest(doc).spec.trainer
    _, world, device = init_distributed()
    groups = build_process_groups(ParallelDims.from_config(cfg.parallelism, world), device)
    return Trainer(cfg, groups=groups, steps=steps)


def run(spec: dict) -> None:
    from omni_trainer.checkpoint.checkpointer import Checkpointer
    from omni_trainer.checkpoint.config import CheckpointConfig
    from omni_trainer.checkpoint.state import ModelState

    steps, out = spec["steps"], Path(spec["out"])
    group = None
    report: dict[str, dict] = {}
    for name, scenario in spec["scenarios"].items():
        trainer = build(scenario["save"], steps + 1)
        if group is None:
            group = dist.new_group(backend="gloo")  # one checkpoint group for the whole launch
        rank = dist.get_rank()
        config = CheckpointConfig(path=scenario["path"], interval_steps=steps, keep_last=2)
        ckpt = Checkpointer(config, group=group, layout=trainer.groups.dims.as_dict())
        for step in range(steps):
            trainer.train_step(step)
        ckpt.save(steps, ModelState.from_trainer(trainer), every_loader(trainer))
        saved = full_state(trainer)  # taken while the save runs: the snapshot must not move
        reference = trainer.train_step(steps).loss  # mutates params while the save may run
        result = ckpt.close()
        assert result is not None and result.committed, result
        torch.save(saved, out / name / f"saved-rank{rank}.pt")
        entry = {"reference": reference, "blocking_s": result.blocking_s, "loads": {}}
        for target, doc in scenario["load"].items():
            trainer = build(doc, steps + 1)
            ckpt = Checkpointer(config, group=group)
            resume = ckpt.load_latest(ModelState.from_trainer(trainer))
            assert resume is not None and resume.step == steps, resume
            loader_of(trainer).load_state_dict(resume.loader_state)
            torch.save(full_state(trainer), out / name / f"load-{target}-rank{rank}.pt")
            entry["loads"][target] = trainer.train_step(steps).loss
            ckpt.close()
        report[name] = entry
        dist.barrier()
    if rank == 0:
        (out / "report.json").write_text(json.dumps(report, indent=1))


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    run(spec)


if __name__ == "__main__":
    main()
