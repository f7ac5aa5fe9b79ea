"""Where an HF model lives: a local directory or ``s3://bucket/prefix`` (never the Hub).

S3 models are fetched file by file into a local cache (``OMNI_HF_CACHE``, default
``~/.cache/omni/hf``) with an atomic rename per file, so ranks fetching concurrently never see a
half-written file; local directories are read in place.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from omni_trainer.storage.s3 import s3_client, split_s3

CONFIG = "config.json"


class HFModelError(ValueError):
    """An HF model that cannot be used; the message names the path, the tensor or the field."""


def _split_s3(url: str) -> tuple[str, str]:
    try:
        bucket, prefix = split_s3(url)
    except ValueError:
        raise HFModelError(f"{url}: no bucket in the S3 URL") from None
    return bucket, prefix.strip("/")


def _cache_root() -> Path:
    return Path(os.environ.get("OMNI_HF_CACHE", Path.home() / ".cache" / "omni" / "hf"))


def local_dir(path: str, *, required: str | None = CONFIG) -> Path:
    """A local directory holding the model's (or tokenizer's) files, fetched from S3 first when
    needed; ``required`` names a file that must be there."""
    if not path.startswith("s3://"):
        root = Path(path).expanduser()
        if not root.is_dir() or (required and not (root / required).is_file()):
            what = f"no {required}" if required else "no such directory"
            raise HFModelError(f"{path}: {what} (expected a Hugging Face model directory)")
        return root
    bucket, prefix = _split_s3(path)
    dest = _cache_root() / hashlib.sha256(path.rstrip("/").encode()).hexdigest()[:16]
    dest.mkdir(parents=True, exist_ok=True)
    client = s3_client()
    base = f"{prefix}/" if prefix else ""
    found = False
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=base):
        for obj in page.get("Contents", []):
            rel = obj["Key"][len(base) :]
            if not rel or "/" in rel:
                continue
            found = found or required is None or rel == required
            target = dest / rel
            if target.is_file() and target.stat().st_size == obj["Size"]:
                continue
            tmp = dest / f".{rel}.{os.getpid()}.part"
            client.download_file(bucket, obj["Key"], str(tmp))
            os.replace(tmp, target)
    if not found:
        raise HFModelError(f"{path}: no {required} (expected a Hugging Face model prefix)")
    return dest


def read_config(path: str) -> dict[str, Any]:
    """The model's ``config.json`` (for S3, only this small object is read)."""
    if path.startswith("s3://"):
        bucket, prefix = _split_s3(path)
        key = f"{prefix}/{CONFIG}" if prefix else CONFIG
        client = s3_client()
        try:
            body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
        except client.exceptions.NoSuchKey:
            raise HFModelError(f"{path}: no {CONFIG}") from None
        return json.loads(body)
    return json.loads((local_dir(path) / CONFIG).read_text())
