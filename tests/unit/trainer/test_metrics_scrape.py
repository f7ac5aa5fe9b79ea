"""A short real training run exports over HTTP what its summary says (tokens/s, MFU, loss)."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from omni_trainer.components.metrics import TrainerMetrics
from omni_trainer.config import parse_manifest
from omni_trainer.trainer import Trainer


def _scrape(port: int) -> dict[str, list]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def _value(families: dict, name: str, **labels: str) -> float:
    """A sample by its exposed name (counters: ``..._total``; their family drops the suffix)."""
    family = families[name.removesuffix("_total")]
    for sample in family:
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
            return sample.value
    raise KeyError(f"{name}{labels}")


def test_scraped_metrics_agree_with_summary(single_rank, tiny_manifest) -> None:
    cfg = parse_manifest(tiny_manifest).spec.trainer
    metrics = TrainerMetrics(job="tiny-cpu", rank=0, stage=0)
    port = metrics.serve(0, addr="127.0.0.1")
    try:
        summary = Trainer(cfg, groups=single_rank, steps=4, metrics=metrics).train()
        families = _scrape(port)
    finally:
        metrics.close()
    assert _value(families, "omni_trainer_step") == 4
    assert _value(families, "omni_trainer_tokens_per_second") == pytest.approx(
        summary.tokens_per_second_curve[-1], rel=1e-9
    )
    assert _value(families, "omni_trainer_mfu_ratio") == pytest.approx(
        summary.mfu_curve[-1], rel=1e-9
    )
    assert _value(families, "omni_trainer_loss") == pytest.approx(summary.final_loss, rel=1e-9)
    images = _value(families, "omni_trainer_samples_total", modality="image")
    assert images == summary.samples_per_modality["image"]
    llm = _value(families, "omni_trainer_phase_seconds_total", phase="llm")
    assert llm > 0
