"""``s3://`` URLs and the S3 client (boto3 with retries; ``AWS_ENDPOINT_URL`` for MinIO, moto)."""

from __future__ import annotations

import os
from typing import Any


def is_s3(url: str) -> bool:
    return url.startswith("s3://")


def split_s3(url: str) -> tuple[str, str]:
    """``(bucket, key or prefix)`` of an ``s3://`` URL."""
    bucket, _, prefix = url[len("s3://") :].partition("/")
    if not bucket:
        raise ValueError(f"url {url!r}: expected s3://bucket/prefix")
    return bucket, prefix


def s3_client(
    *, max_attempts: int = 5, retry_mode: str = "standard", read_timeout: float = 60
) -> Any:
    """A boto3 S3 client of its own session (safe to create from any thread), retrying throttles
    and transient errors (``retry_mode`` as botocore names it); credentials from the standard
    chain, never logged; ``AWS_ENDPOINT_URL`` selects a non-AWS endpoint (MinIO, moto, ...)."""
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client(
        "s3",
        endpoint_url=os.environ.get("AWS_ENDPOINT_URL") or None,
        config=Config(
            retries={"max_attempts": max_attempts, "mode": retry_mode},
            connect_timeout=10,
            read_timeout=read_timeout,
        ),
    )
