"""Test fixture: synthetic samples written as real shard files (a directory or an s3:// url).

Only tests use it, so it lives here rather than in the package."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from omni_trainer.data.config import Modality, SyntheticSourceConfig
from omni_trainer.data.sample import MediaGeometry
from omni_trainer.data.shards import write_shards
from omni_trainer.data.synthetic import SyntheticSource

_FIXTURE_SOURCES: dict[str, dict[str, Any]] = {
    "image": {"preset": "openimages"},
    "audio": {"preset": "librispeech"},
    "text": {"preset": "longtext"},
    "video": {"length": {"mean": 3000, "sigma": 0.5, "min": 256, "max": 16384}},
}


def make_fixture_shards(
    path: str,
    n: int,
    seed: int,
    geometry: MediaGeometry,
    vocab_size: int,
    *,
    modalities: Sequence[Modality] = ("image", "audio", "text"),
    seq_length: int = 256,
    samples_per_shard: int = 8,
    length_scale: float = 0.02,
) -> dict[str, str]:
    """Write ``n`` synthetic samples per modality under ``path/<modality>/`` (dir or s3 url).

    Returns:
        modality -> url, ready for a ``ShardSourceConfig``.
    """
    urls: dict[str, str] = {}
    for i, modality in enumerate(modalities):
        cfg = SyntheticSourceConfig(
            kind="synthetic",
            name=f"fixture-{modality}",
            modality=modality,
            length_scale=length_scale,
            **_FIXTURE_SOURCES[modality],
        )
        src = SyntheticSource(
            cfg,
            source_index=i,
            seed=seed,
            vocab_size=vocab_size,
            geometry=geometry,
            seq_length=seq_length,
        )
        url = f"{path.rstrip('/')}/{modality}"
        write_shards(
            (src.get(j) for j in range(n)), url, samples_per_shard, load_media=src.load_media
        )
        urls[modality] = url
    return urls
