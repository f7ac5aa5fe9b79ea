"""`omni plan --tune` reads the GPU and the job's own layout from the manifest."""

from __future__ import annotations

import copy

import pytest

from omni_trainer.config import parse_manifest
from omni_trainer.costs.devices import A100, GH200, H100, H200
from omni_trainer.distributed.layout import layout_problems
from omni_trainer.planner.manifest import (
    device_for,
    manifest_fields,
    own_layout,
    tie_ranks,
    trainer_problems,
)
from omni_trainer.planner.tune import layouts, tune
from omni_trainer.planner.workloads import workload_from_config


def _selector(product: str) -> dict:
    return {"scheduling": {"nodeSelector": {"nvidia.com/gpu.product": product}}}


def test_device_from_flag_then_manifest_then_default() -> None:
    assert device_for("h200", _selector("NVIDIA-A100-SXM4-80GB")) == (H200, "--device")
    device, why = device_for(None, _selector("NVIDIA-GH200-480GB"))
    assert device == GH200 and "nvidia.com/gpu.product=NVIDIA-GH200-480GB" in why
    assert device_for(None, _selector("NVIDIA-A100-SXM4-80GB"))[0] == A100
    assert device_for(None, {}) == (H100, "default; the manifest names no GPU product")
    with pytest.raises(ValueError, match="--device must be one of H100, H200, GH200, A100"):
        device_for("B200", None)


def test_own_layout_is_the_manifests(tiny_manifest: dict) -> None:
    trainer = tiny_manifest["spec"]["trainer"]
    trainer["parallelism"] = {"tensor": 2, "pipeline": 2, "encoder": {"eta": 64, "zero": 2}}
    trainer["data"]["reorder"] = {"groupSize": 2}
    cfg = parse_manifest(tiny_manifest).spec.trainer
    layout, why = own_layout(cfg, 8)
    assert layout is not None, why
    assert (layout.tp, layout.pp, layout.dp, layout.eta, layout.reorder_group) == (2, 2, 2, 64, 2)
    assert layout.micro_batch_size == 4 and layout.encoder_zero == 2
    # what the trainer runs: ZeRO-1 at dp 2 by default, sequence parallel with tp 2, sel-AC
    assert layout.llm_zero == 1 and layout.sequence_parallel and layout.recompute == "selective"
    assert layout.overlap_grad_reduce  # the default with ZeRO-1
    trainer["parallelism"] |= {"distributedOptimizer": False, "sequenceParallel": False}
    trainer["train"] = {"recompute": "full"}
    plain, _ = own_layout(parse_manifest(tiny_manifest).spec.trainer, 8)
    assert plain.llm_zero == 0 and not plain.sequence_parallel and plain.recompute == "full"
    assert not plain.overlap_grad_reduce
    none, why = own_layout(cfg, 6)
    assert none is None and "tensor x pipeline (4) does not divide 6 GPUs" in why
    none, why = own_layout(cfg, 32)  # dp 8 x microBatchSize 4 > globalBatchSize: omni train's
    assert none is None and why.startswith("spec.trainer.data.globalBatchSize: ")  # own words


def test_ties_share_a_rank() -> None:
    assert tie_ranks([100.0, 100.0, 90.0, 80.0, 80.00001]) == ["1=", "1=", "3", "4=", "4="]
    assert tie_ranks([3.0, 2.0, 1.0]) == ["1", "2", "3"]


def test_every_tuned_proposal_is_a_manifest_omni_train_accepts(tiny_manifest: dict) -> None:
    """The tuner searches only layouts the trainer accepts with this manifest (its loaders,
    batch and model), and each proposal, written into the manifest, validates at its world."""
    gpus = 8
    cfg = parse_manifest(tiny_manifest).spec.trainer
    workload = workload_from_config(cfg, world_size=gpus, name="tiny")
    every = layouts(workload, device=H100)
    runnable = [lay for lay in every if not trainer_problems(cfg, lay)]
    # the filter matters: 4 loader shards cannot spread over 8 data-parallel ranks
    assert any("loaderShards" in p for lay in every for p in trainer_problems(cfg, lay))
    assert runnable and len(runnable) < len(every)
    best = tune(workload, device=H100, candidates=runnable, top=3, keep_layouts=2,
                etas=(64, 4096), groups=(1, 2), max_microbatches=4)  # fmt: skip
    assert best
    for candidate in best:
        doc = copy.deepcopy(tiny_manifest)
        trainer = doc["spec"]["trainer"]
        for section, fields in manifest_fields(
            candidate.layout, policy=candidate.prediction.policy
        ).items():
            trainer[section] = _merged(trainer.get(section, {}), fields)
        proposed = parse_manifest(doc).spec.trainer
        assert layout_problems(proposed, gpus) == [], candidate.layout.describe()
        assert proposed.parallelism.distributed_optimizer_on(candidate.layout.dp) == bool(
            candidate.layout.llm_zero
        )


def _merged(base: dict, fields: dict) -> dict:
    out = dict(base)
    for k, v in fields.items():
        out[k] = _merged(out.get(k, {}), v) if isinstance(v, dict) else v
    return out
