"""``kind: conversations``: LLaVA, ms-swift / LLaMA-Factory and OpenAI-style conversations over
image, audio and video files (the layouts: ``record_layouts``).

``get`` reads only headers (Pillow's lazy open, libsndfile's info) to know each media item's
encoder positions, renders the conversation through the chat template, and returns a sample whose
media are references inside its text; ``load_media`` decodes and preprocesses one item on the
rank that encodes it. A sample that cannot be used (a missing or unreadable file, a malformed
conversation, too long for a sequence) comes back as :class:`Skipped` with its reason, the same
on every call, so skips are deterministic across restarts.
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from dataclasses import replace
from typing import Any

import numpy as np

from omni_trainer.data.chat import ChatRenderer, ConversationError
from omni_trainer.data.config import (
    ConversationSourceConfig,
    MediaConfig,
    Modality,
    WebDatasetSourceConfig,
)
from omni_trainer.data.media import (
    AudioSettings,
    ImageSettings,
    VideoSettings,
    audio_info,
    decode_frames,
    image_size,
    read_audio,
    resampled_length,
    video_info,
)
from omni_trainer.data.record_layouts import describe, inline_bytes, local_path, media_of
from omni_trainer.data.sample import MediaGeometry, MediaRef, MediaSpan, Sample, Skipped
from omni_trainer.storage.blobs import join, read_bytes
from omni_trainer.storage.s3 import is_s3


def load_records(url: str) -> list[dict[str, Any]]:
    """The annotation file: a JSON array, or JSONL (one object per line)."""
    text = read_bytes(url).decode("utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        try:
            data = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as err:
            raise ValueError(f"{url}: neither a JSON array nor JSONL ({err})") from None
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list) or not data:
        raise ValueError(f"{url}: expected a non-empty list of conversation records")
    return data


def with_text(
    record: dict[str, Any], fields: dict[str, Any], prompt: str, sample_id: str
) -> dict[str, Any] | Skipped:
    """``record`` completed from a sample's text fields: its ``conversations``/``messages``, or
    its ``caption``/``text`` as the assistant's reply to ``prompt`` (WebDataset, parquet)."""
    for field in ("conversations", "messages"):
        if fields.get(field):
            return record | {field: fields[field]}
    caption = fields.get("caption", fields.get("text"))
    if not isinstance(caption, str) or not caption.strip():
        return Skipped(sample_id, "malformed", "no caption or conversation")
    reply = [{"role": "user", "content": prompt}, {"role": "assistant", "content": caption.strip()}]
    return record | {"messages": reply}


class MediaDecodeError(RuntimeError):
    """A media file whose header read but whose content does not decode."""


