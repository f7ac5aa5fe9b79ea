"""Conversations -> token ids, loss targets and media spans, through the tokenizer's chat template.

Works with stock templates (no ``{% generation %}`` needed): each message's text is the difference
between the template rendered over the messages up to it and over the messages before it; an
assistant message's loss span starts after the generation prompt (the template rendered over the
previous messages with ``add_generation_prompt``) and ends with the first special token after its
content (its end-of-turn token: ``<|eot_id|>``, ``<|im_end|>``...). A template that is not
prefix-stable (it rewrites earlier turns when a message is added) is reported, not guessed.

``<image>``, ``<audio>`` and ``<video>`` in a message become exactly as many positions as the
encoder + projector produce for that item; the template never sees the expansion.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from omni_trainer.data.record_layouts import PART_MODALITY

PLACEHOLDER = re.compile(r"<(image|audio|video)>")
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
         "system": "system"}  # fmt: skip


class ConversationError(ValueError):
    """A conversation that cannot be rendered; ``reason`` is its skip-counter key."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Rendered:
    """One rendered conversation."""

    tokens: np.ndarray
    """int64 ids; media positions hold 0 (their embeddings replace them)."""
    targets: np.ndarray
    """bool per position: the token is a loss target (assistant replies and their end token)."""
    spans: list[tuple[str, int, int]]
    """(modality, offset, length) of each media item, in placeholder order."""
    text: str
    """The rendered text, placeholders unexpanded."""


