"""Tar shards: round trips on a local directory and on a real S3 endpoint (moto server)."""

from __future__ import annotations

import glob
import logging
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest

from omni_trainer.data import (
    DataConfig,
    MediaGeometry,
    MultimodalStream,
    Sample,
    ShardSource,
    ShardSourceConfig,
    write_shards,
)
from omni_trainer.data.shards import NPY_HEADER_PEEK
from omni_trainer.data.synthetic import SyntheticSource

from ...shard_fixtures import make_fixture_shards


def shard_source(
    url: str,
    modality: str,
    geometry: MediaGeometry,
    seq_length: int = 256,
) -> ShardSource:
    cfg = ShardSourceConfig(kind="shards", name=f"s-{modality}", modality=modality, url=url)
    return ShardSource(cfg, source_index=0, geometry=geometry, seq_length=seq_length)


def same(a: Sample, b: Sample, a_source, b_source) -> None:
    """Equal samples; their media equal once each source loads its own reference."""
    assert (a.sample_id, a.modality, a.media_tokens) == (b.sample_id, b.modality, b.media_tokens)
    np.testing.assert_array_equal(a.text, b.text)
    if a.media is None:
        assert b.media is None
    else:
        assert a.media.shape == b.media.shape
        np.testing.assert_array_equal(a_source.load_media(a.media), b_source.load_media(b.media))


