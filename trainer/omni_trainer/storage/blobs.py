"""Reading whole files (annotations, media, tokenizer files) from a local path or ``s3://``.

Transient storage errors are retried with exponential backoff, so a slow or flaky bucket lowers
throughput instead of failing the job; a file that does not exist is reported at once.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from omni_trainer.storage.s3 import is_s3, s3_client, split_s3

log = logging.getLogger(__name__)

RETRIES = 4
"""Attempts after the first one before a read error is final."""
BACKOFF_S = 0.2
"""First retry delay; doubled on every further attempt."""

_client: Any = None


def _s3() -> Any:
    global _client
    if _client is None:
        _client = s3_client()
    return _client


def join(root: str, rel: str) -> str:
    """``rel`` under ``root`` (a directory or an ``s3://`` prefix); absolute ``rel`` wins."""
    if not root or is_s3(rel) or os.path.isabs(rel):
        return rel
    return f"{root.rstrip('/')}/{rel}" if is_s3(root) else os.path.join(root, rel)


def _missing(err: BaseException) -> bool:
    if isinstance(err, FileNotFoundError):
        return True
    response = getattr(err, "response", None) or {}
    code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
    return code in {"NoSuchKey", "404", "NotFound"}


def read_bytes(url: str, start: int | None = None, end: int | None = None) -> bytes:
    """The object at ``url`` (a local path or ``s3://bucket/key``), or its bytes [start, end).

    Raises:
        FileNotFoundError: it does not exist (never retried).
        OSError: it could not be read after ``RETRIES`` retries with backoff.
    """
    for attempt in range(RETRIES + 1):
        try:
            if is_s3(url):
                bucket, key = split_s3(url)
                extra = {} if start is None else {"Range": f"bytes={start}-{end - 1}"}
                return _s3().get_object(Bucket=bucket, Key=key, **extra)["Body"].read()
            with open(url, "rb") as f:
                if start is None:
                    return f.read()
                f.seek(start)
                return f.read(end - start)
        except Exception as err:
            if _missing(err) or isinstance(err, IsADirectoryError):
                raise FileNotFoundError(f"{url}: no such file") from None
            if attempt == RETRIES:
                raise OSError(f"{url}: read failed after {RETRIES + 1} attempts: {err}") from err
            delay = BACKOFF_S * 2**attempt
            log.warning("reading %s failed (%s); retrying in %.1fs", url, err, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


def list_dir(url: str) -> list[str]:
    """File names directly under a directory or ``s3://`` prefix."""
    if is_s3(url):
        bucket, prefix = split_s3(url)
        prefix = prefix.rstrip("/") + "/" if prefix else ""
        pages = _s3().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        keys = [o["Key"][len(prefix) :] for page in pages for o in page.get("Contents", [])]
        return sorted(k for k in keys if k and "/" not in k)
    return sorted(n for n in os.listdir(url) if os.path.isfile(os.path.join(url, n)))
