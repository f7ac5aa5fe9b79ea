"""torchrun worker: several multiplexed layouts in one launch, each trained a few steps.

Writes, per scenario, the loss of every step and the full gradients after the first step (TP shards
gathered, keyed by the single-process parameter names) for the test to compare.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def full_grads(trainer) -> dict[str, torch.Tensor]:
    """This rank's gradients by global name, TP shards reassembled (on TP rank 0 of DP rank 0)."""
    from megatron.core import parallel_state as ps

    from omni_trainer.models.init import global_llm_names

    groups = trainer.groups
    tp = groups.dims.tp
    grads: dict[str, torch.Tensor] = {}
    whole = trainer.main.full_grads()  # fp32 main gradients (gathered under ZeRO-1)
    for chunk in trainer.chunks:
        for name, p in global_llm_names(chunk).items():
            if getattr(p, "shared", False) or not p.requires_grad:  # tied copy, or frozen
                continue
            g = whole[id(p)].detach().clone()
            if getattr(p, "tensor_model_parallel", False) and tp > 1:
                shards = [torch.empty_like(g) for _ in range(tp)]
                dist.all_gather(shards, g, group=ps.get_tensor_model_parallel_group())
                stride = getattr(p, "partition_stride", 1)
                pieces = [s.chunk(stride, dim=p.partition_dim) for s in shards]
                g = torch.cat(
                    [pieces[j % tp][j // tp] for j in range(tp * stride)], dim=p.partition_dim
                )
            if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                vocab = trainer.cfg.model.llm.vocab_size  # TP pads it: padding learns nothing
                assert not g[vocab:].any(), f"{name}: padded vocabulary rows got gradients"
                g = g[:vocab]
            grads[f"llm.{name}"] = g
    if groups.tp_rank != 0 or groups.dp_rank != 0:
        grads = {}
    encoder_params = [
        *trainer.model.encoders.named_parameters(prefix="encoders"),
        *trainer.model.projectors.named_parameters(prefix="projectors"),
    ]
    if trainer.encoder_zero is not None:  # ZeRO-2: each rank holds the gradients it owns
        owned = {id(p) for p in trainer.encoder_zero.owned}
        encoder_params = [(n, p) for n, p in encoder_params if id(p) in owned]
    elif dist.get_rank() != 0:
        encoder_params = []
    for name, p in encoder_params:
        if p.grad is not None:  # None: frozen
            grads[name] = p.grad.detach().clone()
    return grads


def context_plans(local: list, micro: list, micro_batch_size: int, groups) -> list[dict]:
    """Per micro-batch, what context-parallel sharding did: each sample's modality, length and
    the CP ranks that hold its tokens, and each rank's tokens and causal work."""
    from omni_trainer.data.packing import split_micro_batches
    from omni_trainer.models.context_parallel import context_token_index

    plans = []
    for seqs, mb in zip(split_micro_batches(local, micro_batch_size), micro, strict=True):
        _, plan = context_token_index(mb.segment_ids, groups.dims.cp)
        modalities = [seg.modality for seq in seqs for seg in seq.segments]
        lengths = [seg.length for seq in seqs for seg in seq.segments]
        holders = [
            sorted({r for r, rs in enumerate(plan.ranges) for i, *_ in rs if i == k})
            for k in range(len(lengths))
        ]
        plans.append(
            {
                "samples": [list(t) for t in zip(modalities, lengths, holders, strict=True)],
                "tokens": list(plan.tokens),
                "work": list(plan.work),
            }
        )
    return plans


def run_scenario(doc: dict, steps: int, out: Path | None) -> dict:
    from omni_trainer.config import parse_manifest
    from omni_trainer.distributed import strict
    from omni_trainer.distributed.config import ParallelDims
    from omni_trainer.mcore.parallel import build_process_groups, init_distributed
    from omni_trainer.trainer import Trainer

    cfg = parse_manifest(doc).spec.trainer
    _, world, device = init_distributed()
    groups = build_process_groups(
        ParallelDims.from_config(cfg.parallelism, world),
        device,
        reorder_group_size=cfg.data.reorder.group_size,
    )
    trainer = Trainer(cfg, groups=groups, steps=steps)
    audited_before = strict.audited()
    losses, grads, seen, moved = [], {}, [], []
    next_local_batch = trainer.data.next_local_batch

    def recording() -> list:
        batch = next_local_batch()
        seen.append(sorted(s.sample_id for seq in batch for s in seq.samples))
        stats = trainer.data.last_stats
        moved.append(
            None
            if stats is None
            else [
                stats.bytes_moved,
                stats.max_over_mean_before,
                stats.max_over_mean_after,
                stats.media_bytes_referenced,
            ]
        )
        return batch

    trainer.data.next_local_batch = recording
    prepare, filtered = trainer.runner.prepare, []

    def recording_prepare(local: list):
        """The zero-redundancy filter: media on the device, and media read from the sources,
        exactly where it is encoded."""
        from omni_trainer.multiplex.workload import media_encoded_on

        read_before = trainer.data.media.bytes_read
        table, works, micro = prepare(local)
        expected = media_encoded_on(table, groups.anchor.stage)
        got = {
            m: {k for k, v in b.media.items() if v.arrays}
            for m, b in enumerate(trainer.runner.batches)
        }
        everywhere = {m: set(b.media) for m, b in enumerate(trainer.runner.batches)}
        if groups.dims.cp > 1:
            contexts.append(context_plans(local, micro, cfg.data.micro_batch_size, groups))
        filtered.append(
            {
                "exact": {m: sorted(v) for m, v in got.items() if v}
                == {m: sorted(v) for m, v in expected.items()},
                "held": sum(map(len, got.values())),
                "everywhere": sum(map(len, everywhere.values())),
                "read": trainer.data.media.bytes_read - read_before,
                "encoded": sum(
                    item.ref.nbytes
                    for m, mb in enumerate(micro)
                    for item in mb.media
                    if item.modality in expected.get(m, ())
                ),
                "replica": sum(item.ref.nbytes for mb in micro for item in mb.media),
            }
        )
        return table, works, micro

    trainer.runner.prepare = recording_prepare
    contexts: list = []
    results = []
    for step in range(steps):
        results.append(trainer.train_step(step))
        losses.append(results[-1].loss)
        if step == 0:
            grads = full_grads(trainer)
    memory = trainer.summary(results, wall=0.0).memory  # what --summary reports
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(grads, out / f"rank{dist.get_rank()}.pt")
        (out / f"data{dist.get_rank()}.json").write_text(
            json.dumps(
                {
                    "samples": seen,
                    "reorder": moved,
                    "dp_rank": groups.dp_rank,
                    "filter": filtered,
                    "context": contexts,
                    "sequence_parallel": [c.config.sequence_parallel for c in trainer.chunks],
                    "sequence_parallel_params": len(trainer.parts.sequence_parallel_params),
                    "llm_dtypes": sorted({str(p.dtype) for p in trainer.model.llm_parameters()}),
                    "zero1": type(trainer.main).__name__ == "DistributedMainParams",
                    "buckets": len(getattr(trainer.main, "buckets", ())),
                    "buckets_overlapped": getattr(trainer.main, "buckets_overlapped", 0),
                    "memory": memory,
                    "strict": {
                        k: v - audited_before[k] for k, v in strict.audited().items()
                    },  # what the strict collectives audit checked in this scenario
                }
            )
        )
        if dist.get_rank() == 0:
            (out / "losses.json").write_text(json.dumps(losses))
    return {"losses": losses, "grads": grads, "samples": seen}


def main() -> None:
    from omni_trainer.mcore.parallel import destroy_groups

    spec = json.loads(Path(sys.argv[1]).read_text())
    for name, doc in spec["scenarios"].items():
        run_scenario(doc, spec["steps"], Path(spec["out"]) / name)
        dist.barrier()
        destroy_groups()  # each scenario's groups (and their threads) end with it


if __name__ == "__main__":
    main()
