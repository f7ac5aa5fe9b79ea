"""Real-format data: data time per step with and without prefetch, and decoding throughput.

Generates the llava-tiny dataset (examples/llava-tiny.yaml) with images of a chosen size, then
runs ``omni train`` on it twice, side by side: decoding on the training thread
(``prefetch.workers: 0``) and in worker threads with one step of read-ahead (the default). It
prints each run's mean ``data`` phase per step (rank 0's breakdown), its step time, and checks
both train the same loss curve. Then it decodes and preprocesses the dataset's images on one
thread and on one thread per core: images per second per core.
Run: ``make bench-data`` or ``python bench/data.py [--steps 30] [--image-size 448]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from omni_trainer.data.media import ImageSettings
from omni_trainer.data.tinyset import make_tiny_dataset

REPO = Path(__file__).resolve().parents[1]


def _train(doc: dict, workers: int, steps: int, out: Path) -> dict:
    doc = json.loads(json.dumps(doc))
    doc["spec"]["trainer"]["data"]["prefetch"] = {"workers": workers}
    job = out / f"job-{workers}.yaml"
    job.write_text(yaml.safe_dump(doc))
    summary = out / f"summary-{workers}.json"
    # omni's stand-in: it forks from a zygote when one is named (the test suite's), else it runs
    # as `python -m omni_trainer.cli` would; data time is measured per step, not at the start
    cmd = [sys.executable, "-m", "omni_trainer.warm", "train", str(job), "--steps", str(steps)]
    proc = subprocess.run([*cmd, "--summary", str(summary)], capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    return json.loads(summary.read_text())


def _decode_rate(paths: list[str], settings: ImageSettings, threads: int) -> float:
    start = time.perf_counter()
    if threads == 1:
        for p in paths:
            settings.resized(p)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(settings.resized, paths))
    return len(paths) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--images", type=int, default=400)
    ap.add_argument("--image-size", type=int, default=448, help="side of the drawn images")
    ap.add_argument("--smoke", action="store_true", help="2 steps, 10 images of 64 px")
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.images, args.image_size = 2, 10, 64
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        data = out / "data"
        make_tiny_dataset(
            str(data), images=args.images, audio=args.images // 5, size=args.image_size
        )
        doc = yaml.safe_load((REPO / "examples" / "llava-tiny.yaml").read_text())
        doc["spec"]["trainer"]["tokenizer"] = str(data / "tokenizer")
        doc["spec"]["trainer"]["data"]["sources"][0]["url"] = str(data / "train.json")
        runs = {w: _train(doc, w, args.steps, out) for w in (0, 2)}
        same = runs[0]["loss_curve"] == runs[2]["loss_curve"]
        budget = doc["spec"]["trainer"]["data"]["media"]["maxPixels"]
        print(f"llava-tiny, {args.steps} steps, {args.image_size}px images -> <= {budget} pixels")
        print(f"{'prefetch':<28}{'data s/step':>12}{'step s':>10}{'data share':>12}")
        for w, s in runs.items():
            data_s = s["breakdown"][0]["data_s"]
            label = "off (training thread)" if w == 0 else f"{w} workers, read-ahead 1"
            print(f"{label:<28}{data_s:>12.4f}{s['mean_step_time_s']:>10.4f}"
                  f"{data_s / s['mean_step_time_s']:>12.1%}")  # fmt: skip
        ratio = runs[0]["breakdown"][0]["data_s"] / max(runs[2]["breakdown"][0]["data_s"], 1e-9)
        print(f"data time without / with prefetch: {ratio:.1f}x; same loss curve: {same}")
        paths = sorted(str(p) for p in (data / "images").iterdir())
        settings = ImageSettings(max_pixels=14 * 14 * 64, patch_size=14, merge_size=1)
        cores = os.cpu_count() or 1
        one = _decode_rate(paths, settings, 1)
        many = _decode_rate(paths, settings, cores)
        print(f"decode + resize + normalize ({args.image_size}px PNG/JPEG): {one:.0f} images/s "
              f"on one thread; {many:.0f} images/s on {cores} threads = "
              f"{many / cores:.0f} images/s per core")  # fmt: skip
        if not same:
            raise SystemExit("prefetch changed the loss curve")


if __name__ == "__main__":
    main()
