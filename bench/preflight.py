"""What the network preflight adds to an attempt: three processes, one per emulated node (gloo on
the loopback), run ``spec.preflight``'s check at several sizes, healthy and with one node's
exchanges 50 ms late. Reported per size: the seconds the check took (the cost added before step
1), the node figures, the bus bandwidths, and the slow node's figure over the median (the margin
the 0.5x rule has). Run: ``make bench-preflight`` or ``python bench/preflight.py [--sizes 1 16]``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict

WORLD = 3


def worker(size_mb: float, late_s: float) -> None:
    import torch.distributed as dist

    from omni_trainer.distributed.netcheck import run_preflight
    from omni_trainer.distributed.netcheck_rules import PreflightConfig

    dist.init_process_group("gloo")  # from the env measure() sets (megatron is not needed)
    rank = dist.get_rank()
    if rank == 1 and late_s:
        exchange = dist.batch_isend_irecv

        def late(ops):
            time.sleep(late_s)
            return exchange(ops)

        dist.batch_isend_irecv = late
    cfg = PreflightConfig(size_mb=size_mb, timeout_seconds=60)
    result = run_preflight(cfg, rank=rank, node=f"n{rank}")
    if rank == 0:
        print(json.dumps(asdict(result)), flush=True)
    dist.destroy_process_group()


def measure(size_mb: float, late_s: float) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(WORLD):
        env = os.environ | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                            "RANK": str(rank), "WORLD_SIZE": str(WORLD)}  # fmt: skip
        # ``python FILE``, forked from a zygote when one is named (the check is timed, not the
        # imports before it)
        argv = [sys.executable, "-m", "omni_trainer.warm", "--entry=script", __file__, "--worker",
                str(size_mb), str(late_s)]  # fmt: skip
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=600)[0] for p in procs]
    return json.loads(outs[0].strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=float, nargs="+", default=[1, 16, 64])
    parser.add_argument("--smoke", action="store_true", help="one size of 0.1 MiB")
    args = parser.parse_args()
    if args.smoke:
        args.sizes = [0.1]
    print(f"{'MiB':>5} {'case':>8} {'seconds':>8} {'all-reduce':>11} {'all-gather':>11} "
          f"{'n0':>7} {'n1':>7} {'n2':>7} {'n1/median':>9} failed")  # fmt: skip
    for size in args.sizes:
        for case, late in (("healthy", 0.0), ("n1 late", 0.05)):
            r = measure(size, late)
            n = r["nodes"]
            ratio = n["n1"] / r["median_gbps"] if r["median_gbps"] else float("nan")
            print(f"{size:>5g} {case:>8} {r['seconds']:>8.2f} {r['all_reduce_gbps']:>11.3f} "
                  f"{r['all_gather_gbps']:>11.3f} {n['n0']:>7.3f} {n['n1']:>7.3f} "
                  f"{n['n2']:>7.3f} {ratio:>9.2f} {','.join(r['failed']) or '-'}")  # fmt: skip
    print("GB/s; seconds: what the check adds before step 1 of an attempt")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(float(sys.argv[2]), float(sys.argv[3]))
    else:
        main()
