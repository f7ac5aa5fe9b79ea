"""A whole LLaVA (``model.hf``) back as ``LlavaForConditionalGeneration``, tensor by tensor.

The names on disk are the ones ``save_pretrained`` of the installed transformers writes: a
LLaVA is built on the meta device from its config.json and its in-memory names are put through
transformers' own save-time renaming (``revert_weight_conversion``: transformers 5 still writes
``language_model.model.*`` / ``vision_tower.*``). Each part is found in that model by a tensor
only it has, so the map follows whatever nesting the installed version uses.

The tower blocks past the projector's feature layer (and CLIP's ``post_layernorm``) are not in
our model: they never touch the VLM's outputs, so they are copied from the imported checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from omni_trainer.interop.encoders import PROJECTOR, hf_names
from omni_trainer.interop.llm import HFNames, split_full, tensor_map
from omni_trainer.interop.source import HFModelError

_TOWER_KEY = "embeddings.patch_embedding.weight"
_PROJECTOR_KEY = PROJECTOR["fc1"] + ".weight"
PROCESSOR_CONFIG = "processor_config.json"
LLAVA_TOWERS = ("clip", "siglip")


@dataclass(frozen=True)
class LlavaLayout:
    """Where transformers keeps each part of a LLaVA, and the name each tensor is saved under."""

    llm: HFNames
    tower: str
    projector: str
    """Prefix of ``multi_modal_projector.*``."""
    saved: dict[str, str]
    """In-memory name -> name on disk, for every tensor ``save_pretrained`` writes."""
    shapes: dict[str, list[int]]
    """In-memory name -> the shape transformers' model has for it."""


def _prefix(keys: list[str], suffix: str, what: str) -> str:
    found = [k[: -len(suffix)] for k in keys if k == suffix or k.endswith("." + suffix)]
    if len(found) != 1:
        raise HFModelError(f"transformers' LLaVA has {len(found)} {what}s (*{suffix})")
    return found[0]


def llava_layout(config: dict[str, Any], *, tied: bool) -> LlavaLayout:
    """The installed transformers' names for a LLaVA of ``config`` (no weights allocated)."""
    import transformers
    from transformers.core_model_loading import revert_weight_conversion

    with torch.device("meta"):
        model = transformers.LlavaForConditionalGeneration(
            transformers.LlavaConfig.from_dict(config)
        )
    shapes = {k: list(t.shape) for k, t in model.state_dict().items()}
    keys = list(shapes)
    head = _prefix(keys, "lm_head.weight", "output layer") + "lm_head.weight"
    if tied:  # save_pretrained writes a tied head once, as the embedding
        keys.remove(head)
    renamed = revert_weight_conversion(model, {k: torch.tensor(i) for i, k in enumerate(keys)})
    if len(renamed) != len(keys) or any(t.ndim for t in renamed.values()):
        raise HFModelError(
            f"transformers {transformers.__version__} converts LLaVA tensors on save beyond "
            "renaming them, which this export does not reproduce"
        )
    return LlavaLayout(
        llm=HFNames(model=_prefix(keys, "embed_tokens.weight", "language model"), head=head),
        tower=_prefix(keys, _TOWER_KEY, "vision tower"),
        projector=_prefix(keys, _PROJECTOR_KEY, "projector"),
        saved={keys[int(i)]: name for name, i in renamed.items()},
        shapes=shapes,
    )


