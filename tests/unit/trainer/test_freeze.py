"""Freeze, LR multipliers and ``checkpoint.initFrom`` (LLaVA's two stages) in a world of one."""

from __future__ import annotations

import copy

import pytest
import torch

from omni_trainer.config import parse_manifest
from omni_trainer.trainer import Trainer

PROJECTOR_ONLY = {"llm": True, "image": True, "audio": True}


def job(manifest: dict, *, freeze: dict | None = None, **trainer_overrides) -> dict:
    doc = copy.deepcopy(manifest)
    trainer = doc["spec"]["trainer"]
    trainer["data"]["mixture"] = [{"atTokens": 0, "weights": {"image": 1, "audio": 1, "text": 1}}]
    trainer["optimizer"]["clipGrad"] = 0.0
    trainer["data"].update(globalBatchSize=4, microBatchSize=2)
    trainer["lrSchedule"] = {"warmupSteps": 0, "decay": "constant"}
    model = trainer["model"]
    for name, value in (freeze or {}).items():
        section = model["llm"] if name == "llm" else model["encoders"][name]
        if isinstance(value, list):
            section["freezeLayers"] = value
        else:
            section["freeze"] = value
    trainer.update(trainer_overrides)
    return doc


def make_trainer(doc: dict, groups, steps: int = 3) -> Trainer:
    return Trainer(parse_manifest(doc).spec.trainer, groups=groups, steps=steps)


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_projector_only_stage_trains_only_projectors(tiny_manifest, single_rank) -> None:
    doc = job(tiny_manifest, freeze=PROJECTOR_ONLY)
    doc["spec"]["trainer"]["model"]["projectors"] = {"audio": {"freeze": False}}
    trainer = make_trainer(doc, single_rank)
    before = weights(trainer)
    for step in range(2):
        trainer.train_step(step)
    after = weights(trainer)
    for name, value in after.items():
        if name.startswith("projectors."):
            assert not torch.equal(value, before[name]), f"{name} did not train"
        else:
            assert torch.equal(value, before[name]), f"{name} changed although frozen"
    named = dict(trainer.model.named_parameters())
    with_state = {n for n, p in named.items() if p in trainer.optimizer.state}
    assert with_state == {n for n in named if n.startswith("projectors.")}
    assert all(p.grad is None for n, p in named.items() if not n.startswith("projectors."))


def test_frozen_modules_do_not_change_the_projector_gradients(tiny_manifest, single_rank) -> None:
    """Freezing is not an approximation: the trainable part's gradient is full training's."""
    grads = []
    for freeze in ({}, PROJECTOR_ONLY):
        trainer = make_trainer(job(tiny_manifest, freeze=freeze), single_rank, steps=1)
        trainer.train_step(0)
        grads.append({n: p.grad.clone() for n, p in trainer.model.projectors.named_parameters()})
    for name, full in grads[0].items():
        torch.testing.assert_close(grads[1][name], full, rtol=1e-5, atol=1e-7, msg=name)


def test_freeze_a_layer_range_of_the_vision_tower(tiny_manifest, single_rank) -> None:
    trainer = make_trainer(job(tiny_manifest, freeze={"image": [0, 1]}), single_rank)
    before = weights(trainer)
    for step in range(2):
        trainer.train_step(step)
    after = weights(trainer)
    changed = {n for n in after if not torch.equal(after[n], before[n])}
    image = {n for n in after if n.startswith("encoders.image.")}
    frozen = {
        n for n in image if n.startswith(("encoders.image.blocks.0.", "encoders.image.patch"))
    }
    assert frozen and not (changed & frozen)
    assert any(n.startswith("encoders.image.blocks.1.") for n in changed)


def test_lr_multipliers_scale_each_module(tiny_manifest, single_rank) -> None:
    doc = job(tiny_manifest)
    doc["spec"]["trainer"]["optimizer"]["lrMultipliers"] = {"llm": 0.5, "encoders.image": 0.1}
    trainer = make_trainer(doc, single_rank)
    trainer.train_step(0)
    lr = trainer.cfg.optimizer.lr
    modules = {id(p): n for n, p in trainer.model.named_parameters()}
    for group in trainer.optimizer.param_groups:
        names = {modules[id(p)] for p in group["params"]}
        expected = 0.5 if any(".llm_chunks." in f".{n}" for n in names) else 1.0
        if all(n.startswith("encoders.image.") for n in names):
            expected = 0.1
        assert group["lr"] == pytest.approx(lr * expected), names


def test_bad_lr_multiplier_module_is_named(tiny_manifest) -> None:
    from omni_trainer.config import ManifestError

    doc = job(tiny_manifest)
    doc["spec"]["trainer"]["optimizer"]["lrMultipliers"] = {"vision": 0.1}
    with pytest.raises(ManifestError, match=r"spec\.trainer\.optimizer\.lrMultipliers\.vision"):
        parse_manifest(doc)


def test_stage_two_starts_from_stage_one_weights_only(tiny_manifest, single_rank, tmp_path):
    stage1 = job(
        tiny_manifest,
        freeze=PROJECTOR_ONLY,
        checkpoint={"path": str(tmp_path / "stage1"), "intervalSteps": 2, "async": False},
    )
    first = make_trainer(stage1, single_rank, steps=2)
    first.train()
    trained = weights(first)
    stage2 = job(
        tiny_manifest,
        checkpoint={"path": str(tmp_path / "stage2"), "initFrom": str(tmp_path / "stage1")},
    )
    second = make_trainer(stage2, single_rank, steps=2)
    assert second.start_step == 0 and not second.optimizer.state
    for name, value in weights(second).items():
        assert torch.equal(value, trained[name]), name
    assert {n for n, p in second.model.named_parameters() if p.requires_grad} == set(trained)