def normalize_messages(raw: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
    """LLaVA / ShareGPT ``{from, value}`` or OpenAI ``{role, content}`` (content a string or a
    list of ``text`` and media parts, ``record_layouts.PART_MODALITY``) -> ``[{role, content}]``
    with placeholders."""
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise ConversationError("malformed", f"message {i} is not an object")
        role = m.get("role", m.get("from"))
        content = m.get("content", m.get("value"))
        if role not in ROLES:
            raise ConversationError(
                "malformed", f"message {i}: role {role!r} is not one of {sorted(ROLES)}"
            )
        if isinstance(content, list):
            parts = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text":
                    parts.append(str(part.get("text", "")))
                elif kind in PART_MODALITY:
                    parts.append(f"<{PART_MODALITY[kind]}>")
                else:
                    raise ConversationError("malformed", f"message {i}: part type {kind!r}")
            content = "".join(parts)
        if not isinstance(content, str):
            raise ConversationError("malformed", f"message {i}: content is not text")
        out.append({"role": ROLES[role], "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise ConversationError("malformed", "no assistant message (nothing to learn)")
    return out


def wrapped_image(tokenizer: Any, image_wrap: tuple[int, int] | None) -> str:
    """What each ``<image>`` becomes before tokenizing: itself, or itself between the
    ``image_wrap`` tokens (Qwen2.5-VL's ``<|vision_start|>``, ``<|vision_end|>``, as its
    processor writes them)."""
    if image_wrap is None:
        return "<image>"
    start, end = tokenizer.convert_ids_to_tokens(list(image_wrap))
    return f"{start}<image>{end}"


class ChatRenderer:
    """Renders conversations with one tokenizer's chat template."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        system_prompt: str | None = None,
        image_wrap: tuple[int, int] | None = None,
    ) -> None:
        self.tok = tokenizer
        self.system_prompt = system_prompt
        self._image = wrapped_image(tokenizer, image_wrap)
        self._special = sorted(
            {t for t in tokenizer.all_special_tokens if t}
            | {t.content for t in tokenizer.added_tokens_decoder.values() if t.special},
            key=len,
            reverse=True,
        )

    def _render(self, messages: list[dict[str, str]], generation: bool = False) -> str:
        if not messages and not generation:
            return ""
        return self.tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation
        )

    def loss_char_spans(self, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the character spans of every assistant reply + end token."""
        full = self._render(messages)
        spans: list[tuple[int, int]] = []
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            head = self._render(messages[:k], generation=True)
            upto = self._render(messages[: k + 1])
            if not upto.startswith(head) or not full.startswith(upto):
                raise ConversationError(
                    "template",
                    "the chat template is not prefix-stable (rendering a turn changes earlier "
                    "text), so assistant spans cannot be located",
                )
            reply = upto[len(head) :]
            content = m["content"].strip()
            at = reply.find(content) if content else 0
            end = len(reply)
            if at >= 0:
                after = at + len(content)
                hits = [(reply.find(t, after), t) for t in self._special]
                hits = [(i, t) for i, t in hits if i >= 0]
                if hits:
                    i, t = min(hits)
                    end = i + len(t)
            spans.append((len(head), len(head) + end))
        return full, spans

    def render(
        self, raw_messages: Sequence[dict[str, Any]], media: Sequence[tuple[str, int]] = ()
    ) -> Rendered:
        """Token ids, loss targets and media spans of one conversation.

        Args:
            raw_messages: LLaVA or OpenAI-style messages.
            media: (modality, positions) of each media item, in the order of the sample's lists
                (images, then audio, then video; each list in order); its k-th ``<modality>``
                placeholder takes the k-th item of that modality. Items without a placeholder get
                one at the start of the first user message (LLaVA's convention).

        Raises:
            ConversationError: malformed messages, a template that cannot be diffed, or more
                placeholders than media.
        """
        messages = normalize_messages(raw_messages)
        if self.system_prompt and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        messages = self._place_missing(messages, [m for m, _ in media])
        if self._image != "<image>":
            messages = [
                m | {"content": m["content"].replace("<image>", self._image)} for m in messages
            ]
        text, loss_spans = self.loss_char_spans(messages)
        queues: dict[str, list[int]] = {}
        for modality, n in media:
            queues.setdefault(modality, []).append(n)
        tokens: list[np.ndarray] = []
        targets: list[np.ndarray] = []
        spans: list[tuple[str, int, int]] = []
        pos = start = 0
        for match in [*PLACEHOLDER.finditer(text), None]:
            stop = match.start() if match else len(text)
            ids, tgt = self._encode(text, start, stop, loss_spans)
            tokens.append(ids)
            targets.append(tgt)
            pos += len(ids)
            if match is None:
                break
            modality = match.group(1)
            if not queues.get(modality):
                raise ConversationError(
                    "placeholder_mismatch", f"more <{modality}> placeholders than {modality} items"
                )
            n = queues[modality].pop(0)
            spans.append((modality, pos, n))
            tokens.append(np.zeros(n, dtype=np.int64))
            targets.append(np.zeros(n, dtype=bool))
            pos += n
            start = match.end()
        return Rendered(np.concatenate(tokens), np.concatenate(targets), spans, text)

    def _encode(
        self, text: str, start: int, stop: int, loss_spans: list[tuple[int, int]]
    ) -> tuple[np.ndarray, np.ndarray]:
        if stop <= start:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool)
        enc = self.tok(text[start:stop], add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(enc["input_ids"], dtype=np.int64)
        begins = np.asarray([a for a, _ in enc["offset_mapping"]], dtype=np.int64) + start
        tgt = np.zeros(len(ids), dtype=bool)
        for a, b in loss_spans:
            tgt |= (begins >= a) & (begins < b)
        return ids, tgt

    @staticmethod
    def _place_missing(messages: list[dict[str, str]], modalities: list[str]) -> list[dict]:
        """Add ``<modality>`` placeholders for items the text does not mention (LLaVA style)."""
        have: dict[str, int] = {}
        for m in messages:
            for p in PLACEHOLDER.findall(m["content"]):
                have[p] = have.get(p, 0) + 1
        missing = ""
        for modality in dict.fromkeys(modalities):
            extra = modalities.count(modality) - have.get(modality, 0)
            missing += f"<{modality}>\n" * max(extra, 0)
        if not missing:
            return messages
        first = next((i for i, m in enumerate(messages) if m["role"] == "user"), 0)
        out = [dict(m) for m in messages]
        out[first]["content"] = missing + out[first]["content"]
        return out
