"""Two real gloo processes: the rank that waits for a slow peer in a collective counts that wait
as blocked time (not busy time), and the busy-time gather brings each node's median to rank 0."""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SLOW_S = 0.5


def _worker(rank: int, store: str, out: dict) -> None:
    from omni_trainer.components.stragglers import BusyTracker
    from omni_trainer.distributed import comm

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        before = comm.blocked_seconds()
        if rank == 1:
            time.sleep(SLOW_S)  # the slow node works while rank 0 waits in the all-reduce
        comm.all_reduce(torch.ones(1))
        tracker = BusyTracker(node_rank=rank, every=2, window=4)
        tracker.observe(1, 0.1 + rank)
        out[rank] = (comm.blocked_seconds() - before, tracker.observe(2, 0.1 + rank))
    finally:
        dist.destroy_process_group()


def test_a_wait_for_a_slow_peer_is_blocked_time_and_nodes_are_gathered(tmp_path: Path) -> None:
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(str(tmp_path / "store"), out), nprocs=2, join=True)
        (waited0, nodes0), (waited1, nodes1) = out[0], out[1]
    assert waited0 >= 0.8 * SLOW_S > waited1  # the fast rank waited, the slow one did not
    assert nodes0 == nodes1 == {0: 0.1, 1: 1.1}
