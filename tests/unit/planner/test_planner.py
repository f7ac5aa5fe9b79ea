"""Planner: cost formulas against hand-computed values, the simulator against closed forms."""

from __future__ import annotations

from dataclasses import replace

import pytest

from omni_trainer.costs.devices import (
    H100,
    Link,
    all_gather_time,
    all_reduce_time,
    all_to_all_time,
    cpu_profile,
    p2p_time,
)
from omni_trainer.costs.step_costs import (
    EncoderMBCost,
    Layout,
    LLMOpCost,
    layers_per_virtual_stage,
    llm_op_costs,
    static_memory,
)
from omni_trainer.data.packing import PackedSequence, Segment
from omni_trainer.models.config import EncodersConfig, LLMConfig, ModelConfig
from omni_trainer.models.encoders.config import VisionEncoderConfig
from omni_trainer.multiplex.dataflow.plan import plan_dataflow
from omni_trainer.multiplex.dataflow.table import EncoderMicroBatch
from omni_trainer.planner.simulate import ReplicaWork, encoder_budget, predict, run_schedule
from omni_trainer.planner.tune import tune
from omni_trainer.planner.workloads import Workload, modality_token_shares, sample_sequences

from .llms import plain_llm

LINK = Link(name="test", alpha_s=1e-5, bandwidth=1e9)


def test_collectives_match_ring_formulas() -> None:
    # 4 ranks, 1 GB: all-reduce 2*3 steps of alpha + 2*(3/4)*1 s.
    assert all_reduce_time(1e9, 4, LINK) == pytest.approx(6e-5 + 1.5)
    assert all_gather_time(1e9, 4, LINK) == pytest.approx(3e-5 + 0.75)
    assert all_to_all_time(1e9, 4, LINK) == pytest.approx(3e-5 + 0.75)
    assert p2p_time(1e9, LINK) == pytest.approx(1e-5 + 1.0)
    assert all_reduce_time(1e9, 1, LINK) == 0.0


def test_gemm_efficiency_interpolates_and_clamps() -> None:
    eff = H100.efficiency
    assert eff.gemm_efficiency(100) == eff.gemm[0][1]
    assert eff.gemm_efficiency(1 << 20) == eff.gemm[-1][1]
    assert eff.gemm_efficiency(2048) == pytest.approx(0.64)
    assert 0.55 < eff.gemm_efficiency(1448) < 0.64  # between the 1024 and 2048 points


def test_llm_op_cost_hand_computed_on_cpu_profile() -> None:
    device = cpu_profile(1e9)  # gemm efficiency 1, attention 0.5, no overhead
    llm = plain_llm()
    seq = PackedSequence(128, [Segment("t", "text", 0, 128, 0)], [])
    costs = llm_op_costs(llm, [seq], Layout(pp=2), device)
    # per layer: attn q,k,v,o 4h^2 + MLP 2*h*4h = 12 h^2 = 49152 params; 2*P*128 tokens
    gemm = 2 * 12 * 64 * 64 * 128
    attn = 4 * 4 * 16 * 128 * 128 / 2  # 4 * heads * head_dim * s^2, causal: half
    layer = gemm / 1e9 + attn / 0.5e9
    head = 2 * 64 * 100 * 128 / 1e9
    assert costs[0].forward == pytest.approx(2 * layer)
    assert costs[1].forward == pytest.approx(2 * layer + head)
    assert costs[0].backward == pytest.approx(2 * costs[0].forward)
    full = llm_op_costs(llm, [seq], Layout(pp=2, recompute="full"), device)
    assert full[0].backward == pytest.approx(3 * costs[0].forward)
    assert full[0].activation_bytes < costs[0].activation_bytes
    assert costs[0].activation_bytes == pytest.approx(2 * 34 * 128 * 64)


def test_static_memory_hand_computed() -> None:
    model = ModelConfig(llm=plain_llm())
    mem = static_memory(model, Layout(dp=4), 0)
    p = 4 * 12 * 64 * 64 + 2 * 100 * 64  # layers + embedding + LM head (single stage)
    assert mem["llm_weights"] == 2 * p
    assert mem["llm_grads"] == 4 * p
    assert mem["llm_optimizer"] == 12 * p / 4
    assert mem["encoder_weights"] == 0


