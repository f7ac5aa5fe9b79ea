"""Calibration against reality: the planner's simulator, fed a CPU profile measured here, predicts
the tiny example's step time at world sizes 1, 2 and 4; ``omni train`` measures them (issue 8).

Every parameter is measured in this run, never chosen:
  * GEMM FLOP/s at the tiny model's own shapes (forward + both backward GEMMs), 1 thread and
    all-cores threads; attention FLOP/s likewise (SDPA forward + backward, FLOPs counted as the
    planner counts them);
  * gloo all-reduce alpha/beta, fitted to timed all-reduces of 4 sizes between 2 processes;
  * CPU overheads the FLOP model does not see, from the world-1 run's own breakdown:
    per step (data + clip/optimizer ``sync_s``) and per micro-batch (encoder + LLM time left
    over after the simulator's compute). World 1 is therefore the fitting point; 2 and 4 test.

One process = one device with its share of the cores (torchrun gives each 1 thread; world 4 puts
4 processes on 2 cores). The manifest is examples/tiny-cpu.yaml with microBatchSize 2 (4 does not
divide the 8-sequence batch over 4 ranks); the global batch is the same at every world size.

    make bench-calibrate
    python bench/calibrate.py --steps 10 --worlds 1 2 4
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import yaml

from omni_trainer.components.flops import attention_flops
from omni_trainer.config import load_manifest
from omni_trainer.planner.calibration import (
    CpuCalibration,
    cpu_rank_profile,
    fit_all_reduce_link,
    oversubscription,
    predicted_step_time,
)
from omni_trainer.planner.costs import Layout
from omni_trainer.planner.simulate import predict
from omni_trainer.planner.workloads import workload_from_config

REPO = Path(__file__).resolve().parents[1]
MICRO_BATCH = 2


def _timed(fn, *, min_s: float = 0.25, warmup: int = 2) -> float:
    """Median seconds per call over repeats adding up to about ``min_s``."""
    for _ in range(warmup):
        fn()
    times = []
    start = time.perf_counter()
    while time.perf_counter() - start < min_s or len(times) < 5:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def gemm_shapes(cfg) -> list[tuple[int, int, int]]:
    """(tokens, k, n) of every GEMM of one micro-batch: LLM layer + head, encoder layers."""
    llm = cfg.model.llm
    h, f = llm.hidden_size, llm.ffn_hidden_size
    hd = llm.head_dim
    qkv = (llm.num_attention_heads + 2 * llm.num_query_groups) * hd
    t = MICRO_BATCH * cfg.data.seq_length
    shapes = [(t, h, qkv), (t, h, h), (t, h, (2 if llm.gated_mlp else 1) * f), (t, f, h),
              (t, h, llm.vocab_size)]  # fmt: skip
    enc = cfg.model.encoders.image
    if enc is not None:
        he, fe = enc.hidden_size, enc.ffn_hidden_size
        te = t // 2  # about half of the positions are media at image:text 1:1
        shapes += [(te, he, 3 * he), (te, he, he), (te, he, fe), (te, fe, he), (te, he, h)]
    return shapes


def gemm_rate(shapes, threads: int) -> float:
    """FLOP/s of forward + both backward GEMMs of every shape at ``threads`` threads."""
    torch.set_num_threads(threads)
    flops = seconds = 0.0
    for t, k, n in shapes:
        x, w, g = torch.randn(t, k), torch.randn(k, n), torch.randn(t, n)

        def step(x=x, w=w, g=g):
            x @ w
            g @ w.T
            x.T @ g

        seconds += _timed(step)
        flops += 3 * 2.0 * t * k * n
    return flops / seconds


def attention_rate(cfg, threads: int) -> float:
    """FLOP/s of causal SDPA forward + backward over the sequence (the planner's FLOP count)."""
    torch.set_num_threads(threads)
    llm = cfg.model.llm
    s, heads, hd = cfg.data.seq_length, llm.num_attention_heads, llm.head_dim
    q, k, v = (torch.randn(MICRO_BATCH, heads, s, hd, requires_grad=True) for _ in range(3))

    def step():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    per = attention_flops(num_layers=1, num_heads=heads, head_dim=hd, seq_lengths=[s])
    return 3.0 * per * MICRO_BATCH / _timed(step)


def _allreduce_worker(rank: int, port: int, sizes: list[int], out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    res = []
    for nbytes in sizes:
        buf = torch.ones(nbytes // 4)
        for _ in range(3):
            dist.all_reduce(buf)
        times = []
        for _ in range(15):
            dist.barrier()
            t = time.perf_counter()
            dist.all_reduce(buf)
            times.append(time.perf_counter() - t)
        res.append(statistics.median(times))
    if rank == 0:
        out.put(res)
    dist.destroy_process_group()


def gloo_link(sizes: list[int]) -> tuple[list[float], float, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_allreduce_worker, args=(r, port, sizes, q)) for r in range(2)]
    for p in procs:
        p.start()
    times = q.get(timeout=120)
    for p in procs:
        p.join()
    alpha, bw = fit_all_reduce_link(sizes, times, n=2)
    return times, alpha, bw


def measure(manifest: Path, world: int, steps: int, tmp: Path) -> dict:
    out = tmp / f"w{world}.json"
    cmd = [str(Path(sys.executable).parent / "omni"), "train", str(manifest), "--steps",
           str(steps), "--nproc", str(world), "--summary", str(out)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"omni train --nproc {world} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    args = ap.parse_args()
    if args.worlds[0] != 1:
        sys.exit("--worlds must start with 1 (the overheads are measured there)")
    started = time.perf_counter()
    doc = yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())
    doc["spec"]["trainer"]["data"]["microBatchSize"] = MICRO_BATCH
    tmp = Path(tempfile.mkdtemp(prefix="omni-calibrate-"))
    manifest = tmp / "tiny-cpu-mb2.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    cfg = load_manifest(manifest).spec.trainer
    cores = os.cpu_count() or 1
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    shapes = gemm_shapes(cfg)
    g1, ga = gemm_rate(shapes, 1), gemm_rate(shapes, cores)
    a1, aa = attention_rate(cfg, 1), attention_rate(cfg, cores)
    sizes = [4 << 10, 256 << 10, 1 << 20, 4 << 20]
    ar_times, alpha, bw = gloo_link(sizes)

    measured = {w: measure(manifest, w, args.steps, tmp) for w in args.worlds}

    base = CpuCalibration(cores=cores, gemm_flops_1t=g1, gemm_flops_all=ga,
                          attention_flops_1t=a1, attention_flops_all=aa, alpha_s=alpha,
                          bandwidth=bw)  # fmt: skip
    sims = {}
    for w in args.worlds:
        workload = workload_from_config(cfg, world_size=w, name="tiny-cpu")
        layout = Layout(dp=w, micro_batch_size=MICRO_BATCH)
        dev = cpu_rank_profile(base, w, memory_bytes=memory)
        sims[w] = predict(workload, layout, device=dev, seed=cfg.seed)
    # Overheads from the world-1 run's breakdown (per-step means of its phases).
    b1 = measured[1]["breakdown"][0]
    mb1 = cfg.data.global_batch_size // MICRO_BATCH
    per_step = b1["data_s"] + b1["sync_s"]
    per_mb = max(0.0, (b1["encoder_s"] + b1["llm_s"] - sims[1].step_time) / mb1)
    cal = CpuCalibration(**{**base.__dict__, "overhead_per_microbatch_s": per_mb,
                            "overhead_per_step_s": per_step})  # fmt: skip

    print("# CPU calibration: planner simulator (uniform policy) vs omni train, tiny-cpu mb2")
    print(
        f"# cores {cores}; GEMM at model shapes: {g1 / 1e9:.1f} GFLOP/s (1 thread), "
        f"{ga / 1e9:.1f} ({cores} threads); attention {a1 / 1e9:.1f} / {aa / 1e9:.1f} GFLOP/s"
    )
    print(
        "# gloo all-reduce (2 procs) "
        + " ".join(f"{s >> 10}KiB:{t * 1e3:.2f}ms" for s, t in zip(sizes, ar_times, strict=True))
        + f" -> alpha {alpha * 1e6:.0f} us, bandwidth {bw / 1e9:.2f} GB/s"
    )
    print(
        f"# overheads from the world-1 breakdown: {per_step * 1e3:.1f} ms/step "
        f"(data {b1['data_s'] * 1e3:.1f} + sync {b1['sync_s'] * 1e3:.1f}), "
        f"{per_mb * 1e3:.1f} ms/micro-batch; {args.steps} steps per run, first excluded"
    )
    print(
        f"{'world':>5} {'layout':>6} {'GFLOP/s/rank':>12} {'oversub':>7} {'sim s':>7} "
        f"{'predicted s':>11} {'measured s':>10} {'pred/meas':>9}"
    )
    rows = []
    for w in args.worlds:
        mbr = cfg.data.global_batch_size // (w * MICRO_BATCH)
        pred = predicted_step_time(sims[w].step_time, cal, world_size=w, microbatches_per_rank=mbr)
        meas = measured[w]["mean_step_time_s"]
        dev = cpu_rank_profile(cal, w, memory_bytes=memory)
        rows.append({"world": w, "predicted_s": pred, "measured_s": meas, "ratio": pred / meas,
                     "simulated_s": sims[w].step_time})  # fmt: skip
        print(
            f"{w:>5} {measured[w]['layout']['name']:>6} {dev.peak_flops / 1e9:>12.1f} "
            f"{oversubscription(w, cores):>7.1f} {sims[w].step_time:>7.3f} {pred:>11.3f} "
            f"{meas:>10.3f} {pred / meas:>9.2f}"
        )
    ok = all(abs(r["ratio"] - 1) <= 0.25 for r in rows)
    print(
        f"# within 25% at every world size: {'yes' if ok else 'NO'} "
        f"(world 1 is the overhead fitting point); bench took {time.perf_counter() - started:.0f} s"
    )
    (tmp / "calibration.json").write_text(json.dumps({"calibration": cal.__dict__, "rows": rows}))
    print(f"# details: {tmp / 'calibration.json'}")


if __name__ == "__main__":
    main()
