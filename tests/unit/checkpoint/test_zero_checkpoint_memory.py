"""A ZeRO-1 rank at dp8 saves and loads only its shard: measured tensor bytes per rank.

One process plays rank 0 of 8 through PyTorch's fake process group (collectives return without
data). The whole save (checkpoint view, host copies, DCP write) and the whole load (targets, DCP
read, the bucketed all-gather of the weights) run under a dispatch mode that tracks the peak of
tensor storage they create and keep alive. The bound: a rank's share of the fp32 main weights
and both Adam moments (12 bytes per parameter / dp) plus one fp32 bucket.
"""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import default_planner
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from omni_trainer.checkpoint.state import ModelState, load_targets, staged_state_dict
from omni_trainer.components.distributed_optimizer import DistributedMainParams

DP = 8
BUCKET = 40_000  # elements


class PeakTensorBytes(TorchDispatchMode):
    """Peak bytes of tensor storage created inside the mode and still referenced from Python
    (views of a storage keep it counted; storages that existed before are not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, list[int]] = {}  # storage address -> [bytes, live tensors]
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t, inputs)
        return out

    def _track(self, t: torch.Tensor, inputs: set[int]) -> None:
        storage = t.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if key not in self.live:
            if key in inputs or size == 0:
                return  # in place or a view of a storage made before the mode
            self.live[key] = [size, 0]
            self.now += size
            self.peak = max(self.peak, self.now)
        self.live[key][1] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        entry = self.live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[key]


def _rank_zero_of_dp8(
    dtype: torch.dtype,
) -> tuple[dict[str, nn.Parameter], DistributedMainParams, torch.optim.Optimizer]:
    """Rank 0's parameters, ZeRO-1 main slices and optimizer after one step."""
    torch.manual_seed(0)
    shapes = [(96, 512), (512,), (512, 384), (384, 96), (7, 13), (1000,)] * 3
    params = {f"w{i}": nn.Parameter(torch.randn(s, dtype=dtype)) for i, s in enumerate(shapes)}
    main = DistributedMainParams(list(params.values()), group=dist.group.WORLD, bucket_numel=BUCKET)
    optimizer = torch.optim.AdamW(main.main, lr=1e-2, foreach=True)
    for m in main.main:
        m.grad.copy_(torch.randn_like(m))
    optimizer.step()
    return params, main, optimizer


def _state(
    params: dict[str, nn.Parameter], main: DistributedMainParams, optimizer: torch.optim.Optimizer
) -> ModelState:
    """What ``ModelState.from_trainer`` builds of an LLM-only trainer."""
    view = main.checkpoint_view(optimizer)
    return ModelState(
        llm={n: view.full.get(id(p), p) for n, p in params.items()},
        replicated={},
        optimizer=view.optimizer,
        loaded=view.loaded,
        flat={n: view.flat[id(p)] for n, p in params.items()},
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_and_load_allocate_one_shard_plus_one_bucket(
    fake_world: int, tmp_path: Path, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    # DCP plans rank 0 alone (its planner would hand the fake peers' copies of rank 0's plan
    # some of its writes): the files hold rank 0's chunks, not whole tensors
    monkeypatch.setattr(default_planner, "_validate_global_plan", lambda *_: [])
    params, main, optimizer = _rank_zero_of_dp8(dtype)
    optimizer_bytes = 12 * sum(p.numel() for p in params.values())  # fp32 main, exp_avg(_sq)
    budget = optimizer_bytes / DP + 4 * max(b.size for b in main.buckets)
    before = {
        id(m): {k: v.clone() for k, v in optimizer.state[m].items()} | {"w": m.clone()}
        for m in main.main
    }

    with PeakTensorBytes() as saving:
        dcp.save(
            staged_state_dict(_state(params, main, optimizer)), checkpoint_id=tmp_path, no_dist=True
        )
    with torch.no_grad():
        for m in main.main:
            m.zero_()
    optimizer.state.clear()
    reader = dcp.FileSystemReader(tmp_path)
    available = {
        k: (meta.size, meta.properties.dtype)
        for k, meta in reader.read_metadata().state_dict_metadata.items()
    }
    for name, p in params.items():  # the weights only other ranks of the fake world hold
        available.setdefault(f"model.{name}", (p.shape, torch.float32))
    with PeakTensorBytes() as loading:
        targets, apply = load_targets(_state(params, main, optimizer), available)
        dcp.load(targets, storage_reader=reader, no_dist=True)
        apply()

    for ratio in (saving.peak / (optimizer_bytes / DP), loading.peak / (optimizer_bytes / DP)):
        print(f"peak / (optimizer state / dp): {ratio:.3f}")
    assert saving.peak <= budget, (saving.peak, budget)
    assert loading.peak <= budget, (loading.peak, budget)
    for m in main.main:  # the shard came back (the fake group moves no data between ranks)
        loaded = {k: v for k, v in optimizer.state[m].items()} | {"w": m}
        assert all(torch.equal(loaded[k].cpu(), v) for k, v in before[id(m)].items())