def test_layers_split_over_virtual_stages() -> None:
    assert layers_per_virtual_stage(10, 2, 2) == [3, 3, 2, 2]
    with pytest.raises(ValueError):
        layers_per_virtual_stage(3, 2, 2)


def _work(m: int, pp: int, f: float, b: float, enc: dict | None = None) -> ReplicaWork:
    return ReplicaWork(llm=[[LLMOpCost(f, b, 1.0, 0.0)] * pp for _ in range(m)], encoder=enc or {})


@pytest.mark.parametrize(("pp", "m"), [(1, 4), (2, 4), (4, 8), (4, 4), (3, 7)])
def test_1f1b_closed_form(pp: int, m: int) -> None:
    table = plan_dataflow("uniform", pp=pp, vpp=1, num_microbatches=m, encoder_mbs=[])
    r = run_schedule(table, _work(m, pp, 1.0, 2.0))
    assert r.makespan == pytest.approx((m + pp - 1) * 3.0)
    assert r.bubble == pytest.approx((pp - 1) / (m + pp - 1))
    # 1F1B: stage s keeps at most pp - s micro-batches' activations (1 byte each).
    assert r.peak_bytes == tuple(float(min(pp - s, m)) for s in range(pp))


def test_interleaved_is_shorter_than_1f1b() -> None:
    pp, m = 4, 8
    plain = run_schedule(
        plan_dataflow("uniform", pp=pp, vpp=1, num_microbatches=m, encoder_mbs=[]),
        _work(m, pp, 1.0, 2.0),
    )
    inter = run_schedule(
        plan_dataflow("uniform", pp=pp, vpp=2, num_microbatches=m, encoder_mbs=[]),
        ReplicaWork(llm=[[LLMOpCost(0.5, 1.0, 1.0, 0.0)] * (2 * pp) for _ in range(m)]),
    )
    assert inter.makespan < plain.makespan
    assert inter.makespan == pytest.approx((m + (pp - 1) / 2) * 3.0)  # bubble / vpp


def _encoders(m: int, cost: float) -> tuple[list[EncoderMicroBatch], dict[int, EncoderMBCost]]:
    mbs = [EncoderMicroBatch(i, i, "image", cost) for i in range(m)]
    return mbs, {i: EncoderMBCost(cost, 2 * cost, 10.0, 0.0, 0) for i in range(m)}


@pytest.mark.parametrize("policy", ["uniform", "front_loaded", "stage0"])
def test_zero_cost_encoders_reduce_to_1f1b(policy: str) -> None:
    pp, m = 4, 8
    mbs, enc = _encoders(m, 0.0)
    table = plan_dataflow(policy, pp=pp, vpp=1, num_microbatches=m, encoder_mbs=mbs)
    r = run_schedule(table, _work(m, pp, 1.0, 2.0, enc))
    assert r.makespan == pytest.approx((m + pp - 1) * 3.0)


def test_heavy_encoders_on_stage0_are_slower_than_uniform() -> None:
    pp, m = 4, 16
    mbs, enc = _encoders(m, 0.6)
    res = {
        p: run_schedule(
            plan_dataflow(p, pp=pp, vpp=1, num_microbatches=m, encoder_mbs=mbs),
            _work(m, pp, 1.0, 2.0, enc),
        )
        for p in ("uniform", "stage0", "front_loaded")
    }
    assert res["stage0"].makespan > 1.1 * res["uniform"].makespan
    assert res["stage0"].encoder_busy[1:] == (0.0, 0.0, 0.0)
    # Front-loading keeps every encoder activation alive at once: 4 mbs x 10 bytes per stage.
    assert max(res["front_loaded"].peak_bytes) >= 4 * 10.0
    assert max(res["uniform"].peak_bytes) < max(res["front_loaded"].peak_bytes)


