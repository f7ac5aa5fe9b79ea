"""Grouped reordering on paper-like lengths: balance, planning time and traffic per group size.

For each modality mixture and reorder-group size, every rank draws ``--per-rank`` samples per
step; each group plans with no reordering, greedy LPT and Karmarkar-Karp (free and equal
cardinality), and the table reports the max/mean encoder load over all ranks (the step waits for
the busiest one), the bounds no plan can beat, the planning time one rank spends per step, and the
bytes the all-to-all moves. Run: ``make bench-balance`` or ``python bench/balance.py [--quick]``.
"""

from __future__ import annotations

import argparse
import math
import pickle
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from omni_trainer.balance import (
    EncoderCost,
    ItemMeta,
    cost_from_config,
    lower_bound,
    modality_cost,
    plan_reorder,
    split_groups,
)
from omni_trainer.data.config import PRESETS
from omni_trainer.data.sample import MediaRef
from omni_trainer.data.synthetic import MEDIA_FRACTION
from omni_trainer.models.encoders.config import AudioEncoderConfig, VisionEncoderConfig

MIXTURES: dict[str, dict[str, float]] = {
    "1:1": {"image": 1, "text": 1},
    "7:3": {"image": 7, "text": 3},
    "13:74:13": {"image": 13, "audio": 74, "text": 13},
}
SOURCES = {"image": ("openimages", "refcocog"), "audio": ("librispeech",), "text": ("longtext",)}
# On the wire: int64 text ids, and a media sample's reference (its pixels stay in storage: the
# rank that encodes them reads them), pickled as the all-to-all sends it.
TEXT_BYTES = 8
MEDIA_REF_BYTES = len(pickle.dumps(MediaRef(0, 10**9, (3, 448, 448)), pickle.HIGHEST_PROTOCOL))
ENCODERS = {
    "image": VisionEncoderConfig(preset="vit-l-14"),
    "audio": AudioEncoderConfig(preset="usm-2b"),
}
# (column, method, equal_cardinality, refine)
PLANNERS = (
    ("none", "none", False, False),
    ("lpt", "lpt", False, False),
    ("kk", "kk", False, False),
    ("kk-eq", "kk", True, False),
    ("kk-eq+sw", "kk", True, True),
)


@dataclass(frozen=True)
class Step:
    """One step's samples, rank by rank: metadata as the all-gather would deliver it."""

    ranks: list[list[ItemMeta]]


def draw_steps(
    mixture: dict[str, float], *, ranks: int, per_rank: int, steps: int, seed: int
) -> list[Step]:
    """Samples i.i.d. from the presets; mixture weights are token shares, as in the manifest.

    A source's share of samples is its token share divided by its mean length; image tokens are
    split evenly between OpenImages and RefCOCOg. Lengths follow ``synthetic.draw_length``
    (lognormal with the preset's mean, clipped); media take ``MEDIA_FRACTION`` of a sample's
    LLM tokens, the encoder sees those.
    """
    rng = np.random.default_rng(seed)
    names, probs = [], []
    for modality, share in mixture.items():
        for name in SOURCES[modality]:
            names.append(name)
            probs.append(share / len(SOURCES[modality]) / PRESETS[name][1].mean)
    probs_arr = np.array(probs) / sum(probs)
    out = []
    for _ in range(steps):
        picks = rng.choice(len(names), size=(ranks, per_rank), p=probs_arr)
        step = []
        for r in range(ranks):
            items = []
            for i in range(per_rank):
                modality, dist = PRESETS[names[picks[r, i]]]
                mu = math.log(dist.mean) - dist.sigma**2 / 2
                length = round(min(max(rng.lognormal(mu, dist.sigma), dist.min), dist.max))
                if modality == "text":
                    media, text = 0, length
                else:
                    media = round(MEDIA_FRACTION * length)
                    text = length - media
                nbytes = text * TEXT_BYTES + (MEDIA_REF_BYTES if media else 0)
                items.append(ItemMeta(f"{r}/{i}", media, modality, nbytes))
            step.append(items)
        out.append(Step(step))
    return out


