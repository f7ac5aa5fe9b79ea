"""Insertion policies side by side: where each pipeline stage spends a step, and encoder memory.

Runs ``omni train`` (real torchrun processes) on the same job once per policy and prints, per
stage, the mean seconds per step in encoder work, LLM compute, waiting (for encoder outputs or
gradients, and for pipeline neighbours), and the peak bytes encoder forwards keep for backward.
The machine is shared and noisy: compare the ratios of one run, not absolute figures.

    make bench-multiplex            # pp2 on 2 processes
    python bench/multiplex.py --pipeline 4 --nproc 4 --steps 6
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
POLICIES = ("uniform", "front_loaded", "stage0")


def bench_job(pipeline: int, eta: int) -> dict:
    """An image-heavy job where the encoders cost a real share of the step."""
    doc = yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())
    t = doc["spec"]["trainer"]
    t["model"]["llm"]["numLayers"] = 4
    t["model"]["encoders"]["image"] = {"preset": "vit-tiny", "hiddenSize": 128, "numLayers": 4}
    t["data"].update(seqLength=512, globalBatchSize=8, microBatchSize=1)
    t["data"]["sources"] = [
        {
            "kind": "synthetic",
            "name": "openimages",
            "modality": "image",
            "preset": "openimages",
            "lengthScale": 0.06,
        },
        {
            "kind": "synthetic",
            "name": "longtext",
            "modality": "text",
            "preset": "longtext",
            "lengthScale": 0.02,
        },
    ]
    t["data"]["mixture"] = [{"atTokens": 0, "weights": {"image": 7, "text": 3}}]
    t["parallelism"] = {"pipeline": pipeline, "encoder": {"eta": eta}}
    return doc


def run(doc: dict, policy: str, nproc: int, steps: int, workdir: Path) -> dict:
    doc["spec"]["trainer"]["parallelism"]["encoder"]["policy"] = policy
    manifest, summary = workdir / f"{policy}.yaml", workdir / f"{policy}.json"
    manifest.write_text(yaml.safe_dump(doc))
    cmd = [
        sys.executable,
        "-m",
        "omni_trainer.cli",
        "train",
        str(manifest),
        "--steps",
        str(steps),
        "--nproc",
        str(nproc),
        "--summary",
        str(summary),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{policy}: omni train failed\n{proc.stderr[-3000:]}")
    return json.loads(summary.read_text())


def per_stage(summary: dict) -> dict[int, dict[str, float]]:
    """Mean over the ranks of each stage."""
    stages: dict[int, list[dict]] = {}
    for r in summary["breakdown"]:
        stages.setdefault(r["stage"], []).append(r)
    out = {}
    for stage, rows in sorted(stages.items()):

        def mean(key: str, rows=rows) -> float:
            return sum(r[key] for r in rows) / len(rows)

        out[stage] = {
            "encoder": mean("encoder_s"),
            "llm": mean("llm_s"),
            "waiting": mean("encoder_wait_s") + mean("pipeline_wait_s"),
            "other": mean("data_s") + mean("sync_s"),
            "peak_mib": max(r["encoder_activation_peak_bytes"] for r in rows) / 2**20,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pipeline", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--eta", type=int, default=256)
    args = ap.parse_args()
    doc = bench_job(args.pipeline, args.eta)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for policy in POLICIES:
            results[policy] = run(doc, policy, args.nproc, args.steps, Path(tmp))
    print(
        f"pp={args.pipeline} on {args.nproc} processes, {args.steps} steps (first excluded), "
        "seconds per step, mean over a stage's ranks"
    )
    print(
        f"{'policy':<13}{'stage':>6}{'encoder':>9}{'llm':>8}{'waiting':>9}{'other':>8}"
        f"{'peak enc act MiB':>18}"
    )
    for policy, summary in results.items():
        for stage, row in per_stage(summary).items():
            print(
                f"{policy:<13}{stage:>6}{row['encoder']:>9.3f}{row['llm']:>8.3f}"
                f"{row['waiting']:>9.3f}{row['other']:>8.3f}{row['peak_mib']:>18.2f}"
            )
        print(
            f"{'':<13}{'step':>6}{summary['mean_step_time_s']:>9.3f} s   "
            f"{summary['tokens_per_second']:,.0f} tok/s"
        )
    base = results["uniform"]
    base_peak = max(r["peak_mib"] for r in per_stage(base).values())
    for other in ("front_loaded", "stage0"):
        o = results[other]
        o_peak = max(r["peak_mib"] for r in per_stage(o).values())
        speed = o["mean_step_time_s"] / base["mean_step_time_s"]
        print(
            f"uniform vs {other:<13} step time x{speed:.2f} (>1: uniform faster), "
            f"peak encoder activations x{o_peak / base_peak:.2f} (>1: uniform smaller)"
        )
    losses = {p: r["loss_curve"] for p, r in results.items()}
    same = all(
        abs(a - b) < 1e-5
        for c in losses.values()
        for a, b in zip(c, losses["uniform"], strict=True)
    )
    print(f"loss curves of the three policies equal within 1e-5: {same}")


if __name__ == "__main__":
    main()
