"""Projector-only stage (LLaVA stage 1: LLM and encoders frozen) vs full training, side by side.

Both trainers are built in one process (a world of one) from ``examples/tiny-cpu.yaml`` with a
wider LLM, and their steps alternate (full, frozen, full, ...) on the same data so that machine
noise hits both alike. Prints the median step time of each, the ratio, the trainable parameters
and the optimizer state each holds. Run: ``make bench-freeze`` or
``python bench/freeze.py [--steps N]``.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import yaml

from omni_trainer.config import parse_manifest
from omni_trainer.distributed.config import ParallelDims
from omni_trainer.mcore.parallel import build_process_groups, init_distributed
from omni_trainer.trainer import Trainer

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny-cpu.yaml"


def manifest(*, projector_only: bool, wide: bool = True) -> dict:
    """The example with a wider LLM (``wide``: else the example's own), all three modalities."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    trainer = doc["spec"]["trainer"]
    if wide:
        trainer["model"]["llm"].update(numLayers=4, hiddenSize=256, ffnHiddenSize=688)
    trainer["data"]["mixture"] = [{"atTokens": 0, "weights": {"image": 1, "audio": 1, "text": 1}}]
    if projector_only:
        trainer["model"]["llm"]["freeze"] = True
        for encoder in trainer["model"]["encoders"].values():
            encoder["freeze"] = True
    return doc


def state_bytes(trainer: Trainer) -> int:
    return sum(
        v.numel() * v.element_size()
        for state in trainer.optimizer.state.values()
        for v in state.values()
        if hasattr(v, "numel")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="timed steps of each (after one)")
    parser.add_argument(
        "--smoke", action="store_true", help="one timed step of each, the example's own LLM"
    )
    args = parser.parse_args()
    if args.smoke:
        args.steps = 1
    _, world, device = init_distributed()
    groups = build_process_groups(ParallelDims(world_size=world), device)
    runs = {
        name: Trainer(
            parse_manifest(
                manifest(projector_only=name == "projector-only", wide=not args.smoke)
            ).spec.trainer,
            groups=groups,
            steps=args.steps + 1,
        )
        for name in ("full", "projector-only")
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for step in range(args.steps + 1):
        for name, trainer in runs.items():
            seconds = trainer.train_step(step).seconds
            if step:  # the first step pays one-off warm-up
                times[name].append(seconds)
    print(f"{'stage':16s} {'median step s':>14s} {'trainable':>12s} {'optimizer state':>16s}")
    for name, trainer in runs.items():
        trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        print(
            f"{name:16s} {statistics.median(times[name]):14.3f} {trainable:12,d} "
            f"{state_bytes(trainer) / 2**20:13.2f} MiB"
        )
    ratio = statistics.median(times["full"]) / statistics.median(times["projector-only"])
    print(
        f"projector-only step is {ratio:.2f}x faster than full training ({args.steps} steps each)"
    )


if __name__ == "__main__":
    main()
