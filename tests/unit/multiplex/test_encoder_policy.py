"""auto's memory budget in the trainer: manifest bytes, or the device minus the LLM's needs."""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch

from omni_trainer.config import ManifestError, parse_manifest
from omni_trainer.costs.activation_bytes import kept_bytes_per_token
from omni_trainer.costs.step_costs import llm_activation_bytes, static_memory
from omni_trainer.data.packing import PackedSequence, Segment
from omni_trainer.distributed.config import ParallelDims, memory_bytes
from omni_trainer.multiplex import encoder_policy as budget_mod
from omni_trainer.multiplex.dataflow.auto import HEADROOM
from omni_trainer.multiplex.dataflow.simulate import simulate
from omni_trainer.multiplex.encoder_policy import encoder_budget, planning_budget, trainer_layout
from omni_trainer.multiplex.workload import encoder_micro_batches
from omni_trainer.plan import plan_step


def _cfg(manifest: dict, micro_batch_size: int = 4, **encoder):
    doc = copy.deepcopy(manifest)
    doc["spec"]["trainer"]["data"]["microBatchSize"] = micro_batch_size
    doc["spec"]["trainer"].setdefault("parallelism", {})["pipeline"] = 2
    doc["spec"]["trainer"]["parallelism"].setdefault("encoder", {}).update(encoder)
    return parse_manifest(doc).spec.trainer


def _micro_batches(n: int) -> list[list[PackedSequence]]:
    """``n`` micro-batches of one 200-token sequence: 64 image tokens, then 136 text."""
    seq = PackedSequence(256, [Segment("s", "image", 0, 200, 64)], [])
    return [[seq] for _ in range(n)]


def test_budget_is_the_device_minus_llm_static_bytes_and_activation_peak(tiny_manifest) -> None:
    """pp2 1F1B, 4 micro-batches: stage 0 holds 2 micro-batches' activations at its peak
    (warm-up F0 F1, then B0), stage 1 one (F, B alternate); the last stage adds fp32 logits."""
    cfg = _cfg(tiny_manifest)
    dims = ParallelDims(world_size=2, pp=2)
    layout = trainer_layout(cfg, dims)
    (a0, _), (a1, _) = llm_activation_bytes(cfg.model.llm, 200, layout)
    assert a1 == a0 + 4.0 * 200 * cfg.model.llm.vocab_size  # the logits
    static = [sum(static_memory(cfg.model, layout, s).values()) for s in (0, 1)]
    device = 1e9
    got = encoder_budget(cfg, dims, _micro_batches(4), device)
    assert got == [device - static[0] - 2 * a0, device - static[1] - a1]
    assert encoder_budget(cfg, dims, _micro_batches(4), 1.0) == [0.0, 0.0]  # never negative


def test_planning_budget_reads_the_manifest_else_the_device(tiny_manifest, monkeypatch) -> None:
    dims = ParallelDims(world_size=2, pp=2)
    mbs = _micro_batches(4)

    def unused() -> float:
        raise AssertionError("the manifest's budget needs no device")

    got = planning_budget(_cfg(tiny_manifest, memoryBudget="1Ki"), dims, mbs, unused)
    assert got == {"budget": 1024.0}
    # CPU: the host's available memory over the local processes (measured once per process)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(budget_mod, "host_available_bytes", lambda: 8e9)
    budget_mod.device_memory_bytes.cache_clear()
    try:
        cfg = _cfg(tiny_manifest)
        device = partial(budget_mod.device_memory_bytes, torch.device("cpu"))
        assert device() == 4e9
        got = planning_budget(cfg, dims, mbs, device)
        assert got == {"device_budget": encoder_budget(cfg, dims, mbs, 4e9)}
    finally:
        budget_mod.device_memory_bytes.cache_clear()
    monkeypatch.undo()
    assert budget_mod.host_available_bytes() > 0  # the real /proc/meminfo reading