class ConversationSource:
    """Random access over one annotation file: ``get(i)`` is record ``i % num_samples``."""

    def __init__(
        self,
        config: ConversationSourceConfig | WebDatasetSourceConfig,
        *,
        source_index: int,
        tokenizer: Any,
        media: MediaConfig,
        geometry: MediaGeometry,
        seq_length: int,
        vocab_size: int,
        encoders: tuple[str, ...] = ("image", "audio"),
    ) -> None:
        if len(tokenizer) > vocab_size:
            raise ValueError(
                f"spec.trainer.tokenizer has {len(tokenizer)} tokens but model.llm.vocabSize "
                f"is {vocab_size}; it must be at least the tokenizer's size"
            )
        self.config = config
        self.name = config.name
        self.modality: Modality = config.modality
        self.source_index = source_index
        self.seq_length = seq_length
        self.geometry = geometry
        self.encoders = set(encoders)
        self.num_samples: int | None = self._index()
        self.renderer = ChatRenderer(
            tokenizer, system_prompt=config.system_prompt, image_wrap=geometry.image_wrap
        )
        self.image = geometry.image_settings or ImageSettings(
            min_pixels=media.min_pixels,
            max_pixels=media.max_pixels,
            patch_size=geometry.patch_size,
            merge_size=1,  # our ViT: one patch is one LLM position
        )
        self.audio = AudioSettings(
            feature_size=geometry.n_mels, sampling_rate=media.sample_rate, chunk_length=None
        )
        self.video = VideoSettings(
            fps=media.fps, max_frames=media.max_frames, total_pixels=media.video_total_pixels
        )
        self._frames: OrderedDict[tuple[int, int], list[np.ndarray]] = OrderedDict()
        self._frames_lock = threading.Lock()

    # -- what a subclass changes: where records and media come from ------------------------------

    def _index(self) -> int:
        """Read the annotation file; the number of samples."""
        url = self.config.url
        self.records = load_records(url)
        default_root = url.rpartition("/")[0] if is_s3(url) else None
        self.root = self.config.media_root or default_root or os.path.dirname(url)
        return len(self.records)

    def _record(self, index: int) -> dict[str, Any] | Skipped:
        """Record ``index`` as ``{id, conversations|messages, image, audio, video}``."""
        record = self.records[index % len(self.records)]
        if not isinstance(record, dict):
            return Skipped(f"{self.name}/{index}", "malformed", "record is not an object")
        return record

    def _open(self, index: int, rel: str) -> bytes | str:
        """What the header readers take: a local path (lazy) or the object's bytes (S3)."""
        path = join(self.root, rel)
        if is_s3(path):
            return read_bytes(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(path)
        return path

    def _source(self, index: int, item: str) -> bytes | str:
        """A media item's bytes or path: a ``data:`` URL's bytes, else :meth:`_open`'s."""
        data = inline_bytes(item)
        return data if data is not None else self._open(index, local_path(item))

    def _frame_settings(self, frames: int) -> ImageSettings:
        """Images settings of a video's frames: the per-frame share of the pixel budget."""
        return replace(self.image, max_pixels=self.video.frame_pixels(frames, self.image))

    def _inputs(
        self, modality: Modality, src: bytes | str, index: int, k: int
    ) -> list[tuple[Modality, MediaRef]]:
        """Encoder inputs of media item ``k``, from headers alone: the item itself, or for a
        video one image per sampled frame (the ViT encodes frames as images)."""
        if modality != "video":
            ref = MediaRef(self.source_index, index, self._shape(modality, src), item=k)
            return [(modality, ref)]
        total, fps, height, width = video_info(src)
        frames = len(self.video.frame_indices(total, fps))
        fixed = self.geometry.image_processor
        if fixed is not None:
            h, w = fixed.output_size(height, width)
        else:
            h, w = self._frame_settings(frames).target_size(height, width)
        shape = (self.geometry.image_channels, h, w)
        return [
            ("image", MediaRef(self.source_index, index, shape, item=k, frame=j))
            for j in range(frames)
        ]

    def _video_frame(self, ref: MediaRef, src: bytes | str) -> np.ndarray:
        """Frame ``ref.frame`` of a video item, preprocessed (a video is decoded once for all
        its frames; the last few are kept)."""
        key = (ref.index, ref.item)
        with self._frames_lock:
            frames = self._frames.get(key)
            if frames is None:
                total, fps, _, _ = video_info(src)
                indices = self.video.frame_indices(total, fps)
                settings = self.geometry.image_processor
                if settings is not None:
                    process = settings.processed_image
                else:
                    process = self._frame_settings(len(indices)).resized_image
                frames = [process(f) for f in decode_frames(src, indices)]
                self._frames[key] = frames
                if len(self._frames) > 2:
                    self._frames.popitem(last=False)
        return frames[ref.frame]

    def _shape(self, modality: Modality, src: bytes | str) -> tuple[int, ...]:
        """Encoder input shape of one item, from its header alone."""
        g = self.geometry
        if modality == "image":
            size = image_size(src)
            fixed = g.image_processor
            h, w = fixed.output_size(*size) if fixed else self.image.target_size(*size)
            return (g.image_channels, h, w)
        samples, rate = audio_info(src)
        frames = self.audio.frames(resampled_length(samples, rate, self.audio.sampling_rate))
        if g.audio_max_frames is not None:  # the encoder's longest clip: the rest is cut
            frames = min(frames, g.audio_max_frames)
        return (frames // g.audio_subsampling * g.audio_subsampling, g.n_mels)

    # -- shared ----------------------------------------------------------------------------------

    def get(self, index: int) -> Sample | Skipped:
        """Record ``index`` as a sample with media references (only headers are read)."""
        record = self._record(index)
        if isinstance(record, Skipped):
            return self._skip(record.sample_id, record.reason, record.detail)
        sid = f"{self.name}/{record.get('id', index)}"
        items: list[tuple[Modality, list[tuple[Modality, int, MediaRef]]]] = []
        for k, (modality, item) in enumerate(media_of(record)):
            encoder = "image" if modality == "video" else modality
            if encoder not in self.encoders:
                return self._skip(sid, "unsupported_media", f"no {encoder} encoder")
            rel = describe(item)
            try:
                inputs = self._inputs(modality, self._source(index, item), index, k)
            except FileNotFoundError:
                return self._skip(sid, "missing", f"{rel} does not exist")
            except Exception as err:
                return self._skip(sid, "corrupt", f"{rel}: {err}")
            parts = [(m, self.geometry.media_tokens(m, ref), ref) for m, ref in inputs]
            if not parts or min(n for _, n, _ in parts) < 1:
                return self._skip(sid, "too_short", f"{rel} gives no encoder positions")
            items.append((modality, parts))
        messages = record.get("conversations", record.get("messages"))
        if not isinstance(messages, list):
            return self._skip(sid, "malformed", "no conversations or messages list")
        if isinstance(record.get("system"), str) and record["system"]:  # LLaMA-Factory's
            messages = [{"role": "system", "content": record["system"]}, *messages]
        try:
            out = self.renderer.render(
                messages, [(m, sum(n for _, n, _ in parts)) for m, parts in items]
            )
        except ConversationError as err:
            return self._skip(sid, err.reason, str(err))
        if len(out.tokens) > self.seq_length:
            return self._skip(
                sid, "too_long", f"{len(out.tokens)} positions > seqLength {self.seq_length}"
            )
        by_modality: dict[str, list] = {}
        for m, parts in items:
            by_modality.setdefault(m, []).append(parts)
        spans: list[MediaSpan] = []
        for m, offset, _ in out.spans:  # a video's frames follow each other in its span
            for encoder, n, ref in by_modality[m].pop(0):
                spans.append(MediaSpan(encoder, offset, n, ref))
                offset += n
        return Sample(
            key=(self.source_index, index),
            sample_id=sid,
            modality=self.modality,
            text=out.tokens,
            spans=tuple(spans),
            targets=out.targets,
        )

    def load_media(self, ref: MediaRef) -> np.ndarray:
        """Decode and preprocess one media item to ``ref.shape`` (float32).

        Raises:
            MediaDecodeError: the file no longer reads or decodes to that shape.
        """
        record = self._record(ref.index)
        if isinstance(record, Skipped):
            raise MediaDecodeError(f"{self.name}: {record.sample_id}: {record.detail}")
        modality, item = media_of(record)[ref.item]
        rel = describe(item)
        try:
            src = self._source(ref.index, item)
            if modality == "video":
                array = self._video_frame(ref, src)
            elif modality == "image":
                fixed = self.geometry.image_processor
                array = fixed.processed(src) if fixed else self.image.resized(src)
            else:
                wave = read_audio(src, self.audio.sampling_rate)
                array = self.audio.log_mel(wave).T[: ref.shape[0]]
        except Exception as err:
            raise MediaDecodeError(f"{self.name}: {rel}: {err}") from err
        if array.shape != ref.shape:
            raise MediaDecodeError(f"{self.name}: {rel} decodes to {array.shape}, not {ref.shape}")
        return np.ascontiguousarray(array, dtype=np.float32)

    def _skip(self, sample_id: str, reason: str, detail: str) -> Skipped:
        """A skipped sample (the stream logs and counts it once, at its first draw)."""
        return Skipped(sample_id, reason, detail)