def test_auto_budget_is_device_memory_minus_the_llm() -> None:
    """pp2, 8 micro-batches: the LLM holds 2 (stage 0) and 1 (stage 1) bytes of activations over
    5 static; each encoder mb keeps 10. With room auto is as fast as front-loading; with room
    for two mbs per stage it keeps within it (front-loading would hold four)."""
    pp, m = 2, 8
    mbs, enc = _encoders(m, 1.0)
    mbs = [replace(e, activations=10.0) for e in mbs]
    work = replace(_work(m, pp, 1.0, 2.0, enc), static_bytes=(5.0, 5.0))
    assert encoder_budget(work, pp=pp, vpp=1, num_microbatches=m, hbm_bytes=100.0) == [93.0, 94.0]

    def run(policy: str, hbm: float | None = None):
        budget = None if hbm is None else encoder_budget(
            work, pp=pp, vpp=1, num_microbatches=m, hbm_bytes=hbm
        )  # fmt: skip
        table = plan_dataflow(policy, pp=pp, vpp=1, num_microbatches=m, encoder_mbs=mbs,
                              budget=budget)  # fmt: skip
        return run_schedule(table, work)

    front = run("front_loaded")
    assert max(front.peak_bytes) == 5.0 + 2.0 + 40.0
    assert run("auto", 1000.0).makespan <= front.makespan
    tight = run("auto", 5.0 + 2.0 + 20.0)
    assert max(tight.peak_bytes) <= 27.0
    assert tight.makespan < run("uniform").makespan


@pytest.mark.parametrize("m", [1, 4])
def test_p2p_latency_adds_to_the_pipeline(m: int) -> None:
    pp = 4
    table = plan_dataflow("uniform", pp=pp, vpp=1, num_microbatches=m, encoder_mbs=[])
    work = ReplicaWork(
        llm=[[LLMOpCost(1.0, 2.0, 0.0, 1.0)] * pp for _ in range(m)],
        p2p_bandwidth_s_per_byte=0.1,
    )
    span = run_schedule(table, work).makespan
    # fill and drain cross 2 (pp - 1) links of 0.1 s on the critical path; with one
    # micro-batch that chain is the whole step, with more the steady state may stall too.
    if m == 1:
        assert span == pytest.approx(pp * 3.0 + 0.6)
    else:
        assert (m + pp - 1) * 3.0 + 0.6 <= span < (m + pp - 1) * 3.0 + 0.6 + m * 0.2


def _tiny_workload() -> Workload:
    model = ModelConfig(
        llm=LLMConfig(preset="tiny"),
        encoders=EncodersConfig(image=VisionEncoderConfig(preset="vit-tiny")),
    )
    return Workload(name="tiny", model=model, world_size=8, global_batch=16, seq_length=512)


def test_sampler_hits_the_token_mix() -> None:
    w = _tiny_workload().with_share(7, 3)
    seqs = sample_sequences(w, 200, seed=1)
    assert all(s.used <= 512 for s in seqs)
    assert modality_token_shares(seqs).get("image", 0.0) == pytest.approx(0.7, abs=0.08)


def test_predict_and_tune_on_a_tiny_job() -> None:
    w = _tiny_workload()
    p = predict(w, Layout(pp=2, dp=4, reorder_group=2), policy="uniform", device=H100)
    assert p.step_time > 0 and 0 < p.mfu < 1 and not p.oom
    with pytest.raises(ValueError):
        predict(w, Layout(pp=2, dp=2), device=H100)  # 4 GPUs for an 8-GPU job
    calls: list[tuple[int, int]] = []
    best = tune(w, device=H100, top=2, progress=lambda d, t, _: calls.append((d, t)))
    assert 1 <= len(best) <= 2
    assert best[0].prediction.tokens_per_s >= best[-1].prediction.tokens_per_s
    assert "fitting configs" in best[0].reason
    assert calls and calls[-1][0] == calls[-1][1]


def test_paper_workload_a_tunes_for_64_gpus() -> None:
    """Its search time is printed by `omni plan --tune` (a figure, not a unit-test limit)."""
    from pathlib import Path

    import yaml

    from omni_trainer.config import TrainerConfig
    from omni_trainer.planner.workloads import workload_from_config

    doc = yaml.safe_load((Path(__file__).parents[3] / "examples/paper-workload-a.yaml").read_text())
    cfg = TrainerConfig.model_validate(doc["spec"]["trainer"])
    w = workload_from_config(cfg, world_size=64, name="paper-a")
    assert dict(w.shares)["image"] / sum(v for _, v in w.shares) == 0.5 and w.seq_length == 16384
    best = tune(w, device=H100, top=3, max_microbatches=16, keep_layouts=1, groups=(8,))
    assert best and all(not c.prediction.oom for c in best)
