"""One of two gloo processes of ``test_strict.py``: each scenario communicates as a rank might,
then audits; what the audit raised (or None) goes to ``argv[1]/rank<R>.json``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from omni_trainer.distributed import strict

strict.install()  # before anything else, as init_distributed does
dist.init_process_group("gloo")
rank, peer = dist.get_rank(), 1 - dist.get_rank()
sizes = (3, 5) if rank == 0 else (5, 3)  # what this rank sends, what it receives


def send_then_receive() -> None:  # both ranks: gloo completes it, NCCL may not
    work = dist.isend(torch.zeros(sizes[0]), peer)
    dist.irecv(torch.empty(sizes[1]), peer).wait()
    work.wait()


def mirrored() -> None:  # the lower rank sends first, the higher receives first
    if rank == 0:
        dist.isend(torch.zeros(sizes[0]), peer).wait()
        dist.irecv(torch.empty(sizes[1]), peer).wait()
    else:
        work = dist.irecv(torch.empty(sizes[1]), peer)
        dist.isend(torch.zeros(sizes[0]), peer).wait()
        work.wait()


def batched() -> None:
    ops = [
        dist.P2POp(dist.isend, torch.zeros(sizes[0]), peer),
        dist.P2POp(dist.irecv, torch.empty(sizes[1]), peer),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def skipped_collective() -> None:  # rank 1 never enters the side group's second all-reduce
    side = dist.new_group([0, 1])
    dist.all_reduce(torch.ones(4), group=side)
    if rank == 0:
        dist.all_reduce(torch.ones(4), group=side, async_op=True)


def batch_by_a_subset() -> None:  # a batch is the group's first operation on rank 0 only
    side = dist.new_group([0, 1])
    if rank == 0:
        ops = [dist.P2POp(dist.isend, torch.zeros(2), peer, group=side)]
        dist.batch_isend_irecv(ops)[0].wait()
    else:
        dist.irecv(torch.empty(2), peer, group=side).wait()
    dist.all_reduce(torch.ones(1), group=side)


def pair_after_warm_up() -> None:
    side = dist.new_group([0, 1])
    strict.end_warm_up()
    if rank == 0:
        dist.isend(torch.zeros(1), peer, group=side).wait()
    else:
        dist.irecv(torch.empty(1), peer, group=side).wait()


results = {}
for scenario in (
    mirrored,
    send_then_receive,
    batched,
    skipped_collective,
    batch_by_a_subset,
    pair_after_warm_up,
):
    scenario()
    try:
        strict.audit()
        results[scenario.__name__] = None
    except strict.StrictCollectiveError as e:
        results[scenario.__name__] = str(e)
(Path(sys.argv[1]) / f"rank{rank}.json").write_text(json.dumps(results))
sys.stdout.flush()
os._exit(0)  # the skipped all-reduce is still pending: no teardown
