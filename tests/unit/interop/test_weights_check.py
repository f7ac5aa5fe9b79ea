"""``omni validate --sources``' header-only check of imported weights: a whole LLaVA (LLM,
tower) as transformers saves it passes, and a config.json that no longer fits is named."""

from __future__ import annotations

import json

import pytest

from omni_trainer.config import parse_manifest
from omni_trainer.interop.weights_check import check_weights

from .hf_models import save_llava
from .test_vlm_import import vlm_job


@pytest.mark.parametrize(("vision", "text"), [("clip", "llama"), ("siglip", "qwen2")])
def test_saved_llava_fits_and_a_changed_config_does_not(tmp_path, vision, text) -> None:
    overrides = {"tie_word_embeddings": True} if text == "qwen2" else {}
    save_llava(tmp_path, vision, text, **overrides)
    assert check_weights(parse_manifest(vlm_job(tmp_path)).spec.trainer.model) == []

    config = json.loads((tmp_path / "config.json").read_text())
    config["text_config"]["intermediate_size"] += 8
    (tmp_path / "config.json").write_text(json.dumps(config))
    (problem,) = check_weights(parse_manifest(vlm_job(tmp_path)).spec.trainer.model)
    assert problem.startswith(f"spec.trainer.model.hf ({tmp_path}): ")
    assert "shapes differ from config.json: " in problem and "mlp.gate_proj.weight is [" in problem
