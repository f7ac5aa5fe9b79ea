"""Ulysses sequence parallelism and LSSP in real torchrun processes (gloo) equal one rank.

One launch per world size (2 and 4 ranks) runs every scenario of ``_ulysses_worker.py``:
a long image (5x7 = 35 patches) and a long clip (37 tokens, conv kernel 15 wider than a shard),
both split unevenly; samples with fewer tokens than ranks (empty shards); a mixed LSSP batch
(short samples data parallel, long ones sequence parallel, the same encoder instance), for the ViT,
the Conformer and the Qwen2.5-VL tower (35 merged tokens of 4 patches each, window attention:
shards hold whole 2x2 blocks, the kernel sees the whole image), also with full and selective
recompute (blocks rerun in the backward with the mixer's sharded state restored); and the
heads-divisibility error.

Tolerance (fp32): 1e-5 absolute on the outputs (post-LayerNorm, O(1)) concatenated in rank order
against the single-rank encoding, and 1e-5 absolute on every parameter gradient of
``sum(out * w)`` (``w`` fixed random ~N(0, 1/numel), so gradients are O(1)), summed over ranks with
all_reduce, against the single-rank gradients. Only the summation order differs (observed <1e-6).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from omni_trainer.launch import warm_torchrun_argv
from tests.unit.interop.hf_models import QWEN_VISION

pytestmark = pytest.mark.dist

TOLERANCE = 1e-5
WORKER = Path(__file__).with_name("_ulysses_worker.py")
SCENARIOS = [
    *("vision_35", "audio_37", "vision_1", "audio_3", "lssp_vision", "lssp_audio"),
    *("lssp_vision_full", "lssp_audio_full", "lssp_audio_selective"),  # train.recompute
    *("qwen_35", "qwen_1", "lssp_qwen", "lssp_qwen_full", "lssp_qwen_selective"),
]


@pytest.fixture(scope="module", params=[2, 4], ids=["sp2", "sp4"])
def results(request, tmp_path_factory) -> dict:
    nproc = request.param
    root = tmp_path_factory.mktemp(f"ulysses{nproc}")
    out = root / "results.json"
    config = {"architectures": ["Qwen2_5_VisionTransformerPretrainedModel"],
              "model_type": "qwen2_5_vl_vision", **QWEN_VISION}  # fmt: skip
    (root / "config.json").write_text(json.dumps(config))
    proc = subprocess.run(
        warm_torchrun_argv(nproc, "--entry=script", str(WORKER), str(out), str(root)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["world_size"] == nproc
    return doc


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_sequence_parallel_equals_single_rank(results: dict, scenario: str) -> None:
    r = results[scenario]
    assert r["out"] <= TOLERANCE, r
    assert r["grad"] <= TOLERANCE, r
    assert r["zero_grads"] == []  # every parameter is exercised, so the grad check covers it


def test_shards_are_uneven_contiguous_and_may_be_empty(results: dict) -> None:
    expected = {
        2: {
            "vision_35": [18, 17],
            "audio_37": [19, 18],
            "vision_1": [1, 0],
            "audio_3": [2, 1],
            "qwen_35": [18, 17],
            "qwen_1": [1, 0],
        },
        4: {
            "vision_35": [9, 9, 9, 8],
            "qwen_35": [9, 9, 9, 8],
            "qwen_1": [1, 0, 0, 0],
            "audio_37": [10, 9, 9, 9],
            "vision_1": [1, 0, 0, 0],
            "audio_3": [1, 1, 1, 0],
        },
    }[results["world_size"]]
    assert {k: results[k]["sizes"] for k in expected} == expected
    assert results["lssp_vision"]["long"] == results["lssp_audio"]["long"] == [1, 4]
    assert results["lssp_qwen"]["long"] == [1, 4]


def test_heads_must_divide_by_sp(results: dict) -> None:
    assert "heads (3) divisible by the sequence-parallel size" in results["heads"]["error"]
