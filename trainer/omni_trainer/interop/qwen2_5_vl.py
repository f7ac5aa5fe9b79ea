"""Qwen2.5-VL: its vision tower's config.json read into our encoder fields, its language model's
as a Qwen2 with M-RoPE, and the 3D positions M-RoPE takes (torch-free: the manifest validates
with it and the data side packs with it; numpy is imported where positions are computed, since
the operator's image has none).

A Qwen2.5-VL checkpoint (``Qwen2_5_VLForConditionalGeneration``) saves the tower as ``visual.*``
and the LLM as ``model.layers.*``; a tower saved alone
(``Qwen2_5_VisionTransformerPretrainedModel``) has no prefix. Our module
(``models/encoders/qwen_vision.py``) names its parameters as transformers does, so the weight map
is the tower's prefix and nothing else.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

from omni_trainer.interop.source import HFModelError

FAMILY = "qwen2_5_vl"
ARCHITECTURES = ("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VisionTransformerPretrainedModel")
MODEL_TYPES = ("qwen2_5_vl", "qwen2_5_vl_vision")
ANCHOR = "patch_embed.proj.weight"
"""The tensor whose prefix locates the tower in a checkpoint."""
_ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "quick_gelu")
# transformers' Qwen2_5_VLVisionConfig defaults, for keys a config.json leaves out.
_DEFAULTS = dict(
    depth=32,
    hidden_size=3584,
    hidden_act="silu",
    intermediate_size=3420,
    num_heads=16,
    in_channels=3,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=112,
    out_hidden_size=3584,
    fullatt_block_indexes=(7, 15, 23, 31),
)


@dataclass(frozen=True)
class QwenVision:
    """What a Qwen2.5-VL tower's config says beyond our shape fields."""

    merge_size: int
    """Patches merged into one output token along each side (2: 2x2 patches per token)."""
    temporal_patch_size: int
    """Frames per patch; a still image is repeated over it."""
    window_units: int
    """Window side in merged tokens of the windowed-attention blocks (transformers'
    ``vit_merger_window_size``: ``window_size // merge_size // patch_size``)."""
    full_attention_blocks: tuple[int, ...]
    """Blocks attending over whole frames (the others attend within windows)."""
    out_hidden_size: int
    """The merger's output width (the LLM's hidden size)."""
    rope_theta: float
    """Base of the 2D rotary embedding."""
    image_wrap: tuple[int, int] | None = None
    """A whole VLM's ``vision_start_token_id`` and ``vision_end_token_id``: the text around
    each image's positions."""


def is_qwen_vision(config: dict[str, Any]) -> bool:
    """Whether a config.json is a Qwen2.5-VL model or its vision tower."""
    vision = config.get("vision_config") or config
    return vision.get("model_type", config.get("model_type")) in MODEL_TYPES


def _image_wrap(config: dict[str, Any]) -> tuple[int, int] | None:
    ids = config.get("vision_start_token_id"), config.get("vision_end_token_id")
    return None if None in ids else (int(ids[0]), int(ids[1]))


def vision_fields(config: dict[str, Any], where: str) -> tuple[dict[str, Any], str, QwenVision]:
    """Our vision encoder's shape fields, the activation name and the tower's settings."""
    vision = config.get("vision_config") or config
    v = {**_DEFAULTS, **{k: x for k, x in vision.items() if x is not None}}
    act = str(v["hidden_act"])
    if act not in _ACTIVATIONS:
        raise HFModelError(
            f"{where}: vision hidden_act {act!r} is not supported "
            f"(supported: {', '.join(_ACTIVATIONS)})"
        )
    patch, merge = int(v["patch_size"]), int(v["spatial_merge_size"])
    depth = int(v["depth"])
    full = tuple(int(i) for i in v["fullatt_block_indexes"])
    if any(not 0 <= i < depth for i in full):
        raise HFModelError(f"{where}: fullatt_block_indexes {list(full)} outside 0..{depth - 1}")
    if int(v["window_size"]) < patch * merge:
        raise HFModelError(
            f"{where}: window_size {v['window_size']} is smaller than one merged token "
            f"({patch * merge} pixels)"
        )
    rope = v.get("rope_parameters") or {}
    settings = QwenVision(
        merge_size=merge,
        temporal_patch_size=int(v["temporal_patch_size"]),
        window_units=int(v["window_size"]) // merge // patch,
        full_attention_blocks=full,
        out_hidden_size=int(v["out_hidden_size"]),
        rope_theta=float(rope.get("rope_theta", v.get("rope_theta", 10000.0))),
        image_wrap=_image_wrap(config),
    )
    fields = dict(
        hidden_size=int(v["hidden_size"]),
        num_layers=depth,
        num_heads=int(v["num_heads"]),
        ffn_hidden_size=int(v["intermediate_size"]),
        patch_size=patch,
        in_channels=int(v["in_channels"]),
    )
    return fields, act, settings


