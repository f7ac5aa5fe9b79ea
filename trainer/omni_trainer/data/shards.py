"""WebDataset-style tar shards on a local disk or S3, read with random access.

A sample ``<key>`` is the consecutive members ``<key>.json`` ({sample_id, modality}),
``<key>.text.npy`` (int64) and, for media, ``<key>.media.npy`` (float32). Next to each
``shard-NNNNNN.tar`` the writer puts ``shard-NNNNNN.tar.index.json`` (byte ranges of every sample)
so opening a source costs one small read per shard; shards without one are scanned instead.
"""

from __future__ import annotations

import bisect
import glob
import io
import json
import logging
import os
import tarfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from omni_trainer.data.config import Modality, ShardSourceConfig, SyntheticSourceConfig
from omni_trainer.data.sample import MediaGeometry, Sample
from omni_trainer.data.synthetic import SyntheticSource

log = logging.getLogger(__name__)

INDEX_SUFFIX = ".index.json"


def _is_s3(url: str) -> bool:
    return url.startswith("s3://")


def _split_s3(url: str) -> tuple[str, str]:
    bucket, _, prefix = url[len("s3://") :].partition("/")
    if not bucket:
        raise ValueError(f"url {url!r}: expected s3://bucket/prefix")
    return bucket, prefix


def s3_client() -> Any:
    """A boto3 S3 client with retries; honours AWS_ENDPOINT_URL (MinIO, moto, ...)."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=os.environ.get("AWS_ENDPOINT_URL") or None,
        config=Config(
            retries={"max_attempts": 5, "mode": "standard"}, connect_timeout=10, read_timeout=60
        ),
    )


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def _tar_bytes(samples: Sequence[Sample], first_key: int) -> tuple[bytes, list[dict]]:
    """One shard's bytes and its index (byte ranges of each sample's members)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i, s in enumerate(samples):
            key = f"{first_key + i:09d}"
            members = {
                "json": json.dumps({"sample_id": s.sample_id, "modality": s.modality}).encode(),
                "text.npy": _npy(np.asarray(s.text, dtype=np.int64)),
            }
            if s.media is not None:
                members["media.npy"] = _npy(np.asarray(s.media, dtype=np.float32))
            for suffix, data in members.items():
                info = tarfile.TarInfo(f"{key}.{suffix}")
                info.size = len(data)
                info.mode = 0o644
                tar.addfile(info, io.BytesIO(data))
    data = buf.getvalue()
    return data, _scan(data)


def _scan(data: bytes) -> list[dict]:
    """Group a tar's members by sample key: [{key, start, end, members: {suffix: [off, size]}}]."""
    entries: list[dict] = []
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        for m in tar.getmembers():
            if not m.isfile():
                continue
            key, _, suffix = m.name.rpartition("/")[2].partition(".")
            if not entries or entries[-1]["key"] != key:
                entries.append({"key": key, "start": m.offset, "members": {}})
            entries[-1]["members"][suffix] = [m.offset_data, m.size]
            entries[-1]["end"] = m.offset_data + m.size
    return [e for e in entries if "json" in e["members"] and "text.npy" in e["members"]]


def write_shards(samples: Iterable[Sample], out: str, samples_per_shard: int) -> list[str]:
    """Write samples as ``shard-NNNNNN.tar`` (+ index) into a directory or ``s3://bucket/prefix``.

    Returns:
        The shard locations, in order.
    """
    if samples_per_shard < 1:
        raise ValueError(f"samples_per_shard must be >= 1, got {samples_per_shard}")
    client = s3_client() if _is_s3(out) else None
    if client is None:
        os.makedirs(out, exist_ok=True)
    written: list[str] = []
    batch: list[Sample] = []
    count = 0

    def flush() -> None:
        data, index = _tar_bytes(batch, count - len(batch))
        name = f"shard-{len(written):06d}.tar"
        idx = json.dumps(index).encode()
        if client is not None:
            bucket, prefix = _split_s3(out)
            key = f"{prefix.rstrip('/')}/{name}" if prefix else name
            client.put_object(Bucket=bucket, Key=key, Body=data)
            client.put_object(Bucket=bucket, Key=key + INDEX_SUFFIX, Body=idx)
            written.append(f"s3://{bucket}/{key}")
        else:
            path = os.path.join(out, name)
            with open(path, "wb") as f:
                f.write(data)
            with open(path + INDEX_SUFFIX, "wb") as f:
                f.write(idx)
            written.append(path)
        batch.clear()

    for s in samples:
        batch.append(s)
        count += 1
        if len(batch) == samples_per_shard:
            flush()
    if batch:
        flush()
    return written


@dataclass(frozen=True)
class _Entry:
    shard: int
    start: int
    end: int
    members: dict[str, tuple[int, int]]


