"""torchrun worker (4 ranks as 2 simulated nodes of 2): fast-tier saves with the peer copy over
gloo, then resumes after node losses. Each node's fast directory is ``<out>/node<i>``; rank r
owns (ZeRO-2 style, it alone writes) the optimizer state of ``w<r>``, so every rank's file
holds state only it wrote. Results: ``<out>/rank<r>.json``.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from omni_trainer.checkpoint.checkpointer import Checkpointer
from omni_trainer.checkpoint.config import CheckpointConfig
from omni_trainer.checkpoint.state import ModelState

LOCAL = 2


def build(seed: int, steps: int) -> ModelState:
    torch.manual_seed(seed)
    params = {f"w{i}": nn.Parameter(torch.randn(8, 8)) for i in range(dist.get_world_size())}
    opt = torch.optim.AdamW(params.values(), lr=1e-2, foreach=False)
    for _ in range(steps):
        sum((p**2).sum() for p in params.values()).backward()
        opt.step()
        opt.zero_grad()
    rank = dist.get_rank()
    return ModelState(
        llm={}, replicated=params, optimizer=opt, rank=rank, owned=frozenset({f"w{rank}"})
    )


def mine(state: ModelState) -> dict[str, torch.Tensor]:
    """What this rank must get back: every weight, and the optimizer state it owns."""
    out = {n: p.detach().clone() for n, p in state.replicated.items()}
    p = state.replicated[f"w{state.rank}"]
    out.update({f"opt.{k}": v.clone() for k, v in state.optimizer.state[p].items()})
    return out


def resume(cfg: CheckpointConfig, node: Path, expected: dict) -> dict:
    fresh = build(seed=7, steps=1)
    found = Checkpointer(cfg, fast_root=node, local_world=LOCAL).load_latest(fresh)
    got = mine(fresh)
    same = {k: bool(torch.equal(got[k], expected[found.step][k])) for k in got}
    return {"step": found.step, "loader": found.loader_state, "same": all(same.values())}


def lose(path: Path) -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    dist.barrier()


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    node = out / f"node{rank // LOCAL}"
    fast = {"path": str(out / "unused"), "intervalSteps": 1, "keepLast": 2}
    cfg = CheckpointConfig.model_validate(
        {"path": str(out / "pvc"), "intervalSteps": 2, "fast": fast}
    )
    ckpt = Checkpointer(cfg, fast_root=node, local_world=LOCAL)
    expected, results = {}, {}
    for step in (2, 3):
        state = build(seed=0, steps=step)
        expected[step] = mine(state)
        tier = cfg.tier_due(step)
        ckpt.save(step, state, {"step": step}, tier=tier)
        results[f"saved{step}"] = ckpt.wait().committed
    dist.barrier()  # the node's other rank may still be writing its copy of the marker
    results["files"] = sorted(
        p.relative_to(node).as_posix() for p in node.rglob("*") if p.is_file()
    )
    lose(out / "node1")  # ranks 2 and 3's disk: their shares survive as copies on node 0
    results["node1_lost"] = resume(cfg, node, expected)
    lose(out / "node0" / "step-00000003" / "model" / "__3_0.distcp")  # now rank 3's is gone too
    results["both_lost"] = resume(cfg, node, expected)
    ckpt.close()
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
