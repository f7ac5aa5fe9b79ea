"""``omni generate --image/--audio``: the prompt's ids with each media item's positions, as the
model's HF processor builds them (LLaVA's: each ``<image>`` becomes as many ``<image>`` tokens as
the tower and projector produce, then the whole text is tokenized once).

Where the items go: ``--raw`` and prompts that write placeholders say it themselves (one per
item, in order); otherwise the chat template places them, given the user turn as the
``[{type: image}, ..., {type: text}]`` parts a processor's template renders; a template that
renders no placeholders from parts, or fails on them (string content only, as Qwen2's ChatML
concatenates ``message['content']``), gets them at the start of the turn, one per line (LLaVA's
``<image>\\n{prompt}``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from omni_trainer.data.sample import media_geometry
from omni_trainer.interop.source import HFModelError

PLACEHOLDERS = {"image": "<image>", "audio": "<audio>"}
_ANY = re.compile("|".join(re.escape(p) for p in PLACEHOLDERS.values()))


@dataclass
class MediaPrompt:
    ids: list[int]
    positions: torch.Tensor
    """Positions of the media tokens: every image's, then every audio clip's (the order the
    features are concatenated in)."""


def chat_text(tok, content) -> str:
    """One user turn (a string or a list of parts) through the chat template, generation
    prompt added."""
    if not tok.chat_template:
        raise HFModelError(
            "the tokenizer has no chat template: pass --raw to feed the prompt as is"
        )
    try:
        return tok.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
    except Exception as err:  # jinja's own errors, or a TypeError inside the template
        shape = "a string" if isinstance(content, str) else "a list of parts"
        first = (str(err).strip().splitlines() or [""])[0]
        raise HFModelError(
            f"the chat template fails on a user turn given as {shape} "
            f"({type(err).__name__}: {first}): pass --raw to feed the prompt as is"
        ) from None


def place_media(tok, prompt: str, counts: dict[str, int], *, raw: bool) -> str:
    """The text to tokenize, with one placeholder per item in ``counts`` (modality -> items;
    each modality the model has an encoder for is listed, even with 0 items)."""
    written = {m: prompt.count(PLACEHOLDERS[m]) for m in counts}
    if raw or any(written.values()) or not any(counts.values()):
        for m, n in counts.items():
            if written[m] != n:
                hint = "" if raw else " (or none, and the chat template places them)"
                raise HFModelError(
                    f"the prompt has {written[m]} {PLACEHOLDERS[m]} placeholder(s) for {n} "
                    f"--{m} item(s): write one {PLACEHOLDERS[m]} where each goes{hint}"
                )
        return prompt if raw else chat_text(tok, prompt)
    parts = [{"type": m} for m, n in counts.items() for _ in range(n)]
    try:
        text = chat_text(tok, [*parts, {"type": "text", "text": prompt}])
    except HFModelError:  # a template of strings only
        text = ""
    if text and all(text.count(PLACEHOLDERS[m]) == n for m, n in counts.items()):
        return text
    lead = "".join(f"{PLACEHOLDERS[m]}\n" * n for m, n in counts.items())
    return chat_text(tok, lead + prompt)


def placeholder_id(tok, modality: str) -> int:
    """The one token the tokenizer makes of the modality's placeholder."""
    text = PLACEHOLDERS[modality]
    ids = tok.encode(text, add_special_tokens=False)
    if len(ids) != 1 or ids[0] == tok.unk_token_id:
        raise HFModelError(
            f"--{modality}: the tokenizer has no {text} token (it encodes to {ids}); media "
            f"positions are marked with it: add {text} as a special token, as LLaVA's has"
        )
    return ids[0]


def media_prompt(tok, text: str, tokens: dict[str, list[int]], *, raw: bool) -> MediaPrompt:
    """Expand each placeholder of ``text`` to its item's token count (``tokens``: modality ->
    count per item, in order), tokenize once, and find the media positions."""
    ids_of = {m: placeholder_id(tok, m) for m, items in tokens.items() if items}
    remaining = {m: list(items) for m, items in tokens.items()}

    def expand(match: re.Match) -> str:
        modality = next(m for m, p in PLACEHOLDERS.items() if p == match.group(0))
        if not remaining.get(modality):
            return match.group(0)  # a modality this model has no items (or encoder) for
        return match.group(0) * remaining[modality].pop(0)

    ids = list(tok(_ANY.sub(expand, text), add_special_tokens=raw).input_ids)
    at = torch.tensor(ids)
    positions = [(at == ids_of[m]).nonzero()[:, 0] for m in ("image", "audio") if m in ids_of]
    found = sum(len(p) for p in positions)
    want = sum(sum(items) for items in tokens.values())
    if found != want:
        raise HFModelError(
            f"the tokenized prompt holds {found} media tokens where {want} were placed (a "
            "placeholder token also written in the prompt's text?)"
        )
    return MediaPrompt(ids, torch.cat(positions) if positions else torch.zeros(0, dtype=torch.long))


def load_items(cfg, images: list[Path], audio: list[Path]) -> dict[str, list[torch.Tensor]]:
    """Each file as its encoder's input, preprocessed as training preprocesses it: an imported
    tower's own image processor (else ``data.media``'s dynamic resolution), Whisper log-mels.

    Raises:
        HFModelError: an item for a modality the model has no encoder for.
    """
    from omni_trainer.data.media import AudioSettings, ImageSettings, read_audio

    g = media_geometry(cfg.model)
    for modality, paths in (("image", images), ("audio", audio)):
        if paths and modality not in g.encoders:
            raise HFModelError(
                f"--{modality}: the model has no {modality} encoder (model.encoders.{modality}); "
                f"it takes {', '.join(cfg.model.modalities)} only"
            )
    media = cfg.data.media
    dynamic = g.image_settings or ImageSettings(  # Qwen2.5-VL: its processor's bounds
        media.min_pixels, media.max_pixels, g.patch_size, merge_size=1
    )
    out: dict[str, list[torch.Tensor]] = {m: [] for m in g.encoders}
    for path in images:
        fixed = g.image_processor
        array = fixed.processed(str(path)) if fixed else dynamic.resized(str(path))
        out["image"].append(torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)))
    settings = AudioSettings(g.n_mels, media.sample_rate, chunk_length=None)
    for path in audio:
        mel = settings.log_mel(read_audio(str(path), settings.sampling_rate)).T
        frames = min(len(mel), g.audio_max_frames or len(mel))
        mel = mel[: frames // g.audio_subsampling * g.audio_subsampling]
        out["audio"].append(torch.from_numpy(np.ascontiguousarray(mel, dtype=np.float32)))
    return out


def item_tokens(cfg, items: dict[str, list[torch.Tensor]]) -> dict[str, list[int]]:
    """LLM positions of each item (``MediaGeometry.media_tokens``, as training counts them)."""
    from omni_trainer.data.sample import MediaRef

    g = media_geometry(cfg.model)
    return {
        m: [g.media_tokens(m, MediaRef(0, 0, tuple(x.shape))) for x in xs]
        for m, xs in items.items()
    }
