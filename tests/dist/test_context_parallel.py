"""Context parallelism with adaptive sample sharding is the same training as one process.

Real torchrun processes (gloo, CPU): each CP rank holds whole short samples and zig-zag chunks of
long ones (``balance.cp``), attention gathers keys and values over the CP group, RoPE uses each
token's position in its unsharded row, and encoder outputs land on the CP rank holding their
positions. Tolerance as for the other layouts: every step's loss within 1e-6, every gradient after
the first step within 1e-5 absolute + 1e-4 relative.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from ..conftest import EXAMPLES
from .harness import assert_same_training, launch, run_reference

pytestmark = pytest.mark.dist

STEPS = 3
LAYOUTS = {  # world size -> (name, tensor, pipeline) with context 2; data parallel is the rest
    2: [("cp2", 1, 1)],
    4: [("dp2xcp2", 1, 1), ("pp2xcp2", 1, 2), ("tp2xcp2", 2, 1)],
}


def job(tensor: int = 1, pipeline: int = 1, context: int = 1) -> dict:
    doc = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    trainer = doc["spec"]["trainer"]
    trainer["data"]["microBatchSize"] = 2  # two 256-token rows: 256 tokens per CP rank
    trainer["optimizer"]["clipGrad"] = 0.0  # compare raw gradients
    trainer["data"]["mixture"] = [{"atTokens": 0, "weights": {"image": 1, "audio": 1, "text": 1}}]
    trainer["parallelism"] = {
        "tensor": tensor,
        "pipeline": pipeline,
        "context": context,
        "encoder": {"eta": 16},
    }
    return doc


@pytest.fixture(scope="module")
def reference() -> dict:
    return run_reference(job(), STEPS)


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def launched(request, tmp_path_factory) -> tuple[int, Path]:
    world = request.param
    scenarios = {name: job(tp, pp, context=2) for name, tp, pp in LAYOUTS[world]}
    return world, launch(world, scenarios, STEPS, tmp_path_factory.mktemp(f"cp-world{world}"))


def test_context_parallel_layouts_equal_one_process(launched, reference) -> None:
    world, out = launched
    for name, *_ in LAYOUTS[world]:
        assert_same_training(out / name, reference)


def test_long_samples_are_sharded_and_short_ones_kept_whole(launched) -> None:
    """Guards the comparison: the runs really split samples, media ones included."""
    world, out = launched
    for name, *_ in LAYOUTS[world]:
        plans = [
            plan
            for f in sorted((out / name).glob("data*.json"))
            for step in json.loads(f.read_text())["context"]
            for plan in step
        ]
        samples = [s for plan in plans for s in plan["samples"]]
        sharded = {m for m, _, holders in samples if len(holders) > 1}
        whole = {m for m, _, holders in samples if len(holders) == 1}
        assert "text" in sharded and {"image", "audio"} <= whole, (name, sharded, whole)
        assert sharded & {"image", "audio"}, (name, sharded)  # media rows split over CP ranks
        assert all(max(p["tokens"]) <= 256 for p in plans), name