def llava_tensors(model, cfg, layout: LlavaLayout, reader) -> Iterator[tuple[str, torch.Tensor]]:
    """(in-memory name, tensor) of every tensor the layout saves: the LLM, tower and projector
    from ``model`` (a TP = PP = 1 ``OmniModel``), the unused tower tail from ``reader`` (the
    imported checkpoint).

    Raises:
        HFModelError: a tensor the LLaVA needs that neither holds (named, with its shape).
    """
    from omni_trainer.models.init import global_llm_names

    llm, image = cfg.model.llm, cfg.model.encoders.image
    done: set[str] = set()
    (chunk,) = model.llm_chunks
    for name, param in global_llm_names(chunk).items():
        for hf, tensor in split_full(tensor_map(name, llm, layout.llm), llm, param.data).items():
            done.add(hf)
            yield hf, tensor
    for name, param in model.encoders["image"].named_parameters():
        names = hf_names(name, image.tower.family, layout.tower)
        for hf, tensor in zip(names, param.data.chunk(len(names)), strict=True):
            done.add(hf)
            yield hf, tensor
    for name, param in model.projectors["image"].named_parameters():
        layer, kind = name.split(".")
        hf = f"{layout.projector}{PROJECTOR[layer]}.{kind}"
        done.add(hf)
        yield hf, param.data
    source = reader.prefix_of(_TOWER_KEY, "vision tower")
    for key in layout.saved:
        if key in done:
            continue
        if not key.startswith(layout.tower):
            raise HFModelError(f"export: the model holds no tensor for the LLaVA's {key!r}")
        yield key, reader.read(source + key[len(layout.tower) :], expect=layout.shapes[key])


def composed_config(cfg, text_config: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """A LLaVA config.json for an LLM with an imported CLIP / SigLIP tower and its projector
    (``model.llm`` + ``model.encoders.image.hf``: LLaVA's own recipe), or (None, why not).

    LLaVA marks image positions with one token, which the job's tokenizer must have
    (``<image>``); the tower's feature layer and select strategy are the manifest's.
    """
    import transformers

    from omni_trainer.interop.media_prompt import placeholder_id
    from omni_trainer.interop.source import read_config

    image = cfg.model.encoders.image
    if image is None:
        return None, ""
    if image.tower is None:
        return None, "the image encoder is this project's own architecture (no HF family holds it)"
    if image.tower.family not in LLAVA_TOWERS:
        return None, f"a LLaVA holds CLIP / SigLIP towers, not a {image.tower.family} one"
    try:
        from omni_trainer.interop.tokenizer import load_checked_tokenizer

        token = placeholder_id(load_checked_tokenizer(cfg), "image")
    except ValueError as err:
        return None, f"a LLaVA needs an image token: {err}"
    raw = read_config(image.hf)
    vision = dict(raw.get("vision_config") or raw)
    vision["model_type"] = f"{image.tower.family}_vision_model"
    config = transformers.LlavaConfig(
        text_config=text_config,
        vision_config=vision,
        image_token_index=token,
        vision_feature_layer=image.feature_layer,
        vision_feature_select_strategy=image.feature_select,
        image_seq_length=image.num_tokens(image.tower.image_size, image.tower.image_size),
        tie_word_embeddings=cfg.model.llm.tie_embeddings,
    )
    return {**config.to_dict(), "architectures": ["LlavaForConditionalGeneration"]}, ""


def write_processor(root: Path, cfg) -> str | None:
    """``processor_config.json`` of a composed LLaVA, written by transformers' own
    ``LlavaProcessor`` from the tokenizer and image processor already in ``root`` (so
    ``AutoProcessor`` expands ``<image>`` as training did); None without an image processor or
    a tokenizer."""
    import tempfile

    import transformers

    if not all((root / f).is_file() for f in ("preprocessor_config.json", "tokenizer_config.json")):
        return None
    image = cfg.model.encoders.image
    processor = transformers.LlavaProcessor(
        image_processor=transformers.AutoImageProcessor.from_pretrained(root),
        tokenizer=transformers.AutoTokenizer.from_pretrained(root),
        patch_size=image.patch_size,
        vision_feature_select_strategy=image.feature_select,
        num_additional_image_tokens=image.prefix_tokens,
    )
    with tempfile.TemporaryDirectory(dir=root) as scratch:
        processor.save_pretrained(scratch)
        os.replace(Path(scratch) / PROCESSOR_CONFIG, root / PROCESSOR_CONFIG)
    return PROCESSOR_CONFIG
