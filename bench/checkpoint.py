"""Checkpoint costs the training loop sees: async loader snapshots and cached DCP save plans.

Part 1 (this process): a synthetic JSON-safe loader state of 1 MB and 100 MB (1 GB with
``--big``), saved the way ``Checkpointer`` does it (in-memory snapshot on the loop, JSON +
fsync'ed write on a background thread) next to a synchronous save of the same state (JSON +
fsync'ed write on the loop). Reported: the loop's blocking time of each and their ratio.

Part 2 (a 2-rank torchrun launched from here): the same model-like state (many tensors per rank)
saved ``--saves`` times with torch DCP, plan caching on and off: first save vs the mean of the
later ones. Run: ``make bench-checkpoint`` or ``python bench/checkpoint.py [--big] [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from omni_trainer.launch import warm_torchrun_argv

MB = 1 << 20


def synthetic_loader_state(nbytes: int, seed: int = 0) -> dict:
    """A loader-like state whose JSON is about ``nbytes``: cursors, mixture counters, a packing
    buffer of sample keys and a long list of ints (pending sample ids / token counts)."""
    rng = random.Random(seed)
    keys = [[rng.randrange(8), rng.randrange(10**6), rng.randrange(4)] for _ in range(1000)]
    ids_bytes = max(nbytes - 20_000, 0)
    return {
        "version": 1,
        "cursors": [rng.randrange(10**9) for _ in range(64)],
        "mixer": {"total": 1.5e9, "tokens": {"image": 3.0e8, "audio": 9.1e8, "text": 2.9e8}},
        "buffer": keys,
        "pending_ids": [rng.randrange(10**6, 10**7) for _ in range(ids_bytes // 8)],
    }


def loop_stall(saver) -> float:
    """Longest gap between 1 ms ticks of this (the loop's) thread while the background job runs:
    what the GIL lets the job take from a training loop that keeps running Python."""
    worst, last = 0.0, time.perf_counter()
    while saver.busy:
        time.sleep(0.001)
        now = time.perf_counter()
        worst, last = max(worst, now - last - 0.001), now
    return worst


def bench_loader(sizes_mb: list[int], root: Path) -> list[dict]:
    from omni_trainer.checkpoint.async_save import BackgroundSaver
    from omni_trainer.checkpoint.loader_state import serialize, snapshot
    from omni_trainer.checkpoint.storage import FilesystemStorage

    storage = FilesystemStorage(root / "loader")
    saver = BackgroundSaver()
    saver.submit(time.sleep, 0)  # start the worker thread: a training run has done so long ago
    saver.wait()
    rows = []
    for i, size in enumerate(sizes_mb):
        state = synthetic_loader_state(size * MB, seed=i)

        def write(step: int, snap: dict) -> float:
            t = time.perf_counter()
            storage.write_bytes(step, "loader/rank-00000.json", serialize(snap))
            return time.perf_counter() - t

        t0 = time.perf_counter()  # async: the loop pays the snapshot and the hand-off
        saver.submit(write, 2 * i, snapshot(state))
        async_block = time.perf_counter() - t0
        stall = loop_stall(saver)
        background = saver.wait()
        t0 = time.perf_counter()  # sync: the loop pays serialization and the write
        data = serialize(state)
        storage.write_bytes(2 * i + 1, "loader/rank-00000.json", data)
        sync_block = time.perf_counter() - t0
        rows.append(
            {
                "state_mb": round(len(data) / MB, 1),
                "async_blocking_ms": async_block * 1e3,
                "async_background_ms": background * 1e3,
                "loop_stall_ms": stall * 1e3,
                "sync_blocking_ms": sync_block * 1e3,
                "ratio": sync_block / async_block,
            }
        )
        del state, data
    saver.close()
    return rows


def plan_worker(out: Path, tensors: int, kb: int, saves: int) -> None:
    """Under torchrun: time ``saves`` DCP saves per planner setting (rank 0 writes the JSON)."""
    import torch
    import torch.distributed as dist

    from omni_trainer.checkpoint.async_save import make_planner, save_dcp

    dist.init_process_group("gloo")
    group = dist.new_group(backend="gloo")
    rank = dist.get_rank()
    numel = kb * 1024 // 4
    state = {f"layer{i}.rank{rank}.w": torch.randn(numel) for i in range(tensors)}
    state.update({f"shared.{i}": torch.ones(8) for i in range(tensors // 4)})  # deduplicated
    result = {}
    for cache in (False, True):
        planner = make_planner(cache_plans=cache, key=f"bench-{cache}")
        times = []
        for n in range(saves):
            dist.barrier(group)
            t = time.perf_counter()
            save_dcp(state, out / f"cache{int(cache)}" / f"save{n}", planner=planner, group=group)
            times.append(time.perf_counter() - t)
        slowest = [0.0] * len(times)
        for i, v in enumerate(times):  # the save takes as long as its slowest rank
            box = torch.tensor([v])
            dist.all_reduce(box, op=dist.ReduceOp.MAX, group=group)
            slowest[i] = float(box)
        result["on" if cache else "off"] = slowest
    if rank == 0:
        (out / "plan.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def bench_plans(root: Path, *, tensors: int, kb: int, saves: int, nproc: int) -> dict:
    # workers fork from a zygote when one is named (the test suite's): saves are timed, not starts
    cmd = warm_torchrun_argv(nproc, "--entry=script", __file__, "--plan-worker", str(root),
                             f"--tensors={tensors}", f"--kb={kb}", f"--saves={saves}")  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ})
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-4000:])
    return json.loads((root / "plan.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--big", action="store_true", help="also a 1 GB loader state (~8 GB RAM)")
    parser.add_argument("--quick", action="store_true", help="1 MB and 10 MB states only")
    parser.add_argument("--tensors", type=int, default=2000, help="tensors per rank (part 2)")
    parser.add_argument("--kb", type=int, default=8, help="KiB per tensor (part 2)")
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument(
        "--smoke", action="store_true", help="a 1 MB state, 2 x 20 tensors, 2 saves"
    )
    parser.add_argument("--plan-worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plan_worker:
        plan_worker(args.plan_worker, args.tensors, args.kb, args.saves)
        return
    if args.smoke:
        args.tensors, args.kb, args.saves = 20, 4, 2
    sizes = (
        [1, 10] if args.quick else [1] if args.smoke else [1, 100] + ([1024] if args.big else [])
    )
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as tmp:
        root = Path(tmp)
        print("Loader state: training-loop blocking time, async snapshot vs synchronous save")
        print(
            f"{'state':>9} {'async block':>12} {'(background':>12} {'max stall)':>11} "
            f"{'sync block':>11} {'ratio':>7}"
        )
        for r in bench_loader(sizes, root):
            print(
                f"{r['state_mb']:>7.1f}MB {r['async_blocking_ms']:>10.2f}ms "
                f"{r['async_background_ms']:>10.1f}ms {r['loop_stall_ms']:>9.1f}ms "
                f"{r['sync_blocking_ms']:>9.1f}ms "
                f"{r['ratio']:>6.0f}x"
            )
        plans = bench_plans(
            root, tensors=args.tensors, kb=args.kb, saves=args.saves, nproc=args.nproc
        )
    mb = args.tensors * args.kb / 1024
    print(
        f"\nDCP saves, {args.nproc} ranks x {args.tensors} tensors ({mb:.0f} MB/rank), "
        f"slowest rank, {args.saves} saves"
    )
    print(f"{'plan cache':>10} {'first':>9} {'later (mean)':>13} {'first/later':>12}")
    for key in ("off", "on"):
        first, later = plans[key][0], statistics.mean(plans[key][1:])
        print(f"{key:>10} {first * 1e3:>7.0f}ms {later * 1e3:>11.0f}ms {first / later:>11.2f}x")
    off_later, on_later = statistics.mean(plans["off"][1:]), statistics.mean(plans["on"][1:])
    print(f"later saves, cache off / on: {off_later / on_later:.2f}x")


if __name__ == "__main__":
    main()