# -- the whole VLM: its language model and M-RoPE positions --------------------------------------

VLM = "Qwen2_5_VLForConditionalGeneration"


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """A Qwen2.5-VL ``config.json``'s language model as a Qwen2 causal LM's config.json (a v4
    config keeps the text keys at the top level)."""
    text = dict(config.get("text_config") or config)
    tied = bool(config.get("tie_word_embeddings") or text.get("tie_word_embeddings"))
    return text | {"architectures": ["Qwen2ForCausalLM"], "tie_word_embeddings": tied}


def mrope_section(config: dict[str, Any], where: str) -> list[int] | None:
    """M-RoPE's rotary channel pairs for (time, height, width), from ``rope_parameters`` (v5)
    or ``rope_scaling`` (v4); None for a 1D-RoPE model."""
    for key in ("rope_parameters", "rope_scaling"):
        section = (config.get(key) or {}).get("mrope_section")
        if section is not None:
            section = [int(s) for s in section]
            half = int(config["hidden_size"]) // int(config["num_attention_heads"]) // 2
            if len(section) != 3 or sum(section) != half:
                raise HFModelError(
                    f"{where}: mrope_section {section} must be 3 numbers summing to head_dim / 2 "
                    f"({half})"
                )
            return section
    return None


def mrope_positions(length: int, images: list[tuple[int, int, int]]) -> np.ndarray:
    """[3, length] (time, height, width) positions of one sample as transformers'
    ``get_rope_index`` computes them: text counts on in all three; an image of ``rows x cols``
    merged tokens at ``offset`` takes time = p, height = p + row, width = p + col (p: the
    position it starts at), and the text after it continues from p + max(rows, cols).

    Args:
        length: tokens in the sample.
        images: ``(offset, rows, cols)`` of each image, in order, not overlapping.
    """
    import numpy as np

    pos = np.zeros((3, length), dtype=np.int64)
    at = nxt = 0  # next token index, next position
    for offset, rows, cols in [*sorted(images), (length, 0, 0)]:
        pos[:, at:offset] = nxt + np.arange(offset - at)
        nxt += offset - at
        n = rows * cols
        if n:
            pos[0, offset : offset + n] = nxt
            pos[1, offset : offset + n] = nxt + np.repeat(np.arange(rows), cols)
            pos[2, offset : offset + n] = nxt + np.tile(np.arange(cols), rows)
            nxt += max(rows, cols)
        at = offset + n
    return pos


def batch_positions(mb, *, side: int) -> np.ndarray:
    """[3, b, s] M-RoPE positions of a collated micro-batch (``data.packing.MicroBatch``): each
    packed sample's own :func:`mrope_positions` (its images' grids from their shapes, ``side``
    pixels per merged token), 0 on padding. Media other than images count as text."""
    import numpy as np

    b, s = mb.segment_ids.shape
    pos = np.zeros((3, b, s), dtype=np.int64)
    images: dict[int, list[tuple[int, int, int]]] = {}
    for item in mb.media:
        if item.modality != "image":
            continue
        rows, cols = item.ref.shape[-2] // side, item.ref.shape[-1] // side
        if rows * cols != item.num_tokens:
            raise ValueError(
                f"{item.sample_id}: an image of {rows} x {cols} merged tokens holds "
                f"{item.num_tokens} positions"
            )
        images.setdefault(item.row, []).append((item.offset, rows, cols))
    for row in range(b):
        seg = mb.segment_ids[row]
        starts = np.flatnonzero(np.diff(seg, prepend=seg[0] - 1))
        for start, end in zip(starts, [*starts[1:], s], strict=True):
            if seg[start] < 0:
                continue
            spans = [(o - start, r, c) for o, r, c in images.get(row, []) if start <= o < end]
            pos[:, row, start:end] = mrope_positions(int(end - start), spans)
    return pos


# -- export ---------------------------------------------------------------------------------------

VISUAL = "visual."
"""Where ``Qwen2_5_VLForConditionalGeneration.save_pretrained`` puts the tower."""


def tower_tensors(model) -> Iterator[tuple[str, Any]]:
    """(HF name, tensor) of the image tower of a whole Qwen2.5-VL (``model``: a TP = PP = 1
    ``OmniModel``), named as transformers saves it: our module's names under ``visual.``."""
    for name, param in model.encoders["image"].named_parameters():
        yield VISUAL + name, param.data
