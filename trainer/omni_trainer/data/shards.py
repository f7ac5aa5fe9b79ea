"""WebDataset-style tar shards on a local disk or S3, read with random access.

A sample ``<key>`` is the consecutive members ``<key>.json`` ({sample_id, modality}),
``<key>.text.npy`` (int64) and, for media, ``<key>.media.npy`` (float32). Next to each
``shard-NNNNNN.tar`` the writer puts ``shard-NNNNNN.tar.index.json`` (byte ranges of every sample)
so opening a source costs one small read per shard; shards without one are scanned instead.
``get`` reads a sample's json, text and only the header of its media (shape and dtype); the
pixels are read by byte range when the rank that encodes them calls ``load_media``.
"""

from __future__ import annotations

import glob
import io
import json
import logging
import os
import tarfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from omni_trainer.data.config import Modality, ShardSourceConfig
from omni_trainer.data.sample import MEDIA_DTYPE, MediaGeometry, MediaRef, Sample, Skipped
from omni_trainer.storage.s3 import is_s3, s3_client, split_s3

log = logging.getLogger(__name__)

INDEX_SUFFIX = ".index.json"
NPY_HEADER_PEEK = 128
"""Bytes read to learn a media member's shape: an ``.npy`` header (numpy pads it to a multiple
of 64) fits unless the shape is unusually long, which costs a second small read."""
RANGE_GAP = 1024
"""Members of one sample closer than this (two tar header blocks) are read in one request."""


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def _tar_bytes(
    samples: Sequence[Sample], first_key: int, load_media: Callable[[MediaRef], np.ndarray] | None
) -> tuple[bytes, list[dict]]:
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
                if load_media is None:
                    raise ValueError(f"sample {s.sample_id} has media: pass load_media")
                members["media.npy"] = _npy(np.asarray(load_media(s.media), dtype=np.float32))
            for suffix, data in members.items():
                info = tarfile.TarInfo(f"{key}.{suffix}")
                info.size = len(data)
                info.mode = 0o644
                tar.addfile(info, io.BytesIO(data))
    data = buf.getvalue()
    return data, _scan(data)


def _scan(data: bytes) -> list[dict]:
    """Our samples (json + text.npy members) of a tar, see :func:`scan_members`."""
    return [e for e in scan_members(data) if "json" in e["members"] and "text.npy" in e["members"]]


def scan_members(data: bytes) -> list[dict]:
    """Group a tar's members by sample key: [{key, start, end, members: {suffix: [off, size]}}]
    (WebDataset's convention: the key is the file name up to its first dot)."""
    entries: list[dict] = []
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        for m in tar.getmembers():
            if not m.isfile():
                continue
            key, _, suffix = m.name.rpartition("/")[2].partition(".")
            if not entries or entries[-1]["key"] != key:
                entries.append({"key": key, "start": m.offset, "members": {}})
            entries[-1]["members"][suffix.lower()] = [m.offset_data, m.size]
            entries[-1]["end"] = m.offset_data + m.size
    return entries


