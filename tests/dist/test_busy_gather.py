"""Two real gloo processes: the busy-time gather brings each node's window median to every rank
(rank 0 serves it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, store: str, out: dict) -> None:
    from omni_trainer.components.stragglers import BusyTracker

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        tracker = BusyTracker(node_rank=rank, every=2, window=2, warmup=0)
        first = tracker.observe(1, 0.1 + rank)
        out[rank] = (first, tracker.observe(2, 0.3 + rank))
    finally:
        dist.destroy_process_group()


def test_the_gather_brings_every_nodes_median_every_n_steps(tmp_path: Path) -> None:
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(str(tmp_path / "store"), out), nprocs=2, join=True)
        results = [out[0], out[1]]
    assert [first for first, _ in results] == [None, None]  # not a gather step
    assert [nodes for _, nodes in results] == [{0: pytest.approx(0.2), 1: pytest.approx(1.2)}] * 2
