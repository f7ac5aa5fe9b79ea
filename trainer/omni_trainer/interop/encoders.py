"""HF -> our encoder weights: CLIP / SigLIP vision towers and Whisper's encoder
(``models/encoders/pretrained.py``), Qwen2.5-VL's vision tower (``models/encoders/qwen_vision.py``,
named as transformers names it: the map is its prefix), read tensor by tensor from safetensors.

Where the tower sits in the checkpoint is found from its keys, so one map serves a vision-only
model (``embeddings.*``), a dual encoder (``vision_model.*``; its text tower is never read) and a
VLM (``vision_tower.*``, ``model.vision_tower.*``...); Whisper's encoder under ``model.encoder.*``
or ``encoder.*``. Our fused QKV is HF's q, k and v stacked (Whisper's missing key bias: zeros).
Encoders are replicated on every rank, so each rank reads them whole.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from omni_trainer.interop import qwen2_5_vl
from omni_trainer.interop.source import HFModelError

ZERO = ""
"""A part of our tensor that the checkpoint does not hold (Whisper's key bias): zeros."""

_VISION = {
    "patch_embed.conv.weight": ("embeddings.patch_embedding.weight",),
    "patch_embed.conv.bias": ("embeddings.patch_embedding.bias",),
    "patch_embed.class_embedding": ("embeddings.class_embedding",),
    "patch_embed.position.weight": ("embeddings.position_embedding.weight",),
    "patch_embed.pre_norm.weight": ("pre_layrnorm.weight",),
    "patch_embed.pre_norm.bias": ("pre_layrnorm.bias",),
}
_VISION_BLOCK = {
    "attn_norm": "layer_norm1",
    "mlp_norm": "layer_norm2",
    "attn.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attn.proj": "self_attn.out_proj",
    "mlp.fc1": "mlp.fc1",
    "mlp.fc2": "mlp.fc2",
}
_WHISPER = {
    "conv1.weight": ("conv1.weight",),
    "conv1.bias": ("conv1.bias",),
    "conv2.weight": ("conv2.weight",),
    "conv2.bias": ("conv2.bias",),
    "positions.weight": ("embed_positions.weight",),
    "norm.weight": ("layer_norm.weight",),
    "norm.bias": ("layer_norm.bias",),
}
_WHISPER_BLOCK = {
    "attn_norm": "self_attn_layer_norm",
    "mlp_norm": "final_layer_norm",
    "attn.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attn.proj": "self_attn.out_proj",
    "mlp.fc1": "fc1",
    "mlp.fc2": "fc2",
}
_FAMILIES = {
    "clip": (_VISION, _VISION_BLOCK, "encoder.layers.", "embeddings.patch_embedding.weight"),
    "siglip": (_VISION, _VISION_BLOCK, "encoder.layers.", "embeddings.patch_embedding.weight"),
    "whisper": (_WHISPER, _WHISPER_BLOCK, "layers.", "encoder.conv1.weight"),
    qwen2_5_vl.FAMILY: ({}, {}, "blocks.", qwen2_5_vl.ANCHOR),
}
_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)\.(weight|bias)")


def hf_names(name: str, family: str, prefix: str) -> tuple[str, ...]:
    """The checkpoint tensors behind our parameter ``name``, stacked along dim 0 (``ZERO``:
    a part the checkpoint lacks)."""
    if family == qwen2_5_vl.FAMILY:
        return (prefix + name,)
    top, block, layers, _ = _FAMILIES[family]
    if name in top:
        return tuple(prefix + n for n in top[name])
    m = _BLOCK.fullmatch(name)
    if m is None or m.group(2) not in block:
        raise HFModelError(f"no Hugging Face tensor maps to the {family} parameter {name!r}")
    i, part, kind = m.groups()
    hf = block[part]
    parts = hf if isinstance(hf, tuple) else (hf,)
    if family == "whisper" and part == "attn.qkv" and kind == "bias":
        return tuple(
            ZERO if p.endswith("k_proj") else f"{prefix}{layers}{i}.{p}.bias" for p in parts
        )
    return tuple(f"{prefix}{layers}{i}.{p}.{kind}" for p in parts)


def encoder_prefix(reader, family: str) -> str:
    """Where the checkpoint holds the ``family`` tower's tensors."""
    prefix = reader.prefix_of(_FAMILIES[family][3], f"{family} tower")
    return prefix + "encoder." if family == "whisper" else prefix


@torch.no_grad()
def load_encoder(encoder: nn.Module, path: str, family: str, *, reader=None) -> None:
    """Overwrite every parameter of an imported tower with the checkpoint's at ``path``.

    Raises:
        HFModelError: a tensor is missing or its shape is not the one the model needs (both
            shapes named), or the checkpoint holds no (or several) such towers.
    """
    from omni_trainer.interop.safetensors_io import SafetensorsReader
    from omni_trainer.interop.source import local_dir

    reader = reader or SafetensorsReader(local_dir(path))
    prefix = encoder_prefix(reader, family)
    for name, param in encoder.named_parameters():
        names = hf_names(name, family, prefix)
        rows = param.shape[0] // len(names)
        expect = [rows, *param.shape[1:]]
        parts = [
            param.new_zeros(expect) if n == ZERO else reader.read(n, expect=expect) for n in names
        ]
        param.copy_(torch.cat(parts).to(param.dtype))


PROJECTOR = {"fc1": "multi_modal_projector.linear_1", "fc2": "multi_modal_projector.linear_2"}
"""Our ``Projector``'s layers <- LLaVA's (Linear, GELU, Linear, with biases)."""


@torch.no_grad()
def load_projector(projector: nn.Module, path: str, *, reader=None) -> None:
    """Overwrite the image projector with a LLaVA checkpoint's ``multi_modal_projector``."""
    from omni_trainer.interop.safetensors_io import SafetensorsReader
    from omni_trainer.interop.source import local_dir

    reader = reader or SafetensorsReader(local_dir(path))
    prefix = reader.prefix_of(PROJECTOR["fc1"] + ".weight", "image projector")
    for name, param in projector.named_parameters():
        layer, kind = name.split(".")
        hf = f"{prefix}{PROJECTOR[layer]}.{kind}"
        param.copy_(reader.read(hf, expect=list(param.shape)).to(param.dtype))