def write_shards(
    samples: Iterable[Sample],
    out: str,
    samples_per_shard: int,
    *,
    load_media: Callable[[MediaRef], np.ndarray] | None = None,
) -> list[str]:
    """Write samples as ``shard-NNNNNN.tar`` (+ index) into a directory or ``s3://bucket/prefix``.

    Args:
        samples: what to write, in order.
        out: a directory or an s3 url.
        samples_per_shard: samples per tar.
        load_media: reads a sample's media (its source's ``load_media``); needed if any has one.

    Returns:
        The shard locations, in order.
    """
    if samples_per_shard < 1:
        raise ValueError(f"samples_per_shard must be >= 1, got {samples_per_shard}")
    client = s3_client() if is_s3(out) else None
    if client is None:
        os.makedirs(out, exist_ok=True)
    written: list[str] = []
    batch: list[Sample] = []
    count = 0

    def flush() -> None:
        data, index = _tar_bytes(batch, count - len(batch), load_media)
        name = f"shard-{len(written):06d}.tar"
        idx = json.dumps(index).encode()
        if client is not None:
            bucket, prefix = split_s3(out)
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
    members: dict[str, tuple[int, int]]
    """suffix -> (offset, size) in the shard."""


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
        for i, shard in enumerate(self._shards):
            for e in self._load_index(shard):
                members = {k: (int(v[0]), int(v[1])) for k, v in e["members"].items()}
                self._entries.append(_Entry(i, members))
        if not self._entries:
            raise FileNotFoundError(f"source {self.name!r}: no samples in shards at {config.url!r}")
        self.num_samples: int | None = len(self._entries)

    @property
    def shards(self) -> list[str]:
        """Shard locations, in read order."""
        return list(self._shards)

    def get(self, index: int) -> Sample | Skipped:
        """Sample ``index`` with its media as a reference (only the media header is read);
        :class:`Skipped` (with a warning) when it cannot be used."""
        entry = self._entries[index % len(self._entries)]
        wanted = {suffix: entry.members[suffix] for suffix in ("json", "text.npy")}
        if "media.npy" in entry.members:
            off, size = entry.members["media.npy"]
            wanted["media.npy"] = (off, min(size, NPY_HEADER_PEEK))
        parts = self._read_parts(self._shards[entry.shard], wanted)
        meta = json.loads(parts["json"])
        sid = str(meta["sample_id"])
        text = np.load(io.BytesIO(parts["text.npy"]), allow_pickle=False).astype(np.int64)
        if meta.get("modality") != self.modality:
            return self._skip(sid, f"modality {meta.get('modality')!r} != {self.modality!r}")
        if self.modality == "text":
            return Sample(key=(self.source_index, index), sample_id=sid, modality="text", text=text)
        if "media.npy" not in parts:
            return self._skip(sid, "no media member")
        shape, why = self._fit_shape(self._media_header(entry, parts["media.npy"]))
        if shape is None:
            return self._skip(sid, why)
        media = MediaRef(self.source_index, index, shape)
        n_media = self.geometry.media_tokens(self.modality, media)
        if n_media < 1 or n_media >= self.seq_length:
            return self._skip(
                sid, f"media takes {n_media} positions, seqLength is {self.seq_length}", "too_long"
            )
        return Sample(
            key=(self.source_index, index),
            sample_id=sid,
            modality=self.modality,
            text=text[: self.seq_length - n_media],
            media=media,
            media_tokens=n_media,
        )

    def load_media(self, ref: MediaRef) -> np.ndarray:
        """The media ``get(ref.index)`` refers to: one byte-range read of its member, cropped to
        ``ref.shape``, as float32."""
        entry = self._entries[ref.index % len(self._entries)]
        off, size = entry.members["media.npy"]
        data = self._read(self._shards[entry.shard], off, off + size)
        array = np.load(io.BytesIO(data), allow_pickle=False)
        crop = tuple(slice(0, n) for n in ref.shape)
        return np.ascontiguousarray(array[crop], dtype=MEDIA_DTYPE)

    def _media_header(self, entry: _Entry, peek: bytes) -> tuple[tuple[int, ...], np.dtype]:
        """Shape and dtype of a media member from its first bytes (re-read if they fall short)."""
        width = 2 if peek[6] == 1 else 4  # magic (6 bytes), version, then the header length
        length = 8 + width + int.from_bytes(peek[8 : 8 + width], "little")
        if len(peek) < length:
            off, _ = entry.members["media.npy"]
            peek = self._read(self._shards[entry.shard], off, off + length)
        f = io.BytesIO(peek)
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(f)
        else:
            shape, _, dtype = np.lib.format.read_array_header_2_0(f)
        return tuple(int(n) for n in shape), dtype

    def _skip(self, sample_id: str, why: str, reason: str = "malformed") -> Skipped:
        """A skipped sample (the stream logs and counts it once, at its first draw)."""
        return Skipped(sample_id, reason, why)

    def _fit_shape(
        self, header: tuple[tuple[int, ...], np.dtype]
    ) -> tuple[tuple[int, ...] | None, str]:
        """The stored shape cropped to geometry multiples; (None, reason) when it is wrong."""
        shape, dtype = header
        g, p = self.geometry, self.geometry.patch_size
        if dtype.kind not in "fiu":
            return None, f"{self.modality} media of dtype {dtype} is not numeric"
        if self.modality == "image" and len(shape) == 3 and shape[0] == g.image_channels:
            return (shape[0], shape[1] // p * p, shape[2] // p * p), ""
        if self.modality == "video" and len(shape) == 4 and shape[1] == g.image_channels:
            return (*shape[:2], shape[2] // p * p, shape[3] // p * p), ""
        if self.modality == "audio" and len(shape) == 2 and shape[1] == g.n_mels:
            return (shape[0] // g.audio_subsampling * g.audio_subsampling, shape[1]), ""
        return None, f"{self.modality} media of shape {shape} does not match {g}"

    # -- storage -------------------------------------------------------------------------------

    def _s3(self) -> Any:
        if self._client is None:
            self._client = s3_client()
        return self._client

    def _list_shards(self, url: str) -> list[str]:
        if is_s3(url):
            bucket, prefix = split_s3(url)
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
        if is_s3(shard):
            bucket, key = split_s3(shard)
            kwargs = {} if start is None else {"Range": f"bytes={start}-{end - 1}"}
            return self._s3().get_object(Bucket=bucket, Key=key, **kwargs)["Body"].read()
        with open(shard, "rb") as f:
            if start is None:
                return f.read()
            f.seek(start)
            return f.read(end - start)

    def _read_parts(self, shard: str, parts: dict[str, tuple[int, int]]) -> dict[str, bytes]:
        """The byte ranges ``{name: (offset, size)}`` of one shard, neighbours in one request."""
        order = sorted(parts, key=lambda name: parts[name][0])
        out: dict[str, bytes] = {}
        i = 0
        while i < len(order):
            j, start = i, parts[order[i]][0]
            end = start + parts[order[i]][1]
            while j + 1 < len(order) and parts[order[j + 1]][0] - end <= RANGE_GAP:
                j += 1
                end = max(end, sum(parts[order[j]]))
            blob = self._read(shard, start, end)
            for name in order[i : j + 1]:
                off, size = parts[name]
                out[name] = blob[off - start : off - start + size]
            i = j + 1
        return out

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
