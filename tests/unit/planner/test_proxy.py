"""Proxy-cluster proposal (the paper's technique 10): fewer replicas, the same replica."""

from __future__ import annotations

from dataclasses import replace

import pytest

from omni_trainer.costs.devices import H100
from omni_trainer.costs.step_costs import Layout
from omni_trainer.models.config import EncodersConfig, LLMConfig, ModelConfig
from omni_trainer.models.encoders.config import VisionEncoderConfig
from omni_trainer.planner.simulate import predict
from omni_trainer.planner.tune import propose_proxy
from omni_trainer.planner.workloads import Workload

MODEL = ModelConfig(
    llm=LLMConfig(preset="tiny"),
    encoders=EncodersConfig(image=VisionEncoderConfig(preset="vit-tiny")),
)


def _job(gpus: int, batch: int) -> Workload:
    return Workload(name="j", model=MODEL, world_size=gpus, global_batch=batch, seq_length=512)


def test_proxy_keeps_the_replica_and_a_reorder_group_on_two_nodes() -> None:
    job = _job(64, 128)
    best = predict(job, Layout(tp=2, pp=2, dp=16, reorder_group=4), device=H100)
    plan = propose_proxy(job, best, device=H100)
    lay = plan.proxy.layout
    # two 8-GPU nodes hold 4 replicas of tp2 x pp2, which is also one reorder group
    assert (lay.tp, lay.pp, lay.vpp, lay.reorder_group, lay.dp) == (2, 2, 1, 4, 4)
    assert plan.proxy_gpus == 16 and plan.proxy_global_batch == 4 * (128 // 16)
    assert plan.proxy.policy == best.policy and lay.eta == best.layout.eta
    # the proxy's replicas are the first of the full job's sampled ones, and its sync is over
    # fewer ranks: the full job's step cannot be shorter
    assert plan.full.step_time >= plan.proxy.step_time
    assert plan.per_gpu_ratio < 1.0  # a tiny model: the 64-rank gradient sync shows
    assert "16 GPUs (of 64)" in plan.reason and "two nodes" in plan.reason


def test_single_node_job_gets_two_replicas() -> None:
    job = _job(8, 32)
    best = predict(job, Layout(dp=8), device=H100)
    plan = propose_proxy(job, best, device=H100)
    assert plan.proxy.layout.dp == 2 and plan.proxy_gpus == 2
    assert "gradient sync" in plan.reason


def test_proxy_divides_the_job_and_respects_the_cap() -> None:
    job = _job(96, 96)
    best = predict(job, Layout(tp=4, dp=24, reorder_group=3), device=H100)
    plan = propose_proxy(job, best, device=H100)
    assert 24 % plan.proxy.layout.dp == 0 and plan.proxy.layout.dp % 3 == 0
    assert plan.proxy.layout.dp * 4 >= 16  # two nodes
    capped = propose_proxy(job, best, device=H100, max_gpus=12)
    assert capped.proxy_gpus == 12 and "capped" in capped.reason
    with pytest.raises(ValueError, match="at least 12 GPUs"):
        propose_proxy(job, best, device=H100, max_gpus=8)


def test_proxy_of_a_one_replica_job_is_the_job() -> None:
    job = _job(4, 8)
    best = predict(job, Layout(tp=4), device=H100)
    plan = propose_proxy(job, best, device=H100)
    assert plan.proxy.layout == best.layout
    assert plan.proxy.step_time == pytest.approx(best.step_time)
    assert plan.per_gpu_ratio == pytest.approx(1.0)
    assert replace(best.layout, dp=1) == plan.proxy.layout
