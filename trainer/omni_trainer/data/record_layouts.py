"""Where a conversation record's media are, in the layouts users' datasets already have.

- LLaVA: ``image`` (a path or a list), ``audio``, ``video`` beside ``conversations``.
- ms-swift / LLaMA-Factory: ``images``, ``audios``, ``videos`` lists beside ``messages`` or
  ShareGPT ``conversations`` (``from``/``value``); an item may be ``{path}`` or ``{bytes}``.
- OpenAI chat content parts: ``{type: image_url, image_url: {url}}`` (a path, ``file://`` or a
  ``data:`` base64 URL), ``{type: input_audio, input_audio: {data, format}}``, and the
  ``{type: image|audio|video, image|audio|video: path}`` parts of Qwen's and ms-swift's format.

Each item is a string: a path relative to the source's media root, an absolute ``file://`` URL,
or a ``data:`` URL carrying the bytes; :func:`inline_bytes` and :func:`local_path` read the last
two. The ``k``-th placeholder of a modality in the text takes the ``k``-th item of that modality:
the record's lists first, then the content parts in message order.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from omni_trainer.data.config import Modality

MEDIA_KEYS: tuple[tuple[tuple[str, ...], Modality], ...] = (
    (("image", "images"), "image"),
    (("audio", "audios"), "audio"),
    (("video", "videos"), "video"),
)
PART_MODALITY: dict[str, Modality] = {
    "image": "image", "image_url": "image", "audio": "audio", "input_audio": "audio",
    "audio_url": "audio", "video": "video", "video_url": "video",
}  # fmt: skip


def _item(value: Any) -> str | None:
    """One listed item as a string: a path or URL, ``{path}``/``{url}``, or ``{bytes}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        if isinstance(value.get("bytes"), bytes | bytearray) and value["bytes"]:
            return "data:;base64," + base64.b64encode(value["bytes"]).decode()
        for key in ("path", "url"):
            if isinstance(value.get(key), str) and value[key]:
                return value[key]
    return None


def _part_item(part: dict[str, Any], kind: str) -> str | None:
    """The media a content part carries (None: a bare ``{type: image}`` naming a listed item)."""
    value = part.get(kind)
    if kind == "input_audio" and isinstance(value, dict) and isinstance(value.get("data"), str):
        return f"data:audio/{value.get('format', 'wav')};base64,{value['data']}"
    if isinstance(value, dict):
        value = value.get("url", value.get("path"))
    return value if isinstance(value, str) and value else None


def media_of(record: dict[str, Any]) -> list[tuple[Modality, str]]:
    """(modality, item) of a record's media: its lists (images, audio, video, each in order),
    then the media its messages' content parts carry."""
    out: list[tuple[Modality, str]] = []
    for keys, modality in MEDIA_KEYS:
        for key in keys:
            value = record.get(key)
            for entry in value if isinstance(value, list) else [value] if value else []:
                item = _item(entry)
                if item is not None:
                    out.append((modality, item))
    messages = record.get("conversations", record.get("messages"))
    for message in messages if isinstance(messages, list) else []:
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else []:
            kind = part.get("type") if isinstance(part, dict) else None
            item = _part_item(part, kind) if kind in PART_MODALITY else None
            if item is not None:
                out.append((PART_MODALITY[kind], item))
    return out


def inline_bytes(item: str) -> bytes | None:
    """The bytes of a ``data:`` URL item (None: not one).

    Raises:
        ValueError: a ``data:`` URL that is not base64 or does not decode.
    """
    if not item.startswith("data:"):
        return None
    head, sep, payload = item.partition(",")
    if not sep or not head.endswith(";base64"):
        raise ValueError(f"{head[:40]}: only base64 data: URLs are read")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ValueError(f"a data: URL does not decode as base64 ({err})") from None


def local_path(item: str) -> str:
    """A ``file://`` URL as its path; any other item unchanged."""
    return item[len("file://") :] if item.startswith("file://") else item


def describe(item: str) -> str:
    """An item as skip details name it (a data: URL by its media type, not its bytes)."""
    return item.partition(",")[0] + ",..." if item.startswith("data:") else item
