"""Two real processes (gloo): a store that fails for one rank only (rank 0 cannot list it)
does not deadlock the background save. Every rank runs the same collectives whatever fails
where: the save ends uncommitted on both ranks, and the next one commits. (Rank 0 used to skip
the barrier its peer waited in, and the save thread of each hung forever.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from .harness import free_port

pytestmark = pytest.mark.dist


def _worker(rank: int, port: int, root: str, out: dict) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    import torch.distributed as dist

    from omni_trainer.checkpoint.checkpointer import Checkpointer
    from omni_trainer.checkpoint.config import CheckpointConfig
    from omni_trainer.checkpoint.state import ModelState

    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        state = ModelState(llm={}, replicated=dict(model.named_parameters()), optimizer=opt)
        ckpt = Checkpointer(CheckpointConfig(path=root, staging_dir=f"{root}-scratch"))
        real = ckpt.storage.list_steps
        down = {"on": rank == 0}

        def list_steps() -> list[int]:
            if down["on"]:
                raise ConnectionError("injected: the store refuses rank 0")
            return real()

        ckpt.storage.list_steps = list_steps  # type: ignore[method-assign]
        ckpt.save(1, state, {"step": 1})
        first = ckpt.wait()
        down["on"] = False
        ckpt.save(2, state, {"step": 2})
        second = ckpt.close()
        out[rank] = (first.committed, first.errors, second.committed)
    finally:
        dist.destroy_process_group()


def test_a_store_failing_for_one_rank_fails_the_save_on_all_and_the_next_commits(
    tmp_path: Path,
) -> None:
    with mp.Manager() as manager:
        out = manager.dict()
        ctx = mp.spawn(_worker, args=(free_port(), str(tmp_path / "ck"), out), nprocs=2,
                       join=False)  # fmt: skip
        deadline = 60
        for p in ctx.processes:
            p.join(deadline)
        alive = [p.pid for p in ctx.processes if p.is_alive()]
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        assert not alive, "the save deadlocked"
        results = dict(out)
    for rank in (0, 1):
        committed, errors, next_committed = results[rank]
        assert not committed and next_committed, results[rank]
        assert any("injected" in e for e in errors), errors