class ReadLog:
    """Wraps a source's storage reads: (start, end) of every byte range it fetched."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, reader: ShardSource) -> None:
        self.ranges: list[tuple[int, int]] = []
        read = reader._read

        def logged(shard: str, start: int | None = None, end: int | None = None) -> bytes:
            data = read(shard, start, end)
            self.ranges.append((start or 0, (start or 0) + len(data)))
            return data

        monkeypatch.setattr(reader, "_read", logged)

    def take(self) -> int:
        """Bytes fetched since the last call."""
        total = sum(end - start for start, end in self.ranges)
        self.ranges.clear()
        return total


def lazy_reads_match_eager(
    monkeypatch: pytest.MonkeyPatch, reader: ShardSource, gen: SyntheticSource, index: int
) -> None:
    """``get`` fetches json, text and the media header only; ``load_media`` one range holding
    the media member, which decodes to what the generator wrote."""
    log = ReadLog(monkeypatch, reader)
    sample = reader.get(index)
    entry = reader._entries[index]
    json_offset, _ = entry.members["json"]
    media_offset, media_size = entry.members["media.npy"]
    head = log.take()  # one range: json, text, the tar headers between them, the .npy header
    assert head == media_offset + NPY_HEADER_PEEK - json_offset < media_size
    pixels = reader.load_media(sample.media)
    assert log.take() == media_size  # the member: .npy header + float32 data
    np.testing.assert_array_equal(pixels, gen.load_media(gen.get(index).media))
    assert pixels.dtype == np.float32 and pixels.nbytes == sample.media.nbytes


def synthetic(modality: str, geometry: MediaGeometry, **kw: object) -> SyntheticSource:
    from omni_trainer.data import SyntheticSourceConfig

    cfg = SyntheticSourceConfig.model_validate(
        {"kind": "synthetic", "name": modality, "modality": modality, **kw}
    )
    return SyntheticSource(
        cfg, source_index=0, seed=5, vocab_size=256, geometry=geometry, seq_length=256
    )


def test_local_round_trip_random_access(tmp_path: Path, geometry: MediaGeometry) -> None:
    src = synthetic("image", geometry, preset="refcocog", lengthScale=0.05)
    originals = [src.get(i) for i in range(11)]
    paths = write_shards(
        originals, str(tmp_path / "img"), samples_per_shard=4, load_media=src.load_media
    )
    assert [os.path.basename(p) for p in paths] == [f"shard-00000{i}.tar" for i in range(3)]
    with tarfile.open(paths[0]) as tar:  # a plain POSIX tar, WebDataset member names
        assert tar.getnames()[:3] == ["000000000.json", "000000000.text.npy", "000000000.media.npy"]
    reader = shard_source(str(tmp_path / "img"), "image", geometry)
    assert reader.num_samples == 11
    for i in (10, 0, 5, 4):
        got = reader.get(i)
        assert got.key == (0, i)
        same(got, originals[i], reader, src)
    same(reader.get(11), originals[0], reader, src)  # next epoch wraps
    for idx in glob.glob(str(tmp_path / "img" / "*.index.json")):
        os.remove(idx)
    scanned = shard_source(str(tmp_path / "img" / "shard-*.tar"), "image", geometry)
    same(scanned.get(6), originals[6], scanned, src)


def test_local_media_is_read_only_when_loaded(
    tmp_path: Path, geometry: MediaGeometry, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = synthetic("image", geometry, preset="openimages", lengthScale=0.05)
    write_shards(
        (src.get(i) for i in range(6)),
        str(tmp_path),
        samples_per_shard=4,
        load_media=src.load_media,
    )
    reader = shard_source(str(tmp_path), "image", geometry)
    for i in (0, 5):
        lazy_reads_match_eager(monkeypatch, reader, src, i)


def test_oversized_media_is_skipped_and_long_text_chunked(
    tmp_path: Path, geometry: MediaGeometry, caplog: pytest.LogCaptureFixture
) -> None:
    urls = make_fixture_shards(
        str(tmp_path),
        n=12,
        seed=1,
        geometry=geometry,
        vocab_size=256,
        modalities=("image", "text"),
        seq_length=256,
        length_scale=0.04,
    )
    reader = shard_source(urls["image"], "image", geometry, seq_length=64)
    sizes = [shard_source(urls["image"], "image", geometry).get(i).media_tokens for i in range(12)]
    assert any(n >= 64 for n in sizes) and any(n < 64 for n in sizes)
    cfg = DataConfig.model_validate(
        {
            "seqLength": 64,
            "globalBatchSize": 4,
            "microBatchSize": 1,
            "packBuffer": 4,
            "sources": [
                {"kind": "shards", "name": "img", "modality": "image", "url": urls["image"]},
                {"kind": "shards", "name": "txt", "modality": "text", "url": urls["text"]},
            ],
        }
    )
    with caplog.at_level(logging.WARNING, logger="omni_trainer.data"):
        stream = MultimodalStream(cfg, seed=0, vocab_size=256, geometry=geometry)
        ids = [
            seg.sample_id for _ in range(6) for seq in stream.next_batch() for seg in seq.segments
        ]
    assert stream.counters["skipped"]["img"] > 0
    assert stream.counters["skipped_samples"] == {"too_long": stream.counters["skipped"]["img"]}
    assert "skipping" in caplog.text and "seqLength is 64" in caplog.text
    assert reader.get(int(np.argmax(sizes))).reason == "too_long"
    assert any("#1" in i for i in ids), "long text must arrive as chunks"
    assert not any("image" in i and "#" in i for i in ids)


def test_s3_round_trip_through_the_loader(
    s3_bucket: str, geometry: MediaGeometry, monkeypatch: pytest.MonkeyPatch
) -> None:
    urls = make_fixture_shards(
        f"s3://{s3_bucket}/fixture",
        n=10,
        seed=2,
        geometry=geometry,
        vocab_size=256,
        modalities=("image", "audio"),
        samples_per_shard=4,
    )
    assert urls["audio"] == f"s3://{s3_bucket}/fixture/audio"
    reader = shard_source(urls["audio"], "audio", geometry)
    assert reader.num_samples == 10 and len(reader.shards) == 3
    gen = synthetic("audio", geometry, preset="librispeech", lengthScale=0.02)
    gen_fixture = SyntheticSource(
        gen.config.model_copy(update={"name": "fixture-audio"}),
        source_index=1,
        seed=2,
        vocab_size=256,
        geometry=geometry,
        seq_length=256,
    )
    expected = gen_fixture.get(7)
    same(reader.get(7), expected, reader, gen_fixture)
    lazy_reads_match_eager(monkeypatch, reader, gen_fixture, 6)
    cfg = DataConfig.model_validate(
        {
            "seqLength": 256,
            "globalBatchSize": 2,
            "microBatchSize": 1,
            "sources": [
                {"kind": "shards", "name": m, "modality": m, "url": u} for m, u in urls.items()
            ],
        }
    )
    a = MultimodalStream(cfg, seed=0, vocab_size=256, geometry=geometry)
    batch = a.next_batch()
    assert {s.modality for seq in batch for s in seq.samples} == {"image", "audio"}
    b = MultimodalStream(cfg, seed=0, vocab_size=256, geometry=geometry)
    b.load_state_dict(a.state_dict())
    assert [s.sample_id for seq in a.next_batch() for s in seq.samples] == [
        s.sample_id for seq in b.next_batch() for s in seq.samples
    ]


def test_missing_shards_name_the_url(tmp_path: Path, geometry: MediaGeometry) -> None:
    with pytest.raises(FileNotFoundError, match=r"matches no \.tar shards"):
        shard_source(str(tmp_path / "nothing"), "image", geometry)
