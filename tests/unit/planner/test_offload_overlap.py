"""Planner: activation offload and bucketed DP grad-sync overlap against hand-computed cases."""

from __future__ import annotations

from dataclasses import replace

import pytest

from omni_trainer.costs.devices import (
    H100,
    Link,
    all_gather_time,
    cpu_profile,
    reduce_scatter_time,
)
from omni_trainer.costs.step_costs import (
    Layout,
    dp_bucket_params,
    dp_sync_time,
    exposed_bucketed_sync,
    llm_op_costs,
    llm_stage_params,
)
from omni_trainer.data.packing import PackedSequence, Segment
from omni_trainer.models.config import EncodersConfig, LLMConfig, ModelConfig
from omni_trainer.models.encoders.config import VisionEncoderConfig
from omni_trainer.multiplex.dataflow.plan import plan_dataflow
from omni_trainer.planner.simulate import ReplicaWork, predict, run_schedule
from omni_trainer.planner.tune import layouts, tune
from omni_trainer.planner.workloads import Workload

from .llms import plain_llm

# cpu_profile(1e9): GEMM at 1 GFLOP/s, attention at 0.5, no overhead; plus a host link of
# 10 MB/s without latency, so one layer's copy takes 34 * 128 * 64 / 10e6 = 0.0278528 s.
SLOW_HOST = Link(name="test host", alpha_s=0.0, bandwidth=10e6)
LAYER_F = 2 * 12 * 64 * 64 * 128 / 1e9 + 2 * 4 * 16 * 128 * 128 / 0.5e9  # 0.016777216 s
LAYER_ACT = 34 * 128 * 64  # selective bytes per layer, tp 1
COPY = LAYER_ACT / 10e6


def _seq() -> list[PackedSequence]:
    return [PackedSequence(128, [Segment("t", "text", 0, 128, 0)], [])]


def test_offload_exposes_only_the_copy_time_beyond_the_layer() -> None:
    device = replace(cpu_profile(1e9), host=SLOW_HOST)
    sel = llm_op_costs(plain_llm(), _seq(), Layout(pp=2), device)
    off = llm_op_costs(plain_llm(), _seq(), Layout(pp=2, recompute="offload"), device)
    # 2 layers per stage. F: the copy (0.0279 s) outlasts the layer (0.0168 s), so each layer
    # takes the copy's time. B: 2 x 0.0168 = 0.0336 s hides the copy back entirely.
    assert COPY > LAYER_F and COPY < 2 * LAYER_F
    assert off[0].forward == pytest.approx(2 * COPY)
    assert off[0].forward - sel[0].forward == pytest.approx(2 * (COPY - LAYER_F))
    assert off[0].backward == pytest.approx(sel[0].backward)
    assert off[0].backward == pytest.approx(2 * 2 * LAYER_F)
    head = 2 * 64 * 100 * 128 / 1e9
    assert off[1].forward == pytest.approx(2 * COPY + head)
    # Memory: selective keeps 2 layers per micro-batch from F to B; offload keeps nothing (the
    # last stage only its fp32 logits) and holds two layers' buffers while F or B runs.
    assert sel[0].activation_bytes == pytest.approx(2 * LAYER_ACT)
    assert off[0].activation_bytes == 0.0
    assert off[0].working_bytes == pytest.approx(2 * LAYER_ACT)
    assert off[1].activation_bytes == pytest.approx(4 * 128 * 100)
    # One layer per virtual stage: one resident layer.
    one = llm_op_costs(plain_llm(), _seq(), Layout(pp=4, recompute="offload"), device)
    assert one[0].working_bytes == pytest.approx(LAYER_ACT)


def test_offload_on_a_fast_link_costs_no_time() -> None:
    fast = replace(cpu_profile(1e9), host=Link(name="fast", alpha_s=0.0, bandwidth=1e15))
    sel = llm_op_costs(plain_llm(), _seq(), Layout(pp=2), fast)
    off = llm_op_costs(plain_llm(), _seq(), Layout(pp=2, recompute="offload"), fast)
    assert [(c.forward, c.backward) for c in off] == [(c.forward, c.backward) for c in sel]


