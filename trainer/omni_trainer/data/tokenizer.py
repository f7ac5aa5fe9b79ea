"""``spec.trainer.tokenizer``: Hugging Face tokenizer files (a directory or ``s3://`` prefix).

Loaded offline with transformers (``tokenizer.json`` + ``tokenizer_config.json``, whose
``chat_template`` renders conversations); an ``s3://`` prefix is copied to a local cache first.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from typing import Any

from omni_trainer.storage.blobs import list_dir, read_bytes
from omni_trainer.storage.s3 import is_s3

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


def _local_copy(url: str) -> str:
    """A local directory holding the tokenizer files found under ``url``."""
    digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    dest = os.path.join(tempfile.gettempdir(), f"omni-tokenizer-{digest}")
    os.makedirs(dest, exist_ok=True)
    for name in set(list_dir(url)) & set(TOKENIZER_FILES):
        data = read_bytes(f"{url.rstrip('/')}/{name}")
        tmp = os.path.join(dest, f".{name}.{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, os.path.join(dest, name))
    return dest


PROCESSOR_KEYS = {
    "min_pixels": "min_pixels",
    "max_pixels": "max_pixels",
    "fps": "fps",
    "max_frames": "max_frames",
    "sampling_rate": "sample_rate",
}
"""HF ``preprocessor_config.json`` keys -> ``data.media`` fields they default."""


def processor_defaults(path: str | None) -> dict[str, Any]:
    """``data.media`` defaults from the HF processor config beside the tokenizer (a model
    directory holds both): Qwen2-VL's min/max pixels (also as ``size.shortest_edge`` /
    ``longest_edge``), video fps and frames, Whisper's sampling rate. Empty without one."""
    if not path:
        return {}
    url = f"{path.rstrip('/')}/preprocessor_config.json"
    try:
        raw = json.loads(read_bytes(url))
    except (FileNotFoundError, ValueError):
        return {}
    size = raw.get("size") if isinstance(raw.get("size"), dict) else {}
    raw = {"min_pixels": size.get("shortest_edge"), "max_pixels": size.get("longest_edge")} | {
        k: v for k, v in raw.items() if v is not None
    }
    return {field: raw[key] for key, field in PROCESSOR_KEYS.items() if raw.get(key) is not None}


@functools.lru_cache(maxsize=8)
def load_tokenizer(path: str, *, chat_template: bool = True) -> Any:
    """The tokenizer at ``path`` (no hub access); cached per process.

    Raises:
        ValueError: naming ``spec.trainer.tokenizer``, when nothing loadable is there or it has
            no chat template (when ``chat_template``: ``omni generate --raw`` needs none).
    """
    from transformers import AutoTokenizer

    local = _local_copy(path) if is_s3(path) else path
    if not os.path.isdir(local):
        raise ValueError(f"spec.trainer.tokenizer: {path!r} is not a directory of tokenizer files")
    try:
        tok = AutoTokenizer.from_pretrained(local, local_files_only=True)
    except Exception as err:
        raise ValueError(
            f"spec.trainer.tokenizer: cannot load a tokenizer from {path!r} ({err}); expected "
            "Hugging Face files such as tokenizer.json and tokenizer_config.json"
        ) from None
    if chat_template and not getattr(tok, "chat_template", None):
        raise ValueError(
            f"spec.trainer.tokenizer: {path!r} has no chat_template (tokenizer_config.json or "
            "chat_template.jinja); conversations are rendered through it"
        )
    return tok
