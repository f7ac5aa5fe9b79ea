"""The ranking bench's arithmetic: paired ratios per repeat, medians with min and max."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench" / "multiplex.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_multiplex", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def summary(steps: list[float], loss: float = 6.0, peak_mib: float = 1.0) -> dict:
    rows = [
        {"stage": s, "encoder_s": 0.1 * (s + 1), "llm_s": 0.5, "encoder_wait_s": 0.05,
         "pipeline_wait_s": 0.05, "encoder_activation_peak_bytes": peak_mib * 2**20 * (s + 1)}
        for s in (0, 1)
    ]  # fmt: skip
    return {"step_time_curve": steps, "breakdown": rows, "loss_curve": [loss, loss - 1]}


def test_pairs_are_compared_within_a_repeat(bench) -> None:
    # repeat 1 is slow for both (a burst of load): the paired ratio does not see it
    runs = [
        {"repeat": 0, "policy": "a", "summary": summary([9.0, 1.0, 1.0, 1.0])},
        {"repeat": 0, "policy": "b", "summary": summary([9.0, 1.2, 1.2, 1.2], peak_mib=2.0)},
        {"repeat": 1, "policy": "a", "summary": summary([9.0, 3.0, 3.0, 2.0])},
        {"repeat": 1, "policy": "b", "summary": summary([9.0, 3.3, 3.3, 3.0], peak_mib=2.0)},
        {"repeat": 2, "policy": "a", "summary": summary([9.0, 1.0, 1.0, 1.0])},
        {"repeat": 2, "policy": "b", "summary": summary([9.0, 1.5, 1.5, 1.5], peak_mib=2.0)},
    ]
    lines = bench.report(runs, ("a", "b"))
    assert (
        "a vs b median step-time ratio 1.200 (min 1.100, max 1.500, 3 runs); "
        "peak encoder activations x0.50" in lines
    )
    # step time of a run: median of its steps after the first; then the median over repeats
    assert any("step    1.000 s (min 1.000, max 3.000, 3 runs)" in line for line in lines)
    assert lines[-1] == "loss curves of all 6 runs equal within 1e-5: True"


def test_unequal_losses_are_reported(bench) -> None:
    runs = [
        {"repeat": 0, "policy": "a", "summary": summary([1.0, 1.0])},
        {"repeat": 0, "policy": "b", "summary": summary([1.0, 1.0], loss=6.1)},
    ]
    assert bench.report(runs, ("a", "b"))[-1].endswith("False")


def test_simulated_side_is_calibrated_on_llm_seconds(bench) -> None:
    """Measured LLM is 0.5 s per stage; the model says 10 units per stage: 0.05 s per unit."""
    runs = [{"repeat": 0, "policy": "a", "summary": summary([1.0, 1.0])}]
    stage = {"encoder": 2.0, "llm": 10.0, "waiting": 4.0}
    sim = {"a": {"makespan": 20.0, "stages": {0: stage, 1: stage}}}
    assert bench.seconds_per_unit(runs, sim) == pytest.approx(0.05)
    lines = bench.report(runs, ("a",), sim)
    assert lines[0] == "simulated: time model x 0.0500 s per LLM forward op (fit on LLM s)"
    # measured waiting 0.1 s per stage, simulated 4 units = 0.2 s
    assert any(line.endswith("waiting measured/simulated x0.50") for line in lines)
    assert any(line.endswith("simulated makespan 1.000 s") for line in lines)
