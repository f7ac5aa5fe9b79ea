"""Tiny random Hugging Face models and a tokenizer, built offline from configs (no Hub access)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from omni_trainer.data.media import ImageSettings

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_SMALL = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def save_llm(path: Path, family: str, **overrides) -> Path:
    """A random Llama / Mistral / Qwen2 causal LM saved with ``save_pretrained`` (fp32)."""
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[family]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**_SMALL, **overrides}))
    _perturb(model)
    model.save_pretrained(path)
    return path


def save_tokenizer(
    path: Path,
    vocab_size: int = 300,
    chat_template: str = CHAT_TEMPLATE,
    *,
    extra_special: tuple[str, ...] = (),
) -> Path:
    """A byte-level BPE trained in-process, with a chat template (and ``extra_special``
    tokens), saved beside a model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|user|>", "<|assistant|>", "<|end|>", "<image>", *extra_special]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    text = ["the quick brown fox jumps over the lazy dog", "hello world, a tiny model speaks"]
    tok.train_from_iterator(text * 50, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|end|>", chat_template=chat_template
    )
    fast.save_pretrained(path)
    return path


def text_job(llm: dict, **trainer) -> dict:
    """A text-only OmniTrainingJob (no encoders, one synthetic text source) around ``llm``."""
    return {
        "apiVersion": "omni.megascale.io/v1alpha1",
        "kind": "OmniTrainingJob",
        "metadata": {"name": "hf-text"},
        "spec": {
            "trainer": {
                "model": {"llm": llm},
                "data": {
                    "seqLength": 64,
                    "globalBatchSize": 4,
                    "microBatchSize": 1,
                    "loaderShards": 2,
                    "sources": [
                        {
                            "kind": "synthetic",
                            "name": "text",
                            "modality": "text",
                            "preset": "longtext",
                            "lengthScale": 0.01,
                        }
                    ],
                },
                **trainer,
            }
        },
    }


_VISION = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    image_size=28,
    patch_size=7,
)


def _perturb(model) -> None:
    """Norms away from 1 and biases away from 0, so a mix-up shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))


def save_image_processor(path: Path, family: str, side: int) -> None:
    """The family's HF image processor for ``side`` x ``side`` inputs (CLIP: resize the short
    edge, center crop; SigLIP: resize), PIL backend, saved as preprocessor_config.json."""
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    if family == "clip":
        size = {"shortest_edge": side}
        processor = CLIPImageProcessorPil(size=size, crop_size={"height": side, "width": side})
    else:
        processor = SiglipImageProcessorPil(size={"height": side, "width": side})
    processor.save_pretrained(path)


def save_vision(path: Path, family: str, *, dual: bool = False, **overrides):
    """A random CLIP / SigLIP vision tower (``dual``: inside a CLIPModel / SiglipModel with a
    text tower) and its image processor saved with ``save_pretrained``; returns the vision
    model for reference outputs."""
    import transformers

    vision_cls, config_cls, dual_cls, dual_config = {
        "clip": ("CLIPVisionModel", "CLIPVisionConfig", "CLIPModel", "CLIPConfig"),
        "siglip": ("SiglipVisionModel", "SiglipVisionConfig", "SiglipModel", "SiglipConfig"),
    }[family]
    vision = {**_VISION, **overrides}
    torch.manual_seed(0)
    if dual:
        text = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                    num_attention_heads=4, vocab_size=99, bos_token_id=1, eos_token_id=2,
                    pad_token_id=0)  # fmt: skip
        model = getattr(transformers, dual_cls)(
            getattr(transformers, dual_config)(vision_config=vision, text_config=text)
        )
        _perturb(model)
        model.save_pretrained(path)
        save_image_processor(path, family, vision["image_size"])
        return model.vision_model.eval()
    model = getattr(transformers, vision_cls)(getattr(transformers, config_cls)(**vision))
    _perturb(model)
    model.save_pretrained(path)
    save_image_processor(path, family, vision["image_size"])
    return model.eval()


def save_whisper(path: Path, **overrides):
    """A random Whisper model saved with ``save_pretrained``; returns its encoder."""
    import transformers

    config = transformers.WhisperConfig(
        **{
            "d_model": 32,
            "encoder_layers": 2,
            "decoder_layers": 1,
            "encoder_attention_heads": 4,
            "decoder_attention_heads": 4,
            "encoder_ffn_dim": 48,
            "decoder_ffn_dim": 48,
            "num_mel_bins": 16,
            "max_source_positions": 12,
            "max_target_positions": 16,
            "vocab_size": 100,
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "decoder_start_token_id": 1,
            **overrides,
        }
    )
    torch.manual_seed(0)
    model = transformers.WhisperForConditionalGeneration(config)
    _perturb(model)
    model.save_pretrained(path)
    return model.model.encoder.eval()


IMAGE_TOKEN = 300
"""LLaVA's ``image_token_index`` in the tiny VLMs (inside the 512-token vocabulary)."""