def test_offload_needs_a_host_link() -> None:
    with pytest.raises(ValueError, match="host link"):
        llm_op_costs(plain_llm(), _seq(), Layout(recompute="offload"), cpu_profile(1e9))
    what_if = ("selective", "full", "offload")
    assert all(
        lay.recompute != "offload"
        for lay in layouts(_tiny_workload(), device=cpu_profile(1e9), recomputes=what_if)
    )
    assert {
        lay.recompute for lay in layouts(_tiny_workload(), device=H100, recomputes=what_if)
    } == set(what_if)
    # by default only what train.recompute can run
    assert {lay.recompute for lay in layouts(_tiny_workload(), device=H100)} == {
        "selective",
        "full",
    }
    assert Layout(recompute="offload").describe().endswith(" offload-AC")


def test_offload_peak_memory_in_a_1f1b_schedule() -> None:
    """pp 2, 4 micro-batches: stage 0 keeps 2 micro-batches' selective activations in flight;
    offloaded, only the running op's two resident layers."""
    device = replace(cpu_profile(1e9), host=SLOW_HOST)
    table = plan_dataflow("uniform", pp=2, vpp=1, num_microbatches=4, encoder_mbs=[])
    peaks = {}
    for rc in ("selective", "offload"):
        costs = llm_op_costs(plain_llm(), _seq(), Layout(pp=2, recompute=rc), device)
        peaks[rc] = run_schedule(table, ReplicaWork(llm=[costs] * 4)).peak_bytes
    assert peaks["selective"][0] == pytest.approx(2 * 2 * LAYER_ACT)
    assert peaks["offload"][0] == pytest.approx(2 * LAYER_ACT)
    assert peaks["offload"][1] == pytest.approx(2 * LAYER_ACT + 4 * 128 * 100)


# ---------------------------------------------------------------------------------------------
# Bucketed overlap of the gradient reduce-scatter with the backward


def test_bucketed_sync_hand_computed() -> None:
    # 4 buckets of 25 params, 1 s each. Link keeps up (2 s of backward per bucket): only the
    # last bucket shows. It does not (0.5 s per bucket): 4 - 2 * 3/4 = 2.5 s.
    assert exposed_bucketed_sync(100, 25, 4.0, 8.0) == pytest.approx(1.0)
    assert exposed_bucketed_sync(100, 25, 4.0, 2.0) == pytest.approx(2.5)
    # Uneven buckets 40, 40, 10 params (4, 4, 1 s) ready at 4, 8, 9 s: finish 8, 12, 13.
    assert exposed_bucketed_sync(90, 40, 9.0, 9.0) == pytest.approx(4.0)
    # No backward, or one bucket: nothing hides, the bound.
    assert exposed_bucketed_sync(100, 25, 4.0, 0.0) == pytest.approx(4.0)
    assert exposed_bucketed_sync(20, 25, 4.0, 100.0) == pytest.approx(4.0)


@pytest.mark.parametrize("backward", [0.0, 0.1, 0.5, 0.99, 1.0, 3.0, 7.0, 100.0])
def test_overlap_is_never_slower_than_the_bound(backward: float) -> None:
    sync, k = 4.0, 4  # one bucket's sync: 1 s
    exposed = exposed_bucketed_sync(100, 25, sync, backward)
    assert exposed <= sync
    assert exposed >= sync / k - 1e-12  # the last bucket always shows
    if backward < sync / k:  # shorter than one bucket's sync: at most the backward hides
        assert exposed == pytest.approx(sync - backward * (k - 1) / k)
        assert exposed >= sync - backward


def _llm_1b() -> LLMConfig:
    """8 layers of 12 h^2 = 12.6M params at h 1024: 100M parameters, 3 buckets of 40M."""
    return plain_llm(num_layers=8, hidden_size=1024, num_attention_heads=8, num_query_groups=8,
                     ffn_hidden_size=4096, vocab_size=1000)  # fmt: skip


