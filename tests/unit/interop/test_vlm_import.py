"""``model.hf``: a whole LLaVA (tower, projector, language model, tokenizer, processor) from one
field, against transformers' ``LlavaForConditionalGeneration``."""

from __future__ import annotations

import pytest
import torch

from omni_trainer.config import ManifestError, parse_manifest
from omni_trainer.interop.generate import logits
from omni_trainer.interop.runtime import single_process_model

from .hf_models import IMAGE_TOKEN, save_llava, text_job


def vlm_job(path, **model) -> dict:
    doc = text_job({"preset": "tiny"})
    doc["spec"]["trainer"]["model"] = {"hf": str(path), **model}
    return doc


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    rel = (ours - ref).norm() / ref.norm()
    assert rel < 1e-4, float(rel)


@pytest.mark.parametrize(("vision", "text"), [("clip", "llama"), ("siglip", "qwen2")])
def test_llava_logits_equal_transformers(tmp_path, vision, text) -> None:
    overrides = {"tie_word_embeddings": True} if text == "qwen2" else {}
    ref = save_llava(tmp_path, vision, text, **overrides)
    cfg = parse_manifest(vlm_job(tmp_path)).spec.trainer
    image = cfg.model.encoders.image
    assert (image.feature_layer, image.feature_select) == (
        -2,
        "default" if vision == "clip" else "full",
    )
    assert cfg.tokenizer == str(tmp_path) and cfg.model.llm.tie_embeddings == bool(overrides)
    n = image.num_tokens(28, 28)
    assert n == 16
    torch.manual_seed(3)
    pixels = torch.randn(2, 3, 28, 28)
    text_ids = torch.randint(0, 290, (1, 12))
    ids = torch.cat(
        [text_ids[:, :3], torch.full((1, n), IMAGE_TOKEN), text_ids[:, 3:8],
         torch.full((1, n), IMAGE_TOKEN), text_ids[:, 8:]], dim=1,
    )  # fmt: skip
    with single_process_model(cfg, checkpoint=None) as (model, _), torch.no_grad():
        vocab = cfg.model.llm.vocab_size
        ours_text = logits(model, text_ids)[..., :vocab]
        where = (ids[0] == IMAGE_TOKEN).nonzero()[:, 0]
        ours_image = logits(model, ids, images=list(pixels), image_positions=where)[..., :vocab]
    with torch.no_grad():
        want_text = ref(input_ids=text_ids).logits
        want_image = ref(input_ids=ids, pixel_values=pixels).logits
    _close(ours_text, want_text)
    _close(ours_image, want_image)
    assert (want_image - ref(input_ids=ids, pixel_values=pixels.flip(0)).logits).abs().max() > 1e-3


def test_parts_of_the_vlm_beside_hf_are_refused(tmp_path) -> None:
    save_llava(tmp_path)
    with pytest.raises(ManifestError, match=r"llm\.numLayers, encoders\.image\.featureLayer "
                       r"cannot be set beside 'hf'"):  # fmt: skip
        parse_manifest(
            vlm_job(tmp_path, llm={"numLayers": 1}, encoders={"image": {"featureLayer": -1}})
        )
    frozen = parse_manifest(
        vlm_job(tmp_path, llm={"freeze": True}, encoders={"image": {"freeze": True}})
    ).spec.trainer.model
    assert frozen.llm.freeze and frozen.encoders.image.freeze and frozen.llm.num_layers == 2


def test_deferred_vlm_reads_nothing(tmp_path) -> None:
    cfg = parse_manifest(vlm_job("s3://bucket/llava"), defer_hf=True).spec.trainer
    assert [p for p, _ in cfg.model.unread_hf()] == ["llm", "encoders.image"]


def test_both_on_disk_layouts_import_alike(tmp_path) -> None:
    """transformers 4 saves ``language_model.model.*`` / ``vision_tower.vision_model.*``, newer
    versions ``model.language_model.*`` / ``model.vision_tower.*`` / ``lm_head``."""
    from safetensors.torch import load_file, save_file

    save_llava(tmp_path)
    cfg = parse_manifest(vlm_job(tmp_path)).spec.trainer
    ids = torch.tensor([[5, 6] + [IMAGE_TOKEN] * 16 + [7]])
    where = (ids[0] == IMAGE_TOKEN).nonzero()[:, 0]
    image = [torch.randn(3, 28, 28)]
    outputs = []
    for rename in (
        lambda k: k.replace("vision_tower.", "vision_tower.vision_model."),
        lambda k: "lm_head.weight" if k.endswith("lm_head.weight") else "model." + k.replace(
            "language_model.model.", "language_model.").replace("vision_model.", ""),
    ):  # fmt: skip
        weights = load_file(tmp_path / "model.safetensors")
        save_file({rename(k): v for k, v in weights.items()}, tmp_path / "model.safetensors")
        with single_process_model(cfg, checkpoint=None) as (model, _), torch.no_grad():
            outputs.append(logits(model, ids, images=image, image_positions=where))
    keys = load_file(tmp_path / "model.safetensors").keys()
    assert "model.language_model.embed_tokens.weight" in keys and "lm_head.weight" in keys
    assert "model.vision_tower.pre_layrnorm.weight" in keys
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)
