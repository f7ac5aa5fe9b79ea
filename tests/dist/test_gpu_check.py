"""bench/gpu_check.py keeps working without a GPU: its CPU smoke run, and the GPU run's skips.

The GPU figures themselves come from running it on a GPU (``python bench/gpu_check.py --out
$OUT``); here the script's harness, the local-spec side of every comparison, the checkpoint round
trip through canonical names and a 2-step bf16 ``omni train`` run on the CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.dist,
    pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the real check instead"),
]

ROOT = Path(__file__).resolve().parents[2]


def _check(tmp_path: Path, *args: str) -> tuple[int, dict, str]:
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=400,
        env={**os.environ, "OMNI_NUM_THREADS": "1"},
        check=False,
    )
    return proc.returncode, json.loads(out.read_text()), proc.stdout + proc.stderr


def test_cpu_smoke_runs_every_part(tmp_path: Path) -> None:
    code, result, log = _check(tmp_path, "--cpu-smoke")
    assert code == 0 and result["ok"], log[-3000:]
    parts = result["parts"]
    assert {n: p["status"] for n, p in parts.items()} == {
        "encoder_varlen": "ok",
        "te_vs_local": "ok",
        "checkpoint": "ok",
        "layouts": "ok",
        "train": "ok",
        "warm": "ok",
    }
    assert parts["encoder_varlen"]["out_rel_error"] == 0.0  # no GPU kernel: SDPA both sides
    compared = parts["te_vs_local"]
    assert "no CUDA" in compared["note"]  # the JSON says TE was not compared, and why
    for dtype in ("float32", "bfloat16"):
        assert compared[dtype]["logits_rel_error"] == 0.0 and compared[dtype]["within_tolerance"]
    trips = parts["checkpoint"]
    for trip in ("local_to_other", "other_to_local", "local_bf16_to_other_fp32"):
        assert trips[trip]["params"] > 0 and trips[trip]["params_not_equal"] == []
    layouts = parts["layouts"]  # bench/fake_layouts.py: one rank of each world-8 layout (fake PG)
    assert [layouts[n]["layout"] for n in ("tp2_sp", "pp2", "dp8_zero1")] == [
        "tp2xdp4",
        "pp2xdp4",
        "dp8",
    ]
    for r in (layouts[n] for n in ("tp2_sp", "pp2", "dp8_zero1")):
        assert r["save"]["step"] == r["load"]["step"] == 2 and r["predicted_bytes"]["total"] > 0
    train = parts["train"]
    assert train["tokens_per_second"] > 0 and train["mfu"] > 0 and len(train["steps"]) == 2
    assert result["environment"]["te_usable"] is False
    warm = parts["warm"]  # CPU: nothing initialises CUDA, so the zygote forks
    assert warm["forked"] and not warm["declined"] and warm["losses_equal"], warm


def test_without_a_gpu_the_gpu_parts_say_why_they_skipped(tmp_path: Path) -> None:
    code, result, _ = _check(tmp_path, "--parts", "te_vs_local,train,layouts")
    assert code == 0 and result["mode"] == "gpu" and "no CUDA" in result["note"]
    parts = result["parts"]
    assert (
        parts["te_vs_local"]["status"] == "skipped" and "no CUDA" in parts["te_vs_local"]["reason"]
    )
    assert parts["train"]["status"] == "skipped" and "needs a GPU" in parts["train"]["reason"]
    assert parts["layouts"]["status"] == "skipped" and "no CUDA" in parts["layouts"]["reason"]


def test_a_part_that_does_not_fit_the_budget_is_skipped(tmp_path: Path) -> None:
    code, result, _ = _check(tmp_path, "--cpu-smoke", "--budget-s", "1", "--parts", "train")
    assert code == 0
    train = result["parts"]["train"]
    assert train["status"] == "skipped" and train["reason"].startswith("time budget"), train
