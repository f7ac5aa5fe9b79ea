"""Shared fixtures for the data-pipeline tests: a small config factory and a real S3 endpoint."""

from __future__ import annotations

from collections.abc import Callable
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
