"""Shared fixtures for the data-pipeline tests: a small config factory and a real S3 endpoint."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from omni_trainer.data import DataConfig, MediaGeometry

VOCAB = 256


@pytest.fixture
def geometry() -> MediaGeometry:
    return MediaGeometry()


@pytest.fixture
def make_config() -> Callable[..., DataConfig]:
    """``tiny_config`` as a fixture (test modules here are not a package)."""
    return tiny_config


def tiny_config(**overrides: Any) -> DataConfig:
    """Image + audio + text at ~2% of the paper's lengths, 256-token sequences."""
    raw: dict[str, Any] = {
        "seqLength": 256,
        "globalBatchSize": 8,
        "microBatchSize": 2,
        "packBuffer": 16,
        "sources": [
            {
                "kind": "synthetic",
                "name": "openimages",
                "modality": "image",
                "preset": "openimages",
                "lengthScale": 0.02,
            },
            {
                "kind": "synthetic",
                "name": "librispeech",
                "modality": "audio",
                "preset": "librispeech",
                "lengthScale": 0.1,
            },
            {
                "kind": "synthetic",
                "name": "longtext",
                "modality": "text",
                "preset": "longtext",
                "lengthScale": 0.05,
            },
        ],
    }
    raw.update(overrides)
    return DataConfig.model_validate(raw)


@pytest.fixture(scope="module")
def moto_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_bucket(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh bucket on the moto server, with the AWS env pointing at it."""
    import uuid

    import boto3

    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    name = f"data-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=moto_endpoint).create_bucket(Bucket=name)
    return name
