"""Imported multimodal models train the same at every layout as in one process (step losses
within 1e-6, gradients after step 1 alike), all in one torchrun launch of two ranks:

* imported encoders (a CLIP tower whose class token is dropped from the output, a Whisper
  encoder) at tp2 (long samples Ulysses-sharded over the stage's two ranks, the class token's
  block outputs on the first rank), pp2 (the towers on both stages) and tp2 with ZeRO-2 encoders;
* a whole LLaVA (``model.hf``: SigLIP tower, projector, Qwen2 with tied embeddings) at tp2 and
  pp2;
* a whole Qwen2.5-VL (``model.hf``: window-attention tower with 2x2 merger, Qwen2 with M-RoPE,
  3D positions on every stage) at tp2 (long images Ulysses-sharded in whole merge blocks) and pp2.

Synthetic images come in many sizes, so the towers' position tables are interpolated as well."""

from __future__ import annotations

import pytest
import yaml

from ..conftest import EXAMPLES
from ..unit.interop.hf_models import save_llava, save_qwen2_5_vl, save_vision, save_whisper
from .harness import assert_same_training, launch, run_reference

pytestmark = pytest.mark.dist

STEPS = 2
ENCODER_LAYOUTS = [("tp2", 2, 1, 0), ("pp2", 1, 2, 0), ("tp2-zero2", 2, 1, 2)]
VLM_LAYOUTS = [("tp2", 2, 1, 0), ("pp2", 1, 2, 0)]


def job(model: dict, tensor: int = 1, pipeline: int = 1, zero: int = 0) -> dict:
    doc = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    trainer = doc["spec"]["trainer"]
    trainer["model"] = model
    trainer["data"]["microBatchSize"] = 2
    trainer["optimizer"]["clipGrad"] = 0.0  # compare raw gradients
    weights = (
        {"image": 1, "audio": 1, "text": 1} if "encoders" in model else {"image": 1, "text": 1}
    )
    trainer["data"]["mixture"] = [{"atTokens": 0, "weights": weights}]
    if "audio" not in weights:
        trainer["data"]["sources"] = [
            s for s in trainer["data"]["sources"] if s["modality"] != "audio"
        ]
    trainer["parallelism"] = {
        "tensor": tensor,
        "pipeline": pipeline,
        "encoder": {"eta": 8, "policy": "uniform", "zero": zero},
    }
    return doc


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("hf")
    save_vision(root / "clip", "clip", dual=True)
    save_whisper(root / "whisper")
    save_llava(root / "llava", "siglip", "qwen2", tie_word_embeddings=True)
    save_qwen2_5_vl(root / "qwen")
    encoders = {"image": {"hf": str(root / "clip")}, "audio": {"hf": str(root / "whisper")}}
    return {
        "encoders": {"llm": {"preset": "tiny"}, "encoders": encoders},
        "llava": {"hf": str(root / "llava")},
        "qwen": {"hf": str(root / "qwen")},
    }


def test_imported_models_train_alike_at_every_layout(models, tmp_path) -> None:
    references = {name: run_reference(job(model), STEPS) for name, model in models.items()}
    grads = references["encoders"]["grads"]
    assert any(k.startswith("encoders.image.blocks") for k in grads)
    assert any(k.startswith("encoders.audio.blocks") for k in grads)
    assert any(k.startswith("projectors.image") for k in references["llava"]["grads"])
    assert any(k.startswith("encoders.image.merger") for k in references["qwen"]["grads"])
    scenarios = {
        f"{name}-{layout}": job(models[name], tp, pp, zero)
        for name, layouts in (
            ("encoders", ENCODER_LAYOUTS),
            ("llava", VLM_LAYOUTS),
            ("qwen", VLM_LAYOUTS),
        )
        for layout, tp, pp, zero in layouts
    }
    out = launch(2, scenarios, STEPS, tmp_path)
    for scenario in scenarios:
        assert_same_training(out / scenario, references[scenario.split("-")[0]])
