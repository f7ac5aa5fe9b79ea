"""``spec.trainer.tokenizer``: Hugging Face tokenizer files (a directory or ``s3://`` prefix).

Loaded offline with transformers (``tokenizer.json`` + ``tokenizer_config.json``, whose
``chat_template`` renders conversations); an ``s3://`` prefix is copied to a local cache first.
"""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile
from typing import Any

from omni_trainer.data.blobs import list_dir, read_bytes
from omni_trainer.data.shards import _is_s3

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
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


@functools.lru_cache(maxsize=8)
def load_tokenizer(path: str, *, chat_template: bool = True) -> Any:
    """The tokenizer at ``path`` (no hub access); cached per process.

    Raises:
        ValueError: naming ``spec.trainer.tokenizer``, when nothing loadable is there or it has
            no chat template (when ``chat_template``: ``omni generate --raw`` needs none).
    """
    from transformers import AutoTokenizer

    local = _local_copy(path) if _is_s3(path) else path
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