def run(steps: Sequence[Step], group_size: int, costs: dict[str, EncoderCost]) -> dict[str, float]:
    """Mean over steps of each column for one group size."""
    ranks = len(steps[0].ranks)
    groups = split_groups(ranks, group_size)
    cost = modality_cost(costs)
    acc: dict[str, list[float]] = {}
    for step in steps:
        loads: dict[str, list[float]] = {name: [] for name, *_ in PLANNERS}
        bound = bound_eq = 0.0
        moved: dict[str, int] = {}
        for group in groups:
            items = [step.ranks[r] for r in group]
            weights = [cost(m) for rank_items in items for m in rank_items]
            bound = max(bound, lower_bound(weights, len(group)))
            bound_eq = max(bound_eq, lower_bound(weights, len(group), equal_cardinality=True))
            for name, method, equal, refine in PLANNERS:
                start = time.perf_counter()
                plan = plan_reorder(
                    items, cost=cost, equal_cardinality=equal, method=method, refine=refine
                )
                elapsed = time.perf_counter() - start
                acc.setdefault(f"ms {name}", []).append(elapsed * 1e3)
                loads[name].extend(plan.loads)
                moved[name] = moved.get(name, 0) + plan.bytes_moved
        mean = sum(loads["none"]) / ranks
        for name, values in loads.items():
            acc.setdefault(name, []).append(max(values) / mean)
            acc.setdefault(f"KB {name}", []).append(moved[name] / 1e3)
        acc.setdefault("bound", []).append(bound / mean)
        acc.setdefault("bound-eq", []).append(bound_eq / mean)
    return {key: float(np.mean(values)) for key, values in acc.items()}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64, help="data-parallel ranks in total")
    parser.add_argument("--per-rank", type=int, default=8, help="samples per rank per step")
    parser.add_argument("--steps", type=int, default=50, help="steps averaged per cell")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="16 ranks, 3 steps")
    parser.add_argument("--smoke", action="store_true", help="4 ranks, 1 step: every path, fast")
    args = parser.parse_args(argv)
    ranks, steps_n = (16, 3) if args.quick else (4, 1) if args.smoke else (args.ranks, args.steps)
    costs = {m: cost_from_config(e) for m, e in ENCODERS.items()}
    sizes = [g for g in (1, 2, 4, 8, 16, 32, 64) if g <= ranks and ranks % g == 0]

    print(
        f"{ranks} ranks x {args.per_rank} samples/step, {steps_n} steps per cell, seed "
        f"{args.seed}. Encoders: image ViT-L/14, audio USM-2B; cost = forward FLOPs "
        "(linear + attention quadratic) of the media tokens; text costs no encoder work.\n"
        "Mixture weights are token shares (image = OpenImages + RefCOCOg evenly; audio = "
        f"LibriSpeech; text = long text); media = {MEDIA_FRACTION:.0%} of a media sample's "
        f"tokens.\nBytes moved: 8 per text token (int64) + {MEDIA_REF_BYTES} per media sample "
        "(a pickled reference; the encoding rank reads the pixels itself).\n"
        "max/mean = busiest rank's encoder load / mean over all ranks, "
        "averaged over steps; bound = max over groups of max(group mean, largest item) (bound-eq: "
        "the largest item's rank also holds the n/k-1 lightest); kk-eq = balanced KK (runs of k), "
        "+sw = then improve_by_swaps (what plan_reorder does by default); ms = planning time "
        "per group per step (each rank plans its own group); KB = all-to-all kilobytes per step, "
        "all groups.\n"
    )
    header = (
        f"{'mix':>8} {'group':>5} | {'none':>5} {'lpt':>5} {'kk':>5} {'kk-eq':>5} "
        f"{'kk-eq+sw':>8} | {'bound':>5} {'bd-eq':>5} | {'kk/bd':>5} {'eq/bdeq':>7} | "
        f"{'ms kk':>6} {'ms eq+sw':>8} | {'KB kk':>6} {'KB eq+sw':>8}"
    )
    start = time.perf_counter()
    for label, mixture in MIXTURES.items():
        steps = draw_steps(
            mixture, ranks=ranks, per_rank=args.per_rank, steps=steps_n, seed=args.seed
        )
        print(header)
        for g in sizes:
            r = run(steps, g, costs)
            print(
                f"{label:>8} {g:>5} | {r['none']:5.3f} {r['lpt']:5.3f} {r['kk']:5.3f} "
                f"{r['kk-eq']:5.3f} {r['kk-eq+sw']:8.3f} | {r['bound']:5.3f} {r['bound-eq']:5.3f}"
                f" | {r['kk'] / r['bound']:5.3f} {r['kk-eq+sw'] / r['bound-eq']:7.3f} | "
                f"{r['ms kk']:6.2f} {r['ms kk-eq+sw']:8.2f} | {r['KB kk']:6.0f} "
                f"{r['KB kk-eq+sw']:8.0f}"
            )
        print()
    print(f"total {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
