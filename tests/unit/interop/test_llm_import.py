"""Importing HF causal LMs: our megatron GPTModel computes transformers' logits (fp32, CPU)."""

from __future__ import annotations

import json

import pytest
import torch

from omni_trainer.config import ManifestError, parse_manifest
from omni_trainer.interop.source import HFModelError
from omni_trainer.models.config import LLMConfig
from omni_trainer.models.llm import build_gpt_chunks

from .hf_models import save_llm, text_job

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
    "rope_theta": 500000.0,
}
FAMILIES = {
    "llama2": ("llama", {}),
    "llama3": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "llama-linear-rope": ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}),
    "mistral": ("mistral", {"sliding_window": None}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen2": ("qwen2", {"tie_word_embeddings": False}),
}


def our_logits(cfg: LLMConfig, tokens: torch.Tensor) -> torch.Tensor:
    (chunk,) = build_gpt_chunks(cfg, max_sequence_length=tokens.shape[1], seed=7)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        out = chunk.eval()(
            input_ids=tokens,
            position_ids=positions,
            attention_mask=None,
        )
    return out[..., : cfg.vocab_size]


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers(family, tmp_path, single_rank) -> None:
    import transformers

    kind, overrides = FAMILIES[family]
    path = save_llm(tmp_path / family, kind, **overrides)
    cfg = LLMConfig(hf=str(path))
    assert cfg.tie_embeddings == overrides.get("tie_word_embeddings", False)
    tokens = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(0))
    ref = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        expected = ref(input_ids=tokens).logits
    got = our_logits(cfg, tokens)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


def test_rope_scaling_is_read(tmp_path) -> None:
    path = save_llm(tmp_path / "m", "llama", rope_parameters=LLAMA3_ROPE)
    cfg = LLMConfig(hf=str(path))
    assert cfg.rotary_base == 500000.0
    assert cfg.rope_scaling.type == "llama3" and cfg.rope_scaling.factor == 8.0
    assert cfg.rope_scaling.original_max_position_embeddings == 16


def test_explicit_dims_beside_hf_are_an_error(tmp_path) -> None:
    path = save_llm(tmp_path / "m", "llama")
    with pytest.raises(ManifestError) as err:
        parse_manifest(text_job({"hf": str(path), "hiddenSize": 128, "preset": "tiny"}))
    msg = str(err.value)
    assert "spec.trainer.model.llm" in msg and "hiddenSize, preset cannot be set beside 'hf'" in msg


def test_unsupported_architecture_names_the_supported_list(tmp_path) -> None:
    path = save_llm(tmp_path / "m", "llama")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ManifestError) as err:
        parse_manifest(text_job({"hf": str(path)}))
    assert (
        "architecture 'GPT2LMHeadModel' is not supported as model.llm.hf (supported: "
        "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM; and as model.hf: "
        "LlavaForConditionalGeneration, Qwen2_5_VLForConditionalGeneration)" in str(err.value)
    )


def test_missing_directory_is_named(tmp_path) -> None:
    with pytest.raises(ManifestError, match=r"no config\.json"):
        parse_manifest(text_job({"hf": str(tmp_path / "nowhere")}))


def test_mis_shaped_and_missing_tensors_are_named(tmp_path, single_rank) -> None:
    from safetensors.torch import load_file, save_file

    path = save_llm(tmp_path / "m", "llama")
    cfg = LLMConfig(hf=str(path))
    weights = load_file(path / "model.safetensors")
    weights["model.layers.1.mlp.up_proj.weight"] = torch.zeros(95, 64)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(HFModelError) as err:
        our_logits(cfg, torch.zeros(1, 4, dtype=torch.long))
    assert "'model.layers.1.mlp.up_proj.weight'" in str(err.value)
    assert "has shape [95, 64], the model expects [96, 64]" in str(err.value)
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(HFModelError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' is missing"):
        our_logits(cfg, torch.zeros(1, 4, dtype=torch.long))


def test_s3_model_equals_local(tmp_path, s3_bucket, monkeypatch, single_rank) -> None:
    import boto3

    path = save_llm(tmp_path / "m", "qwen2")
    client = boto3.client("s3")
    for f in path.iterdir():
        client.upload_file(str(f), s3_bucket, f"models/qwen/{f.name}")
    monkeypatch.setenv("OMNI_HF_CACHE", str(tmp_path / "cache"))
    tokens = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(1))
    remote = our_logits(LLMConfig(hf=f"s3://{s3_bucket}/models/qwen"), tokens)
    local = our_logits(LLMConfig(hf=str(path)), tokens)
    assert torch.equal(remote, local)
