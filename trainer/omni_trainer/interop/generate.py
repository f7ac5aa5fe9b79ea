"""``omni generate``: greedy decoding with the job's model in one process (CPU or one GPU)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

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


def prompt_ids(tokenizer, prompt: str, *, raw: bool) -> list[int]:
    """One user turn through the chat template with the generation prompt, or (``raw``) the
    prompt's own tokens."""
    if raw:
        return list(tokenizer(prompt).input_ids)
    if not tokenizer.chat_template:
        raise HFModelError(
            "the tokenizer has no chat template: pass --raw to feed the prompt as is"
        )
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer(text, add_special_tokens=False).input_ids)


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
    chunk, ids: list[int], *, max_new_tokens: int, stop: set[int], vocab_size: int
) -> tuple[list[int], list[float]]:
    """Append the most likely token until a stop token or ``max_new_tokens`` (no KV cache: every
    step runs the whole prefix, which is what one GPTModel forward offers)."""
    device = next(chunk.parameters()).device
    seq = list(ids)
    out: list[int] = []
    logprobs: list[float] = []
    for _ in range(max_new_tokens):
        tokens = torch.tensor([seq], device=device)
        positions = torch.arange(len(seq), device=device)[None]
        if chunk.position_embedding_type == "mrope":  # text: one position on all three axes
            positions = positions.expand(3, 1, -1)
        logits = chunk(
            input_ids=tokens,
            position_ids=positions,
            attention_mask=None,  # one causal sequence: no boundaries needed
        )
        last = logits[0, -1, :vocab_size].float().log_softmax(-1)
        token = int(last.argmax())
        out.append(token)
        logprobs.append(float(last[token]))
        seq.append(token)
        if token in stop:
            break
    return out, logprobs


def rope_positions(
    cfg, length: int, images: list[torch.Tensor], image_positions: torch.Tensor | None
) -> torch.Tensor:
    """The LLM's ``position_ids`` of one sequence: [1, len], or with M-RoPE [3, 1, len] (each
    image's merged tokens on its grid, ``interop.qwen2_5_vl.mrope_positions``)."""
    if cfg.llm.mrope_section is None:
        return torch.arange(length)[None]
    from omni_trainer.interop.qwen2_5_vl import mrope_positions

    side = cfg.encoders.image.position_side if images else 1
    grids = [(img.shape[-2] // side, img.shape[-1] // side) for img in images]
    starts = (
        torch.cumsum(torch.tensor([0] + [r * c for r, c in grids[:-1]]), 0).tolist()
        if grids
        else []
    )
    spans = [(int(image_positions[i]), r, c) for i, (r, c) in zip(starts, grids, strict=True)]
    return torch.from_numpy(mrope_positions(length, spans))[:, None]


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
    positions = rope_positions(model.cfg, ids.shape[1], images or [], image_positions)
    positions = positions.to(ids.device)
    emb = chunk.embedding(input_ids=ids, position_ids=positions)  # [len, 1, hidden]
    if images:
        features = model.projectors["image"](model.encoders["image"](images))
        if features.shape[0] != len(image_positions):
            raise HFModelError(
                f"{len(image_positions)} image positions for {features.shape[0]} image features"
            )
        emb = emb.index_copy(0, image_positions, features[:, None].to(emb.dtype))
    return chunk(
        input_ids=ids,
        position_ids=positions,
        attention_mask=None,  # one causal sequence: no boundaries needed
        decoder_input=emb,
    )
