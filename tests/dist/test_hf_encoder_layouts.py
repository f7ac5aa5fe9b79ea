"""Imported encoders (a CLIP tower whose class token is dropped from the output, a Whisper
encoder) train the same at tp2 (long samples Ulysses-sharded over the stage's two ranks, the
class token's block outputs on the first rank), pp2 (the towers on both stages) and tp2 with
ZeRO-2 encoders as in one process: step losses within 1e-6, gradients after step 1 alike.
Synthetic images come in many sizes, so the position table is interpolated as well."""

from __future__ import annotations

import pytest
import yaml

from ..conftest import EXAMPLES
from ..unit.interop.hf_models import save_vision, save_whisper
from .harness import assert_same_training, launch, run_reference

pytestmark = pytest.mark.dist

STEPS = 2
LAYOUTS = [("tp2", 2, 1, 0), ("pp2", 1, 2, 0), ("tp2-zero2", 2, 1, 2)]


def job(models, tensor: int = 1, pipeline: int = 1, zero: int = 0) -> dict:
    doc = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    trainer = doc["spec"]["trainer"]
    trainer["model"]["encoders"] = {
        "image": {"hf": models["clip"]},
        "audio": {"hf": models["whisper"]},
    }
    trainer["data"]["microBatchSize"] = 2
    trainer["optimizer"]["clipGrad"] = 0.0  # compare raw gradients
    trainer["data"]["mixture"] = [{"atTokens": 0, "weights": {"image": 1, "audio": 1, "text": 1}}]
    trainer["parallelism"] = {
        "tensor": tensor,
        "pipeline": pipeline,
        "encoder": {"eta": 8, "policy": "uniform", "zero": zero},
    }
    return doc


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("towers")
    save_vision(root / "clip", "clip", dual=True)
    save_whisper(root / "whisper")
    return {"clip": str(root / "clip"), "whisper": str(root / "whisper")}


def test_imported_encoders_train_alike_at_every_layout(models, tmp_path) -> None:
    reference = run_reference(job(models), STEPS)
    grads = reference["grads"]
    assert any(k.startswith("encoders.image.blocks") for k in grads)
    assert any(k.startswith("encoders.audio.blocks") for k in grads)
    scenarios = {name: job(models, tp, pp, zero) for name, tp, pp, zero in LAYOUTS}
    out = launch(2, scenarios, STEPS, tmp_path)
    for name in scenarios:
        assert_same_training(out / name, reference)
