"""``omni export`` of a whole LLaVA (``model.hf``): transformers loads the result as
``LlavaForConditionalGeneration`` with the original's logits on image + text."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml
from typer.testing import CliRunner

from omni_trainer.cli import app

from .hf_models import IMAGE_TOKEN, save_llava, save_llm, save_tokenizer, save_vision, text_job
from .test_vlm_import import vlm_job


def llava_logits(path, ids: torch.Tensor, pixels: torch.Tensor) -> torch.Tensor:
    import transformers

    model = transformers.LlavaForConditionalGeneration.from_pretrained(path).eval()
    with torch.no_grad():
        return model(input_ids=ids, pixel_values=pixels).logits


def image_batch(n: int = 16, token: int = IMAGE_TOKEN) -> tuple[torch.Tensor, torch.Tensor]:
    """Two images of ``n`` positions each in one sequence of text: (ids [1, len], pixels
    [2, 3, 28, 28])."""
    gen = torch.Generator().manual_seed(4)
    text = torch.randint(4, 290, (1, 10), generator=gen)  # no special token (<image> is 3)
    image = torch.full((1, n), token)
    ids = torch.cat([text[:, :2], image, text[:, 2:7], image, text[:, 7:]], dim=1)
    return ids, torch.randn(2, 3, 28, 28, generator=gen)


@pytest.mark.parametrize(("vision", "text"), [("clip", "llama"), ("siglip", "qwen2")])
def test_llava_round_trip(tmp_path, vision, text, monkeypatch) -> None:
    import omni_trainer.interop.export as export

    monkeypatch.setattr(export, "SHARD_BYTES", 100_000)  # several shards and an index
    overrides = {"tie_word_embeddings": True} if text == "qwen2" else {}
    src = save_llava(tmp_path / "src", vision, text, **overrides)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(vlm_job(tmp_path / "src")))
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["export", str(job), "--out", str(out), "--initial-weights"])
    assert result.exit_code == 0, result.output + str(result.exception)
    assert "note:" not in result.output  # nothing skipped: the tower and projector went too

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlavaForConditionalGeneration"]
    assert (out / "preprocessor_config.json").is_file()
    # The names save_pretrained of the installed transformers writes, no more, no fewer.
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    src_model = src.__class__.from_pretrained(tmp_path / "src")
    resaved = tmp_path / "resaved"
    src_model.save_pretrained(resaved)
    from safetensors import safe_open

    assert sorted(index) == sorted(safe_open(str(resaved / "model.safetensors"), "pt").keys())

    ids, pixels = image_batch()
    want = llava_logits(tmp_path / "src", ids, pixels)
    torch.testing.assert_close(llava_logits(out, ids, pixels), want, rtol=0, atol=1e-5)


def test_llm_with_an_imported_tower_exports_as_llava(tmp_path) -> None:
    """LLaVA's own recipe (an HF LLM + an HF CLIP tower + our projector) comes back as one
    ``LlavaForConditionalGeneration`` whose logits are ours."""
    import transformers

    from omni_trainer.config import load_manifest
    from omni_trainer.interop.generate import logits
    from omni_trainer.interop.runtime import single_process_model

    llm = save_llm(tmp_path / "llm", "llama")
    save_tokenizer(llm)
    save_vision(tmp_path / "clip", "clip", dual=True)  # a dual encoder: its text tower stays
    doc = text_job({"hf": str(llm)}, seed=5)
    doc["spec"]["trainer"]["model"]["encoders"] = {
        "image": {"hf": str(tmp_path / "clip"), "featureLayer": -1, "featureSelect": "full"}
    }
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["export", str(job), "--out", str(out), "--initial-weights"])
    assert result.exit_code == 0, result.output + str(result.exception)
    assert "note:" not in result.output

    config = transformers.AutoConfig.from_pretrained(out)
    token = transformers.AutoTokenizer.from_pretrained(out).convert_tokens_to_ids("<image>")
    assert (config.image_token_id, config.vision_feature_layer) == (token, -1)
    assert config.vision_feature_select_strategy == "full" and config.image_seq_length == 17
    processor = transformers.AutoProcessor.from_pretrained(out)  # as serving loads it
    image = np.random.default_rng(0).integers(0, 256, (40, 30, 3), dtype=np.uint8)
    inputs = processor(text="hi <image>", images=[image], return_tensors="pt")
    assert inputs["pixel_values"].shape == (1, 3, 28, 28)
    assert inputs["input_ids"][0].tolist().count(token) == 17
    ids, pixels = image_batch(n=17, token=token)  # 16 patches + the class token, kept
    cfg = load_manifest(job).spec.trainer
    where = (ids[0] == token).nonzero()[:, 0]
    with single_process_model(cfg, checkpoint=None) as (model, _), torch.no_grad():
        ours = logits(model, ids, images=list(pixels), image_positions=where)
    want = ours[..., : cfg.model.llm.vocab_size]
    torch.testing.assert_close(llava_logits(out, ids, pixels), want, rtol=0, atol=1e-5)


def test_parts_no_family_holds_are_named(tmp_path) -> None:
    doc = text_job({"preset": "tiny"})
    doc["spec"]["trainer"]["model"]["encoders"] = {"image": {"preset": "vit-tiny"}}
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    result = CliRunner().invoke(
        app, ["export", str(job), "--out", str(tmp_path / "out"), "--initial-weights"]
    )
    assert result.exit_code == 0, result.output
    assert "note: not exported: the image encoder and projector: the image encoder is this " in (
        " ".join(result.output.split())
    )
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLM"
    ]


def test_unsupported_vlm_is_named_with_the_supported_list(tmp_path) -> None:
    from omni_trainer.config import ManifestError, parse_manifest

    save_llava(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["PaliGemmaForConditionalGeneration"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ManifestError) as err:
        parse_manifest(vlm_job(tmp_path))
    message = str(err.value)
    assert "'PaliGemmaForConditionalGeneration' is not supported" in message
    assert "model.hf: LlavaForConditionalGeneration" in message


def resave(path, change) -> None:
    """Rewrite the checkpoint at ``path`` with ``change(tensors)`` applied."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_and_mis_shaped_llava_tensors_are_named(tmp_path) -> None:
    from omni_trainer.config import parse_manifest
    from omni_trainer.interop.runtime import single_process_model

    save_llava(tmp_path)
    cfg = parse_manifest(vlm_job(tmp_path)).spec.trainer

    def build() -> None:
        with single_process_model(cfg, checkpoint=None):
            pass

    resave(tmp_path, lambda t: t.pop("multi_modal_projector.linear_2.bias"))
    with pytest.raises(ValueError, match=r"'multi_modal_projector\.linear_2\.bias' is missing"):
        build()
    resave(tmp_path, lambda t: t.update({"multi_modal_projector.linear_2.bias": torch.ones(63)}))
    with pytest.raises(ValueError, match=r"'multi_modal_projector\.linear_2\.bias' in .* has "
                       r"shape \[63\], the model expects \[64\]"):  # fmt: skip
        build()


