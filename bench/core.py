"""CPU tokens/s of the trainer core, before vs after, at the same layout, side by side in one run.

Runs ``omni train`` (real torchrun processes) on one job with two source trees, alternating
(before, after, before, after, ...) so that the shared machine's noise hits both alike, and
prints the median tokens/s of each and their ratio, per layout (pp2, and dp2 where this tree
runs ZeRO-1 by default). Then, on this tree only, the same job with bf16, with activation
recompute, and at dp2 with and without the distributed optimizer, and the summary's ``memory``
of each, so the trade-offs show.

``--overlap-rounds N`` instead compares, on this tree, dp2 ZeRO-1 with the gradient
reduce-scatter overlapped with the backward (``parallelism.overlapGradReduce``, the default)
and after it, alternating N times: median tokens/s and the ranks' mean ``sync`` seconds per
step (the exposed gradient sync), with ``--llm-layers`` to make the gradients larger.

    git worktree add /tmp/omni-before main   # the baseline tree (any commit)
    python bench/core.py --before /tmp/omni-before --rounds 3
    python bench/core.py --overlap-rounds 5 --llm-layers 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

import omni_trainer
from omni_trainer.warm import SOCKET_ENV

REPO = Path(__file__).resolve().parents[1]


LAYOUTS = {"pp2": 2, "dp2": 1}  # name -> pipeline stages, on --nproc 2


def bench_job(pipeline: int, layers: int = 4) -> dict:
    """The tiny example with 4 LLM layers at a fixed layout (fields every tree understands)."""
    doc = yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())
    t = doc["spec"]["trainer"]
    t["model"]["llm"]["numLayers"] = layers
    t["data"]["microBatchSize"] = 2  # 8 sequences: 4 micro-batches per replica at dp 1, 2 at dp 2
    t["parallelism"] = {"pipeline": pipeline}
    return doc


def run(tree: Path, doc: dict, *, nproc: int, steps: int, name: str, workdir: Path) -> dict:
    manifest, summary = workdir / f"{name}.yaml", workdir / f"{name}.json"
    manifest.write_text(yaml.safe_dump(doc))
    cmd = [sys.executable, "-m", "omni_trainer.cli", "train", str(manifest)]
    cmd += ["--steps", str(steps), "--nproc", str(nproc), "--summary", str(summary)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env_for(tree), cwd=tree)
    if proc.returncode:
        sys.exit(f"{name}: omni train failed\n{proc.stderr[-3000:]}")
    return json.loads(summary.read_text())


def _env_for(tree: Path) -> dict[str, str]:
    """A run's environment: this process's own when it imports ``tree``'s trainer (a zygote it
    names serves the run), else ``tree``'s source first on the import path and no zygote (one
    of another tree's code would decline: the run's launcher brings its own)."""
    if Path(omni_trainer.__file__).resolve().is_relative_to(tree.resolve()):
        return dict(os.environ)
    env = {**os.environ, "PYTHONPATH": f"{tree}/trainer:{tree}/operator"}
    env.pop(SOCKET_ENV, None)
    return env


def compare_overlap(*, rounds: int, steps: int, layers: int) -> None:
    """dp2 ZeRO-1, the gradient sync overlapped vs after the backward, alternating."""
    figures: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(rounds):
            for overlap in (True, False):
                d = bench_job(1, layers)
                d["spec"]["trainer"]["parallelism"].update(
                    distributedOptimizer=True, bucketSize=200_000, overlapGradReduce=overlap
                )
                name = f"dp2-{'overlap' if overlap else 'after'}{i}"
                s = run(REPO, d, nproc=2, steps=steps, name=name, workdir=Path(tmp))
                sync = statistics.mean(r["sync_s"] for r in s["breakdown"])
                figures[overlap].append((s["tokens_per_second"], sync))
    print(f"dp2 ZeRO-1, {layers} LLM layers, {steps} steps (first excluded), {rounds} rounds")
    for overlap, label in ((True, "overlapped"), (False, "after backward")):
        rates, syncs = zip(*figures[overlap], strict=True)
        print(
            f"  {label:<15} {statistics.median(rates):>8,.0f} tok/s  sync "
            f"{statistics.median(syncs):.4f} s/step  (rounds: "
            f"{', '.join(f'{r:,.0f}' for r in rates)})"
        )
    ratios = [a[0] / b[0] for a, b in zip(figures[True], figures[False], strict=True)]
    print(
        f"overlapped vs after-backward median tokens/s ratio {statistics.median(ratios):.3f} "
        f"(min {min(ratios):.3f}, max {max(ratios):.3f}, {rounds} rounds)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, help="the baseline source tree")
    ap.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), default=sorted(LAYOUTS))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--overlap-rounds", type=int, default=0)
    ap.add_argument("--llm-layers", type=int, default=4)
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="this tree as both (one run counted for both), pp2, 2 steps, dp2 ZeRO-1 beside",
    )
    args = ap.parse_args()
    if args.smoke:
        args.before = args.before or REPO
        args.layouts, args.steps, args.rounds = ["pp2"], 2, 1
    if args.overlap_rounds:
        compare_overlap(rounds=args.overlap_rounds, steps=args.steps, layers=args.llm_layers)
        return
    if args.before is None:
        ap.error("--before is required (or --overlap-rounds)")
    trees = {"before": args.before.resolve(), "after": REPO}
    rates = {(lay, k): [] for lay in args.layouts for k in trees}
    kw = {"nproc": 2, "steps": args.steps}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for lay in args.layouts:
                for label, tree in trees.items():
                    if args.smoke and label == "before":  # the same tree: its run is after's
                        continue
                    s = run(tree, bench_job(LAYOUTS[lay]), **kw, name=f"{lay}-{label}{i}",
                            workdir=Path(tmp))  # fmt: skip
                    rates[lay, label].append(s["tokens_per_second"])
                if args.smoke:
                    rates[lay, "before"] = rates[lay, "after"]
        variants = {}
        for label, pipeline, train, parallelism in [
            ("pp2 fp32", 2, {}, {}),
            ("pp2 bf16", 2, {"precision": "bf16"}, {}),
            ("pp2 selective", 2, {"recompute": "selective"}, {}),
            ("pp2 full", 2, {"recompute": "full"}, {}),
            ("dp2 plain", 1, {}, {"distributedOptimizer": False}),
            ("dp2 ZeRO-1", 1, {}, {"distributedOptimizer": True}),
            ("dp2 ZeRO-1 bf16", 1, {"precision": "bf16"}, {"distributedOptimizer": True}),
        ]:
            if args.smoke and label != "dp2 ZeRO-1":  # the other layout, the sharded optimizer
                continue
            d = bench_job(pipeline)
            d["spec"]["trainer"]["train"].update(train)
            d["spec"]["trainer"]["parallelism"].update(parallelism)
            variants[label] = run(REPO, d, **kw, name=label.replace(" ", "-"), workdir=Path(tmp))
    print(f"2 processes, {args.steps} steps (first excluded), {args.rounds} alternating rounds")
    for lay in args.layouts:
        before, after = (statistics.median(rates[lay, k]) for k in trees)
        cells = "   ".join(
            f"{k} {m:,.0f} tok/s ({', '.join(f'{r:,.0f}' for r in rates[lay, k])})"
            for k, m in (("before", before), ("after", after))
        )
        print(f"{lay}: {cells}   after / before = {after / before:.3f}")
    print(
        f"{'this tree':<18}{'tok/s':>10}{'final loss':>12}{'params MB':>11}{'grads MB':>10}"
        f"{'optim MB':>10}{'act peak MB':>13}"
    )
    for label, s in variants.items():
        m = s["memory"]
        print(
            f"{label:<18}{s['tokens_per_second']:>10,.0f}{s['final_loss']:>12.4f}"
            f"{m['params_bytes'] / 1e6:>11.2f}{m['grads_bytes'] / 1e6:>10.2f}"
            f"{m['optimizer_state_bytes'] / 1e6:>10.2f}{m['activation_peak_bytes'] / 1e6:>13.2f}"
        )


if __name__ == "__main__":
    main()