class ShardSource:
    """Random access over a set of shards: ``get(i)`` reads sample ``i % num_samples``.

    Media is cropped to multiples of the geometry and its ``media_tokens`` recomputed; a media
    sample that cannot fit ``seq_length`` (with at least one text token) is skipped: ``get``
    returns None and logs a warning. Text after media is truncated to fit.
    """

    def __init__(
        self,
        config: ShardSourceConfig,
        *,
        source_index: int,
        geometry: MediaGeometry,
        seq_length: int,
    ) -> None:
        self.config = config
        self.name = config.name
        self.modality: Modality = config.modality
        self.source_index = source_index
        self.geometry = geometry
        self.seq_length = seq_length
        self._client: Any = None
        self._shards = self._list_shards(config.url)
        self._entries: list[_Entry] = []
        self._bounds: list[int] = []
        for i, shard in enumerate(self._shards):
            for e in self._load_index(shard):
                members = {k: (int(v[0]), int(v[1])) for k, v in e["members"].items()}
                self._entries.append(_Entry(i, int(e["start"]), int(e["end"]), members))
            self._bounds.append(len(self._entries))
        if not self._entries:
            raise FileNotFoundError(f"source {self.name!r}: no samples in shards at {config.url!r}")
        self.num_samples: int | None = len(self._entries)

    @property
    def shards(self) -> list[str]:
        """Shard locations, in read order."""
        return list(self._shards)

    def locate(self, index: int) -> tuple[int, int]:
        """(shard, member) of sample ``index`` (modulo the number of samples)."""
        i = index % len(self._entries)
        shard = bisect.bisect_right(self._bounds, i)
        return shard, i - (self._bounds[shard - 1] if shard else 0)

    def get(self, index: int) -> Sample | None:
        """Sample ``index``; None (with a warning) when it cannot be used."""
        entry = self._entries[index % len(self._entries)]
        blob = self._read(self._shards[entry.shard], entry.start, entry.end)

        def member(suffix: str) -> bytes:
            off, size = entry.members[suffix]
            return blob[off - entry.start : off - entry.start + size]

        meta = json.loads(member("json"))
        sid = str(meta["sample_id"])
        text = np.load(io.BytesIO(member("text.npy")), allow_pickle=False).astype(np.int64)
        media = None
        if "media.npy" in entry.members:
            media = np.load(io.BytesIO(member("media.npy")), allow_pickle=False)
        if meta.get("modality") != self.modality:
            return self._skip(sid, f"modality {meta.get('modality')!r} != {self.modality!r}")
        if self.modality == "text":
            return Sample(key=(self.source_index, index), sample_id=sid, modality="text", text=text)
        if media is None:
            return self._skip(sid, "no media member")
        media, why = self._fit_media(media.astype(np.float32, copy=False))
        if media is None:
            return self._skip(sid, why)
        n_media = self.geometry.media_tokens(self.modality, media)
        if n_media < 1 or n_media >= self.seq_length:
            return self._skip(
                sid, f"media takes {n_media} positions, seqLength is {self.seq_length}"
            )
        return Sample(
            key=(self.source_index, index),
            sample_id=sid,
            modality=self.modality,
            text=text[: self.seq_length - n_media],
            media=media,
            media_tokens=n_media,
        )

    def _skip(self, sample_id: str, why: str) -> None:
        log.warning("source %s: skipping %s: %s", self.name, sample_id, why)
        return None

    def _fit_media(self, media: np.ndarray) -> tuple[np.ndarray | None, str]:
        """Crop to geometry multiples; (None, reason) when the shape is wrong."""
        g, p = self.geometry, self.geometry.patch_size
        if self.modality == "image" and media.ndim == 3 and media.shape[0] == g.image_channels:
            return media[:, : media.shape[1] // p * p, : media.shape[2] // p * p], ""
        if self.modality == "video" and media.ndim == 4 and media.shape[1] == g.image_channels:
            return media[:, :, : media.shape[2] // p * p, : media.shape[3] // p * p], ""
        if self.modality == "audio" and media.ndim == 2 and media.shape[1] == g.n_mels:
            return media[: media.shape[0] // g.audio_subsampling * g.audio_subsampling], ""
        return None, f"{self.modality} media of shape {media.shape} does not match {g}"

    # -- storage -------------------------------------------------------------------------------

    def _s3(self) -> Any:
        if self._client is None:
            self._client = s3_client()
        return self._client

    def _list_shards(self, url: str) -> list[str]:
        if _is_s3(url):
            bucket, prefix = _split_s3(url)
            prefix = prefix.rstrip("/") + "/" if prefix else ""  # a folder, not a key prefix
            pages = (
                self._s3().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
            )
            keys = [o["Key"] for page in pages for o in page.get("Contents", [])]
            found = [f"s3://{bucket}/{k}" for k in sorted(keys) if k.endswith(".tar")]
        elif os.path.isdir(url):
            found = sorted(glob.glob(os.path.join(url, "*.tar")))
        else:
            found = sorted(p for p in glob.glob(url) if p.endswith(".tar"))
        if not found:
            raise FileNotFoundError(f"source {self.name!r}: url {url!r} matches no .tar shards")
        return found

    def _read(self, shard: str, start: int | None = None, end: int | None = None) -> bytes:
        if _is_s3(shard):
            bucket, key = _split_s3(shard)
            kwargs = {} if start is None else {"Range": f"bytes={start}-{end - 1}"}
            return self._s3().get_object(Bucket=bucket, Key=key, **kwargs)["Body"].read()
        with open(shard, "rb") as f:
            if start is None:
                return f.read()
            f.seek(start)
            return f.read(end - start)

    def _load_index(self, shard: str) -> list[dict]:
        try:
            return json.loads(self._read(shard + INDEX_SUFFIX))
        except FileNotFoundError:
            pass
        except Exception as e:  # S3 NoSuchKey; anything else is re-raised below by the scan
            if "NoSuchKey" not in repr(e) and "404" not in repr(e):
                raise
        log.info("shard %s has no index; scanning it", shard)
        return _scan(self._read(shard))


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
        write_shards((src.get(j) for j in range(n)), url, samples_per_shard)
        urls[modality] = url
    return urls