def test_stages_share_cores_where_a_hosts_threads_outnumber_its_cores(monkeypatch) -> None:
    """4 single-threaded processes on 2 cores share them, 2 do not; a GPU rank never shares
    (its device is its own). The trainer's reading: torchrun's LOCAL_WORLD_SIZE, this process's
    threads, its affinity mask."""
    assert budget_mod.cores_are_shared(4, 1, 2) and budget_mod.cores_are_shared(2, 2, 3)
    assert not budget_mod.cores_are_shared(2, 1, 2)
    cores = len(budget_mod.os.sched_getaffinity(0))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    for local, expected in ((cores + 1, True), (cores, False)):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
        budget_mod.stages_share_cores.cache_clear()
        try:
            assert budget_mod.stages_share_cores(torch.device("cpu")) is expected
            assert budget_mod.stages_share_cores(torch.device("cuda")) is False
        finally:
            budget_mod.stages_share_cores.cache_clear()


def test_omni_plan_shows_auto_on_shared_cores_as_the_manifest_says(tiny_manifest) -> None:
    """``sharedCores: true`` with room for front-loading: ``omni plan`` shows front_loaded's
    table under ``auto``; unset, the table of stages on cores of their own."""

    def plan(policy: str, **encoder):
        cfg = _cfg(tiny_manifest, micro_batch_size=1, memoryBudget="1Ti", **encoder)
        return plan_step(cfg, world_size=2, policy=policy, device_bytes=1e12)

    front, shared = plan("front_loaded").table, plan("auto", sharedCores=True).table
    assert (shared.forward, shared.backward) == (front.forward, front.backward)
    dedicated = plan("auto")
    assert dedicated.table.forward != front.forward
    assert dedicated.simulation["makespan"] < simulate(front)["makespan"]


def test_omni_plan_budgets_auto_like_the_trainer(tiny_manifest) -> None:
    """``omni plan`` on the tiny job at pp2, 8 micro-batches. Without memoryBudget, on a large
    device: auto holds at most uniform's peak x HEADROOM and is at least as fast as uniform in
    the time model; with a 1-byte one (nothing fits) no more than any fixed policy's least
    peak. (A budget front_loaded exceeds: tests/unit/bench/test_multiplex_bench.py.)"""

    def run(policy: str, **encoder) -> tuple[float, float]:
        cfg = _cfg(tiny_manifest, micro_batch_size=1, **encoder)  # 8 micro-batches
        sim = plan_step(cfg, world_size=2, policy=policy, device_bytes=1e12).simulation
        return max(s["peak_encoder_activations"] for s in sim["stages"]), sim["makespan"]

    uniform, auto = run("uniform"), run("auto")
    assert auto[0] <= HEADROOM * uniform[0] + 1e-6 and auto[1] <= uniform[1] + 1e-9
    least = min(run(p)[0] for p in ("uniform", "front_loaded", "stage0"))
    assert run("auto", memoryBudget=1)[0] <= least


def test_encoder_micro_batches_carry_activation_bytes(tiny_manifest) -> None:
    """The same per-token formula as the simulator's cost model, over all of the mb's tokens."""
    model = _cfg(tiny_manifest).model
    (e,), lengths = encoder_micro_batches(model, _micro_batches(1), stages=2)
    vit = model.encoders.image
    assert lengths[e.id] == [64]
    assert e.activations == kept_bytes_per_token(vit.hidden_size, vit.num_layers) * 64
    assert e.memory == 34 * vit.hidden_size * vit.num_layers * 64


@pytest.mark.parametrize(
    ("value", "size"), [("20Gi", 20 * 2**30), (4096, 4096), ("1.5G", 1_500_000_000), ("8Mi", 2**23)]
)
def test_memory_budget_quantities(value, size) -> None:
    assert memory_bytes(value) == size


@pytest.mark.parametrize("bad", ["20GB", "-1Gi", 0, "lots", "0.5"])
def test_bad_memory_budget_names_the_field_and_the_fix(tiny_manifest, bad) -> None:
    with pytest.raises(ManifestError, match=r"memoryBudget .* quantity such as 20Gi"):
        _cfg(tiny_manifest, memoryBudget=bad)
