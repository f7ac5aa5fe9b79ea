"""A ZeRO-1 checkpoint written whole (gathered on every rank, as before ranks saved their own
slices: ``fixtures/zero1-gathered``, written by ``fixtures/write_zero1_gathered.py`` at commit
6fcc60e) loads into today's ZeRO-1 slices: at dp1, and as rank 0 of dp8 (the fake process
group), where the rank reads just its range of every tensor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from omni_trainer.checkpoint.state import ModelState, load_targets
from omni_trainer.components.distributed_optimizer import DistributedMainParams

FIXTURE = Path(__file__).with_name("fixtures") / "zero1-gathered"
SHAPES = {"w0": (6, 5), "b0": (5,), "w1": (4, 6)}  # as the fixture's writer


def _whole() -> dict[str, torch.Tensor]:
    """Every tensor of the fixture, read whole."""
    reader = dcp.FileSystemReader(FIXTURE)
    meta = reader.read_metadata().state_dict_metadata
    out = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()}
    dcp.load(out, storage_reader=reader, no_dist=True)
    return out


def _load_into_slices(group: dist.ProcessGroup | None) -> tuple[dict, DistributedMainParams, dict]:
    torch.manual_seed(1)  # other values than the fixture's
    params = {n: nn.Parameter(torch.randn(s).bfloat16()) for n, s in SHAPES.items()}
    zero = DistributedMainParams(list(params.values()), group=group, bucket_numel=16)
    optimizer = torch.optim.AdamW(zero.main, lr=1e-2)
    view = zero.checkpoint_view(optimizer)
    state = ModelState(
        llm={n: view.full.get(id(p), p) for n, p in params.items()},
        replicated={},
        optimizer=view.optimizer,
        loaded=view.loaded,
        flat={n: view.flat[id(p)] for n, p in params.items()},
    )
    reader = dcp.FileSystemReader(FIXTURE)
    available = {
        k: (m.size, m.properties.dtype)
        for k, m in reader.read_metadata().state_dict_metadata.items()
    }
    targets, apply = load_targets(state, available)
    dcp.load(targets, storage_reader=reader, no_dist=True)
    apply()
    return params, zero, optimizer.state


def _assert_slices_match(params: dict, zero: DistributedMainParams, state: dict) -> None:
    whole = _whole()
    names = list(params)
    assert zero.pieces, "this rank holds no range: the check would be empty"
    for piece, main in zip(zero.pieces, zero.main, strict=True):
        name = names[piece.index]
        part = slice(piece.lo, piece.hi)
        assert torch.equal(main.detach(), whole[f"model.{name}"].view(-1)[part]), name
        for slot in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[main][slot], whole[f"optim.{name}.{slot}"].view(-1)[part])
        assert torch.equal(state[main]["step"], whole[f"optim.{name}.step"])


@pytest.mark.parametrize("fake_world", [1, 8], indirect=True)
def test_a_gathered_checkpoint_loads_into_the_slices(fake_world: int) -> None:
    params, zero, state = _load_into_slices(dist.group.WORLD if fake_world > 1 else None)
    _assert_slices_match(params, zero, state)
    if fake_world == 1:  # the model weights: the main weights rounded to bf16
        whole = _whole()
        for name, p in params.items():
            assert torch.equal(p.detach(), whole[f"model.{name}"].bfloat16()), name
    else:  # rank 0 of dp8 read its ranges only
        assert sum(pc.hi - pc.lo for pc in zero.pieces) < sum(p.numel() for p in params.values())


@pytest.fixture(autouse=True)
def _fixture_exists() -> None:
    assert (FIXTURE / ".metadata").is_file(), FIXTURE
