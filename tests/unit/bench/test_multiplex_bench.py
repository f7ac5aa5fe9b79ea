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


def summary(
    steps: list[float], loss: float = 6.0, peak_mib: float = 1.0, llm: float = 0.5, wait=0.1
) -> dict:
    rows = [
        {"stage": s, "encoder_s": 0.1 * (s + 1), "llm_s": llm, "encoder_wait_s": wait / 2,
         "pipeline_wait_s": wait / 2, "encoder_activation_peak_bytes": peak_mib * 2**20 * (s + 1)}
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


def test_the_order_turns_each_repeat_so_every_policy_runs_in_every_position(bench) -> None:
    policies = ["a", "b", "c", "d"]
    orders = [bench.turned(policies, r) for r in range(6)]
    assert orders[:2] == [["a", "b", "c", "d"], ["b", "c", "d", "a"]] and orders[4] == orders[0]
    for position in range(4):
        assert sorted(order[position] for order in orders[:4]) == policies


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
    assert lines[0].startswith("planner: omni plan's time model x 0.0500 s per LLM forward op")
    # measured waiting 0.1 s per stage, simulated 4 units = 0.2 s
    assert any(line.endswith("waiting measured/planner x0.50") for line in lines)
    assert any(line.endswith("planner makespan 1.000 s") for line in lines)


def test_replayed_waits_are_predicted_for_held_out_repeats(bench) -> None:
    """Held-out: op seconds fit on repeat 0 only (0.5 s of LLM per stage: F = 1/12 s, B = 1/6
    s); the replay of 1F1B with 2 stages and 2 micro-batches then waits 3 F on stage 0 (0.25 s)
    and 1 F on stage 1 (0.083 s); repeat 1's measured 0.1 s per stage: stage 1 within 25%,
    stage 0 not. Repeat 1's 5 s of LLM and repeat 0's waits go in nowhere. Same-run: repeat 1
    replayed with its own 5 s of LLM and 0.1 s of latency waits 10x as long, plus latencies."""
    from omni_trainer.multiplex.dataflow.plan import plan_dataflow

    runs = [
        {"repeat": 0, "policy": "a", "summary": summary([1.0, 1.0], wait=9.0), "latency": 0.0},
        {"repeat": 1, "policy": "a", "summary": summary([1.0, 1.0], llm=5.0), "latency": 0.1},
    ]
    table = plan_dataflow("uniform", pp=2, vpp=1, num_microbatches=2, encoder_mbs=())
    rep = bench.replayed(runs, {"a": [table]}, cores=2)
    assert [rep["a"][s]["waiting"] for s in (0, 1)] == pytest.approx([0.25, 0.5 / 6])
    assert [rep["a"][s]["measured_waiting"] for s in (0, 1)] == pytest.approx([0.1, 0.1])
    # repeat 1: stage 0 waits 2.5 s + 3 p2p calls x 0.1 s, stage 1 5/6 s + 3 x 0.1 s
    same = [(0.25 + 2.5 + 0.3) / 2, (0.5 / 6 + 5 / 6 + 0.3) / 2]
    assert [rep["a"][s]["same_run_waiting"] for s in (0, 1)] == pytest.approx(same)
    assert [rep["a"][s]["same_run_measured"] for s in (0, 1)] == pytest.approx([4.55, 4.55])
    lines = bench.report(runs, ("a",), rep={"cores": 2, "policies": rep})
    assert any("waiting measured/replayed x0.40 held-out, x2.98 same-run" in x for x in lines)
    text = "\n".join(lines)
    assert "within 25% of measured: 1 of 2 stage rows (worst x0.40)   (held-out" in text
    assert "within 25% of measured: 0 of 2 stage rows (worst x7.48)   (same-run" in text
    assert "held-out: fit on repeats [0], measured waiting of repeats [1]" in lines[0]


def test_agreement_counts_rows_and_names_the_worst(bench) -> None:
    assert bench.agreement([(1.0, 1.2), (1.0, 0.5), (2.0, 2.0)]) == (2, 2.0)
    assert bench.agreement([(1.0, 0.0), (0.0, 0.0)]) == (1, float("inf"))


@pytest.mark.parametrize("pp", [2, 4])
def test_auto_plans_the_bench_job_within_budgets_front_loaded_exceeds(bench, pp) -> None:
    """The bench's own job, ``omni plan``'s tables for its first steps: without memoryBudget auto
    holds at most uniform's peak x HEADROOM (the ranking bench's memory target) and is never
    slower than uniform in the time model; with memoryBudget = uniform's peak, which
    front_loaded exceeds at pp2, auto plans within it where front_loaded cannot."""
    from omni_trainer.config import parse_manifest
    from omni_trainer.multiplex.dataflow.auto import HEADROOM
    from omni_trainer.plan import plan_step

    def run(policy: str, step: int, **encoder) -> tuple[float, float]:
        job = bench.bench_job(pp, 256)
        job["spec"]["trainer"]["parallelism"]["encoder"].update(encoder)
        cfg = parse_manifest(job).spec.trainer
        sim = plan_step(cfg, world_size=pp, step=step, policy=policy, device_bytes=1e12)
        stages = sim.simulation["stages"]
        return max(s["peak_encoder_activations"] for s in stages), sim.simulation["makespan"]

    exceeded = 0
    for step in (1, 2, 3):
        uniform, front, auto = (run(p, step) for p in ("uniform", "front_loaded", "auto"))
        assert auto[0] <= HEADROOM * uniform[0] + 1e-6 and auto[1] <= uniform[1] + 1e-9
        budget = int(uniform[0])
        exceeded += front[0] > budget
        assert run("auto", step, memoryBudget=budget)[0] <= budget
    assert exceeded == (3 if pp == 2 else 1)


def test_spread_is_each_stages_llm_forwards_over_their_mean(bench) -> None:
    s = summary([1.0, 1.0])
    s["breakdown"][0]["op_log"] = [
        [("llm_forward", 0.0, 1.0), ("encoder", 1.0, 5.0)],
        [("llm_forward", 0.0, 3.0)],
    ]  # durations 1 and 3, mean 2
    assert bench.spread(s) == {0: (0.5, 1.5), 1: ()}


def test_backward_over_forward_ratios_come_from_the_op_log(bench) -> None:
    """Stage 0: 0.5 s of LLM per step, 0.2 s of it forwards: backwards 1.5x; an encoder span
    after a gradient wait is a backward (0.3 s) against forwards of 0.2 s: 1.5x."""
    s = summary([1.0, 1.0])
    s["breakdown"][0]["op_log"] = [
        [("encoder", 0.0, 0.2), ("llm_forward", 0.2, 0.4), ("encoder_wait", 0.4, 0.5),
         ("encoder", 0.5, 0.8)],
    ]  # fmt: skip
    ratios = bench.op_ratios(s)
    assert ratios[0] == pytest.approx((1.5, 1.5)) and ratios[1] == (2.0, 2.0)


def test_cores_used_are_the_launchs_and_the_machines_cpu_less_it_over_the_window(bench) -> None:
    """Samples (time, machine busy CPU s, launch CPU s): between t=1 and t=3 the machine used
    3.0 CPU s and the launch 2.2: the launch kept 1.1 cores busy, others 0.4; outside the window
    nothing counts, and one sample is no measurement."""
    samples = [
        (0.0, 0.0, 0.0),
        (1.0, 10.0, 5.0),
        (2.0, 11.5, 6.0),
        (3.0, 13.0, 7.2),
        (9.0, 99.0, 9.0),
    ]
    assert bench.cores_used(samples, 1.0, 3.0) == pytest.approx((1.1, 0.4))
    assert bench.cores_used(samples, 1.5, 2.5) == (0.0, 0.0)
