"""bf16 training, activation recompute and the summary's ``memory`` in one process (CPU)."""

from __future__ import annotations

import pytest

from omni_trainer.config import ManifestError, parse_manifest
from omni_trainer.launch import run_worker


def _run(doc: dict, steps: int, **train) -> dict:
    doc["spec"]["trainer"]["train"].update(train)
    return run_worker(parse_manifest(doc), steps=steps, summary_path=None)


def test_recompute_lowers_the_activation_peak_not_the_loss(tiny_manifest: dict) -> None:
    runs = {mode: _run(tiny_manifest, 2, recompute=mode) for mode in ("none", "selective", "full")}
    assert runs["selective"]["loss_curve"] == runs["none"]["loss_curve"]
    assert runs["full"]["loss_curve"] == runs["none"]["loss_curve"]
    peaks = {mode: r["memory"]["activation_peak_bytes"] for mode, r in runs.items()}
    assert peaks["none"] > peaks["selective"] > peaks["full"] > 0, peaks
    memory = runs["none"]["memory"]
    assert memory["rank"] == 0
    # fp32: no main copies, one gradient per weight, Adam keeps two moments per weight
    assert memory["grads_bytes"] == memory["params_bytes"] > 0
    assert memory["optimizer_state_bytes"] >= 2 * memory["params_bytes"]


def test_bf16_trains_close_to_fp32_with_fp32_main_weights(tiny_manifest: dict) -> None:
    fp32 = _run(dict(tiny_manifest), 3, precision="fp32")
    bf16 = _run(tiny_manifest, 3, precision="bf16")
    deviation = max(abs(a - b) for a, b in zip(bf16["loss_curve"], fp32["loss_curve"], strict=True))
    assert 0 < deviation < 0.01, (bf16["loss_curve"], fp32["loss_curve"])
    # bf16 LLM weights (2 bytes) + fp32 main copies (4) for the LLM; fp32 gradients throughout
    assert bf16["memory"]["params_bytes"] > fp32["memory"]["params_bytes"]
    assert bf16["memory"]["grads_bytes"] == fp32["memory"]["grads_bytes"]
    assert bf16["memory"]["activation_peak_bytes"] < fp32["memory"]["activation_peak_bytes"]


def test_recompute_layers_need_full(tiny_manifest: dict) -> None:
    tiny_manifest["spec"]["trainer"]["train"].update(recompute="selective", recomputeLayers=1)
    with pytest.raises(ManifestError, match="recomputeLayers applies to recompute: full"):
        parse_manifest(tiny_manifest)


def test_sequence_parallel_defaults_and_errors(tiny_manifest: dict) -> None:
    from omni_trainer.distributed.layout import layout_for

    par = tiny_manifest["spec"]["trainer"].setdefault("parallelism", {})
    assert parse_manifest(tiny_manifest).spec.trainer.parallelism.sequence_parallel_on is False
    par["tensor"] = 2
    assert parse_manifest(tiny_manifest).spec.trainer.parallelism.sequence_parallel_on is True
    par["sequenceParallel"] = False
    assert parse_manifest(tiny_manifest).spec.trainer.parallelism.sequence_parallel_on is False
    par.update(tensor=1, sequenceParallel=True)
    with pytest.raises(ManifestError, match="set tensor > 1 or drop sequenceParallel"):
        parse_manifest(tiny_manifest)
    par.update(tensor=2, context=2)
    with pytest.raises(ManifestError, match="sequenceParallel with context > 1"):
        parse_manifest(tiny_manifest)
    par.update(tensor=4, context=1)
    tiny_manifest["spec"]["trainer"]["data"]["seqLength"] = 258
    with pytest.raises(ManifestError, match=r"seqLength \(258\) must be a multiple of"):
        layout_for(parse_manifest(tiny_manifest).spec.trainer, 4)