def test_failed_llava_export_names_the_tensor_and_leaves_nothing(tmp_path, monkeypatch) -> None:
    """The tower's unused last block is read at export only: a mis-shaped one fails the export
    after shards were written, and nothing is left behind."""
    import omni_trainer.interop.export as export

    src = tmp_path / "src"
    save_llava(src)
    key = "vision_tower.encoder.layers.2.mlp.fc2.weight"  # block 3 of 3: past feature layer -2
    resave(src, lambda t: t.update({key: t[key][:, :-1].clone()}))
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(vlm_job(src)))
    monkeypatch.setattr(export, "SHARD_BYTES", 20_000)  # shards are flushed before the failure
    result = CliRunner().invoke(
        app, ["export", str(job), "--out", str(tmp_path / "out"), "--initial-weights"]
    )
    assert result.exit_code == 2
    assert f"tensor {key!r}" in result.output and "has shape [32, 47]" in result.output
    assert "the model expects [32, 48]" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.yaml", "src"]


def test_llm_with_a_qwen_tower_exports_the_llm_and_names_the_tower(tmp_path) -> None:
    """An HF LLM with an imported Qwen2.5-VL tower is not LLaVA's recipe (LLaVA holds CLIP /
    SigLIP towers): the LLM is written in its family and the tower is named as left out."""
    from .hf_models import save_qwen2_5_vl

    llm = save_llm(tmp_path / "llm", "llama")
    save_tokenizer(llm)  # it has <image>: only the tower's family keeps this from a LLaVA
    save_qwen2_5_vl(tmp_path / "qwen")
    doc = text_job({"hf": str(llm)})
    doc["spec"]["trainer"]["model"]["encoders"] = {"image": {"hf": str(tmp_path / "qwen")}}
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["export", str(job), "--out", str(out), "--initial-weights"])
    assert result.exit_code == 0, result.output + str(result.exception)
    assert (
        "note: not exported: the image encoder and projector: a LLaVA holds CLIP / SigLIP "
        "towers, not a qwen2_5_vl one" in " ".join(result.output.split())
    )
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
