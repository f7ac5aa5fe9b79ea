"""``omni generate``: greedy decoding with the job's model in one process (CPU or one GPU)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from omni_trainer.data.sample import media_geometry
from omni_trainer.interop.source import HFModelError


@dataclass
class Generation:
    prompt_ids: list[int]
    output_ids: list[int]
    output_text: str
    logprobs: list[float]
    """log-probability of each output token under the model (greedy: the largest)."""

    def as_dict(self) -> dict:
        return asdict(self)


def eos_ids(tokenizer, generation_config: dict | None) -> set[int]:
    """Tokens that end generation: the tokenizer's EOS and generation_config.json's."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    configured = (generation_config or {}).get("eos_token_id")
    if configured is not None:
        ids.update(configured if isinstance(configured, list) else [configured])
    return ids


@torch.no_grad()
def greedy(
    chunk,
    ids: list[int],
    *,
    max_new_tokens: int,
    stop: set[int],
    vocab_size: int,
    media: MediaInput | None = None,
) -> tuple[list[int], list[float]]:
    """Append the most likely token until a stop token or ``max_new_tokens`` (no KV cache: every
    step runs the whole prefix, which is what one GPTModel forward offers; the media are encoded
    once)."""
    device = next(chunk.parameters()).device
    seq = list(ids)
    out: list[int] = []
    logprobs: list[float] = []
    for _ in range(max_new_tokens):
        logits = forward(chunk, torch.tensor([seq], device=device), media)
        last = logits[0, -1, :vocab_size].float().log_softmax(-1)
        token = int(last.argmax())
        out.append(token)
        logprobs.append(float(last[token]))
        seq.append(token)
        if token in stop:
            break
    return out, logprobs


@dataclass
class MediaInput:
    """Projected encoder features and the sequence positions they replace (in order)."""

    features: torch.Tensor
    positions: torch.Tensor
    image_grids: list[tuple[int, int, int]] = field(default_factory=list)
    """M-RoPE only: ``(offset, rows, cols)`` of each image's merged tokens."""


def image_grids(
    cfg, images: list[torch.Tensor], positions: torch.Tensor
) -> list[tuple[int, int, int]]:
    """``(offset, rows, cols)`` of each image (``positions`` lists the images' first, each
    image's tokens in a row) for M-RoPE; none for a model without it."""
    if cfg.llm.mrope_section is None:
        return []
    side = cfg.encoders.image.position_side
    grids, at = [], 0
    for image in images:
        rows, cols = image.shape[-2] // side, image.shape[-1] // side
        grids.append((int(positions[at]), rows, cols))
        at += rows * cols
    return grids


def encode_media(model, items: dict[str, list[torch.Tensor]], positions: torch.Tensor):
    """Each modality's items through its encoder + projector, in placeholder order (images
    first when both: ``positions`` lists image positions, then audio ones)."""
    features = [
        model.projectors[m](model.encoders[m](items[m])) for m in ("image", "audio") if items.get(m)
    ]
    if not features:
        return None
    joined = torch.cat(features)
    if joined.shape[0] != len(positions):
        raise HFModelError(f"{len(positions)} media positions for {joined.shape[0]} features")
    return MediaInput(joined, positions, image_grids(model.cfg, items.get("image", []), positions))


def rope_positions(chunk, length: int, media: MediaInput | None) -> torch.Tensor:
    """The LLM's ``position_ids`` of one sequence: [1, len], or with M-RoPE [3, 1, len] (text
    on all three axes alike, each image's merged tokens on its grid)."""
    if chunk.position_embedding_type != "mrope":
        return torch.arange(length)[None]
    from omni_trainer.interop.qwen2_5_vl import mrope_positions

    grids = media.image_grids if media is not None else []
    return torch.from_numpy(mrope_positions(length, grids))[:, None]


def forward(chunk, ids: torch.Tensor, media: MediaInput | None = None) -> torch.Tensor:
    """One forward of the LLM on one sequence ([1, len] ids), media features written at their
    positions -> [1, len, padded vocab]."""
    positions = rope_positions(chunk, ids.shape[1], media).to(ids.device)
    emb = None
    if media is not None:
        emb = chunk.embedding(input_ids=ids, position_ids=positions)  # [len, 1, hidden]
        emb = emb.index_copy(0, media.positions, media.features[:, None].to(emb.dtype))
    return chunk(
        input_ids=ids,
        position_ids=positions,
        attention_mask=None,  # one causal sequence: no boundaries needed
        decoder_input=emb,
    )


def logits(
    model,
    ids: torch.Tensor,
    *,
    images: list[torch.Tensor] | None = None,
    image_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """One forward of a TP = PP = 1 ``OmniModel`` on one sequence: [1, len] ids, the images'
    projected features written at ``image_positions`` (in order), -> [1, len, padded vocab]."""
    (chunk,) = model.llm_chunks
    media = encode_media(model, {"image": images or []}, image_positions)
    return forward(chunk, ids, media)


def generate(
    cfg,
    prompt: str,
    *,
    checkpoint: str | None,
    images: list[Path],
    audio: list[Path],
    raw: bool,
    max_new_tokens: int,
) -> Generation:
    """The prompt (one chat turn, or ``raw``) with its media, greedily continued.

    Raises:
        HFModelError: no usable tokenizer, media the model cannot take, placeholders that do
            not match the items (each named with the fix).
    """
    from omni_trainer.data.chat import wrapped_image
    from omni_trainer.interop.media_prompt import (
        PLACEHOLDERS,
        item_tokens,
        load_items,
        media_prompt,
        place_media,
    )
    from omni_trainer.interop.runtime import hf_files_dir, single_process_model
    from omni_trainer.interop.tokenizer import load_checked_tokenizer

    tok = load_checked_tokenizer(cfg)
    items = load_items(cfg, images, audio)
    tokens = item_tokens(cfg, items)
    text = place_media(tok, prompt, {m: len(x) for m, x in items.items()}, raw=raw)
    image = wrapped_image(tok, media_geometry(cfg.model).image_wrap)  # as training renders images
    text = text.replace(PLACEHOLDERS["image"], image)
    placed = media_prompt(tok, text, tokens, raw=raw)
    gen_file = hf_files_dir(cfg.tokenizer) / "generation_config.json"
    gen_cfg = json.loads(gen_file.read_text()) if gen_file.is_file() else None
    length = len(placed.ids) + max_new_tokens
    with (
        single_process_model(cfg, checkpoint=checkpoint, max_sequence_length=length) as (
            model,
            _,
        ),
        torch.no_grad(),
    ):
        device = next(model.parameters()).device
        moved = {m: [x.to(device) for x in xs] for m, xs in items.items()}
        media = encode_media(model, moved, placed.positions.to(device))
        out, logprobs = greedy(
            model.llm_chunks[0],
            placed.ids,
            max_new_tokens=max_new_tokens,
            stop=eos_ids(tok, gen_cfg),
            vocab_size=cfg.model.llm.vocab_size,
            media=media,
        )
    return Generation(placed.ids, out, tok.decode(out, skip_special_tokens=True), logprobs)