def test_dp_sync_time_switch_keeps_the_bound() -> None:
    model = ModelConfig(llm=_llm_1b())
    bound_layout = Layout(dp=16, overlap_grad_reduce=False)
    p = llm_stage_params(model.llm, bound_layout, 0)
    assert dp_bucket_params(16) == 40_000_000 and p > 2 * 40_000_000
    link = H100.link(16)
    rs = reduce_scatter_time(2 * p, 16, link)
    ag = all_gather_time(2 * p, 16, link)
    bound = dp_sync_time(model, bound_layout, 0, H100, backward=1.0)
    assert bound == pytest.approx(rs + ag)
    over = Layout(dp=16, overlap_grad_reduce=True)  # megatron DDP's; the trainer's is False
    assert dp_sync_time(model, over, 0, H100) == pytest.approx(bound)  # no backward to hide in
    # A long backward hides all but the last (remainder) bucket of the reduce-scatter.
    last = (p - 2 * 40_000_000) / p
    assert dp_sync_time(model, over, 0, H100, backward=10.0) == pytest.approx(rs * last + ag)
    # Without the distributed optimizer the grads are all-reduced: the whole thing overlaps.
    no_zero = Layout(dp=16, llm_zero=0, overlap_grad_reduce=True)
    assert dp_sync_time(model, no_zero, 0, H100, backward=10.0) == pytest.approx((rs + ag) * last)


def _workload(llm: LLMConfig) -> Workload:
    model = ModelConfig(
        llm=llm, encoders=EncodersConfig(image=VisionEncoderConfig(preset="vit-tiny"))
    )
    return Workload(name="t", model=model, world_size=16, global_batch=32, seq_length=512)


def test_overlap_in_predict_never_slower_and_equal_with_one_bucket() -> None:
    for llm, one_bucket in ((LLMConfig(preset="tiny"), True), (_llm_1b(), False)):
        w = _workload(llm)
        lay = Layout(pp=1, dp=16, reorder_group=1, overlap_grad_reduce=True)
        over = predict(w, lay, device=H100, max_microbatches=4)
        bound = predict(w, replace(lay, overlap_grad_reduce=False), device=H100, max_microbatches=4)
        if one_bucket:
            assert over.step_time == pytest.approx(bound.step_time)
        else:
            assert over.step_time < bound.step_time


# ---------------------------------------------------------------------------------------------
# The tuner's choice


def _tiny_workload() -> Workload:
    model = ModelConfig(
        llm=LLMConfig(preset="tiny"),
        encoders=EncodersConfig(image=VisionEncoderConfig(preset="vit-tiny")),
    )
    return Workload(name="tiny", model=model, world_size=8, global_batch=16, seq_length=512)


def _choice(device, candidates: list[Layout]) -> tuple[str, list[str]]:
    labels: list[str] = []
    best = tune(
        _tiny_workload(), device=device, top=1, keep_layouts=3, policies=("uniform",),
        etas=(4096,), groups=(1,), candidates=candidates, max_microbatches=8,
        progress=lambda _d, _t, label: labels.append(label),
    )  # fmt: skip
    return best[0].layout.recompute, labels


def test_tuner_picks_offload_only_when_selective_does_not_fit_and_offload_beats_full() -> None:
    base = Layout(pp=2, dp=4, reorder_group=1)
    pool = [replace(base, recompute=rc) for rc in ("selective", "full", "offload")]
    free_copies = Link(name="free", alpha_s=0.0, bandwidth=1e15)
    roomy = replace(H100, hbm_bytes=1e15, host=free_copies)
    peak = {
        lay.recompute: max(predict(_tiny_workload(), lay, device=roomy).peak_bytes) for lay in pool
    }
    assert peak["selective"] > max(peak["full"], peak["offload"])
    # Room for everything: sel-AC, and its slower variants are not even simulated.
    rc, labels = _choice(roomy, pool)
    assert rc == "selective"
    assert sum("skipped: sel-AC fits" in label for label in labels) == 2
    # sel-AC does not fit; copies are free, so offload costs nothing and beats recompute.
    tight = (peak["selective"] + max(peak["full"], peak["offload"])) / 2
    assert _choice(replace(roomy, hbm_bytes=tight), pool)[0] == "offload"
    # sel-AC does not fit; H100's PCIe copies (10 us each) outlast the tiny model's layers,
    # so recomputing is cheaper than offloading.
    assert _choice(replace(H100, hbm_bytes=tight), pool)[0] == "full"