def save_llava(
    path: Path,
    vision: str = "clip",
    text: str = "llama",
    *,
    image_token: int = IMAGE_TOKEN,
    **text_overrides,
):
    """A random LLaVA (CLIP / SigLIP tower + MLP projector + Llama / Qwen2) saved with
    ``save_pretrained``, with its image processor; returns the model for reference outputs."""
    import transformers

    vision_config = {"clip": transformers.CLIPVisionConfig,
                     "siglip": transformers.SiglipVisionConfig}[vision](**_VISION)  # fmt: skip
    text_config = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[text](
        **{**_SMALL, "num_hidden_layers": 2, **text_overrides}
    )
    config = transformers.LlavaConfig(
        vision_config=vision_config,
        text_config=text_config,
        image_token_index=image_token,
        vision_feature_select_strategy="default" if vision == "clip" else "full",
        vision_feature_layer=-2,
        tie_word_embeddings=text_config.tie_word_embeddings,
    )
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(config)
    _perturb(model)
    model.save_pretrained(path)
    save_image_processor(path, vision, _VISION["image_size"])
    return model.eval()


QWEN_VISION = dict(
    depth=3,
    hidden_size=32,
    intermediate_size=48,
    num_heads=4,
    patch_size=4,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=16,  # windows of 2 x 2 merged tokens
    out_hidden_size=64,
    fullatt_block_indexes=[1],
)
"""A tiny Qwen2.5-VL vision tower: 8-pixel merged tokens, window and full-attention blocks."""
QWEN_TOKENS = {"image": 300, "video": 301, "vision_start": 302, "vision_end": 303}


def save_qwen2_5_vl(path: Path, *, min_pixels: int = 8 * 8 * 4, max_pixels: int = 8 * 8 * 64):
    """A random Qwen2.5-VL (vision tower + merger + Qwen2 LLM with M-RoPE) saved with
    ``save_pretrained`` (``visual.*``, ``model.layers.*``), with its image processor; returns
    the model for reference outputs."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    text = {**_SMALL, "num_hidden_layers": 2, "bos_token_id": 1, "eos_token_id": 2,
            "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3],
                                "rope_theta": 10000.0}}  # fmt: skip
    config = transformers.Qwen2_5_VLConfig(
        vision_config=QWEN_VISION,
        text_config=text,
        image_token_id=QWEN_TOKENS["image"],
        video_token_id=QWEN_TOKENS["video"],
        vision_start_token_id=QWEN_TOKENS["vision_start"],
        vision_end_token_id=QWEN_TOKENS["vision_end"],
    )
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    _perturb(model)
    with torch.no_grad():  # sharp attention in the tower, so a wrong window or angle shows
        for block in model.model.visual.blocks:
            block.attn.qkv.weight.mul_(25.0)
    model.save_pretrained(path)
    processor = Qwen2VLImageProcessorPil(
        patch_size=QWEN_VISION["patch_size"],
        merge_size=QWEN_VISION["spatial_merge_size"],
        temporal_patch_size=QWEN_VISION["temporal_patch_size"],
        min_pixels=min_pixels,
        max_pixels=max_pixels,
    )
    processor.save_pretrained(path)
    return model.eval()


def qwen2vl_patches(image: np.ndarray, s: ImageSettings) -> tuple[np.ndarray, list[int]]:
    """Qwen2-VL's ``pixel_values`` [grid_h * grid_w, C*T*p*p] and ``[1, grid_h, grid_w]`` of one
    resized [C, H, W] image (its frame repeated over the temporal patch)."""
    c, height, width = image.shape
    p, m, t = s.patch_size, s.merge_size, s.temporal_patch_size
    gh, gw = height // p, width // p
    x = image.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, *x.shape[5:]))
    return x.reshape(gh * gw, c * t * p * p), [1, gh, gw]
