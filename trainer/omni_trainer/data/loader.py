"""A multimodal loader: sources -> mixture -> chunking -> best-fit packing -> batches.

A run has ``loaderShards`` of them, each reading a disjoint stride of every source; together they
make the global batch whatever ranks host them (``components/dataplane.py``). The state (cursors,
mixture counters, pending chunks, packing buffer as sample keys, counters) is small and
JSON-safe; restoring it continues with the very same batches. Samples carry their media as
references (``MediaRef``); a :class:`MediaReader` loads the ones a rank encodes.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from omni_trainer.data.config import (
    ConversationSourceConfig,
    DataConfig,
    MediaConfig,
    ShardSourceConfig,
    SyntheticSourceConfig,
    WebDatasetSourceConfig,
)
from omni_trainer.data.conversations import ConversationSource
from omni_trainer.data.mixture import DeficitMixer, MixtureSchedule
from omni_trainer.data.packing import (
    PackedSequence,
    Packer,
)
from omni_trainer.data.prefetch import MediaPrefetcher
from omni_trainer.data.sample import (
    MediaGeometry,
    MediaRef,
    Sample,
    Skipped,
    chunk_of,
    split_text,
)
from omni_trainer.data.shards import ShardSource
from omni_trainer.data.synthetic import SyntheticSource

log = logging.getLogger(__name__)

STATE_VERSION = 1


Source = SyntheticSource | ShardSource | ConversationSource


def with_processor_defaults(media: MediaConfig, tokenizer: str) -> MediaConfig:
    """``media`` with the fields the manifest leaves out taken from the model's processor
    config (``preprocessor_config.json`` beside the tokenizer), where there is one."""
    from omni_trainer.data.tokenizer import processor_defaults

    unset = {
        k: v for k, v in processor_defaults(tokenizer).items() if k not in media.model_fields_set
    }
    if not unset:
        return media
    try:
        return MediaConfig.model_validate(media.model_dump() | unset)
    except ValueError as err:
        raise ValueError(f"{tokenizer}/preprocessor_config.json: unusable values: {err}") from None


def build_source(
    config: SyntheticSourceConfig
    | ShardSourceConfig
    | ConversationSourceConfig
    | WebDatasetSourceConfig,
    *,
    source_index: int,
    seed: int,
    vocab_size: int,
    geometry: MediaGeometry,
    seq_length: int,
    tokenizer: str | None = None,
    media: MediaConfig | None = None,
) -> Source:
    """The reader for one configured source (``tokenizer``: conversation sources' path)."""
    if isinstance(config, ConversationSourceConfig | WebDatasetSourceConfig):
        from omni_trainer.data.parquet import ParquetSource
        from omni_trainer.data.tokenizer import load_tokenizer
        from omni_trainer.data.webdataset import WebDatasetSource

        if tokenizer is None:
            raise ValueError(f"source {config.name!r}: conversations need spec.trainer.tokenizer")
        media = with_processor_defaults(media or MediaConfig(), tokenizer)
        kinds = {"conversations": ConversationSource, "webdataset": WebDatasetSource,
                 "parquet": ParquetSource}  # fmt: skip
        return kinds[config.kind](
            config,
            source_index=source_index,
            tokenizer=load_tokenizer(tokenizer),
            media=media,
            geometry=geometry,
            seq_length=seq_length,
            vocab_size=vocab_size,
            encoders=geometry.encoders,
        )
    if isinstance(config, SyntheticSourceConfig):
        return SyntheticSource(
            config,
            source_index=source_index,
            seed=seed,
            vocab_size=vocab_size,
            geometry=geometry,
            seq_length=seq_length,
        )
    return ShardSource(config, source_index=source_index, geometry=geometry, seq_length=seq_length)


class MediaReader:
    """Loads media references through this rank's sources (decentralized reads: whichever rank
    drew a sample, the one that encodes its media reads it) and counts what it loaded."""

    def __init__(self, sources: Sequence[Source], *, workers: int = 0) -> None:
        self.sources = sources
        self.bytes_read = 0
        """Bytes of the media arrays this reader loaded (float32, as encoded)."""
        self.items_read = 0
        self.undecodable = 0
        """Items whose header read but whose content did not decode (encoded as zeros)."""
        self.prefetcher = MediaPrefetcher(self._decode, workers=workers) if workers else None
        """Decodes submitted references in worker threads (None: on the calling thread)."""

    def prefetch(self, refs: Iterable[MediaRef]) -> None:
        """Start decoding ``refs`` in the workers (no-op without workers)."""
        if self.prefetcher is not None:
            self.prefetcher.submit(refs)

    def load(self, ref: MediaRef) -> np.ndarray:
        """The array ``ref`` refers to (prefetched if it was submitted)."""
        done = self.prefetcher.take(ref) if self.prefetcher is not None else None
        array, failed = done if done is not None else self._decode(ref)
        self.undecodable += failed
        self.bytes_read += array.nbytes
        self.items_read += 1
        return array

    def _decode(self, ref: MediaRef) -> tuple[np.ndarray, bool]:
        """(array, failed). A file that passed its header check when drawn but does not decode
        now is replaced by zeros of its shape (logged, counted): every rank already planned the
        step around it, so training goes on instead of stopping the job."""
        try:
            return self.sources[ref.source].load_media(ref), False
        except Exception as err:
            log.error("media %s of source %d undecodable, zeros used: %s", ref, ref.source, err)
            return np.zeros(ref.shape, dtype=np.float32), True

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()

    @property
    def counters(self) -> dict[str, int]:
        return {
            "media_bytes_read": self.bytes_read,
            "media_items_read": self.items_read,
            "media_undecodable": self.undecodable,
            "media_prefetched": self.prefetcher.hits if self.prefetcher is not None else 0,
        }


def hosted_shards(num_shards: int, dp_rank: int, dp_size: int) -> list[int]:
    """Loader shards of one data-parallel rank: every ``dp_size``-th, starting at its rank."""
    if num_shards % dp_size:
        raise ValueError(
            f"data.loaderShards ({num_shards}) must be a multiple of the data-parallel size "
            f"({dp_size})"
        )
    return list(range(dp_rank, num_shards, dp_size))


class MultimodalStream:
    """One decentralized loader: a deterministic stream of packed sequences.

    Loader ``shard`` of ``num_shards`` reads samples ``shard, shard + K, shard + 2K, ...`` of
    every source (K = ``num_shards``), follows the mixture by its own tokens times K, and packs
    ``globalBatchSize / K`` sequences per step. The K loaders together make the global batch,
    whichever ranks host them.
    """

    def __init__(
        self,
        config: DataConfig,
        *,
        seed: int,
        vocab_size: int,
        geometry: MediaGeometry,
        shard: int = 0,
        num_shards: int = 1,
        tokenizer: str | None = None,
    ) -> None:
        if not 0 <= shard < num_shards or config.global_batch_size % num_shards:
            raise ValueError(
                f"loader shard {shard} of {num_shards} for a global batch of "
                f"{config.global_batch_size}"
            )
        self.config = config
        self.seed = seed
        self.shard = shard
        self.num_shards = num_shards
        self.batch_size = config.global_batch_size // num_shards
        self.seq_length = config.seq_length
        self.sources = [
            build_source(
                c,
                source_index=i,
                seed=seed,
                vocab_size=vocab_size,
                geometry=geometry,
                seq_length=config.seq_length,
                tokenizer=tokenizer,
                media=config.media,
            )
            for i, c in enumerate(config.sources)
        ]
        self.mixer = DeficitMixer(
            MixtureSchedule(config.mixture, token_scale=num_shards),
            [(c.modality, c.weight) for c in config.sources],
        )
        self.packer = Packer(config.seq_length, config.pack_buffer)
        self.cursors = [0] * len(self.sources)
        self.pending: deque[Sample] = deque()
        self._skip_run = [0] * len(self.sources)
        self.steps = 0
        self.tokens_per_modality: dict[str, int] = {}
        self.samples_per_modality: dict[str, int] = {}
        self.skipped: dict[str, int] = {}
        """Skipped samples per source name (each sample once, :meth:`_count_skip`)."""
        self.skipped_reasons: dict[str, int] = {}
        """Skipped samples per reason (``missing``, ``corrupt``, ``too_long``...)."""
        self.padding_tokens = 0

    # -- drawing --------------------------------------------------------------------------------

    def _draw(self) -> Sample:
        """Next sample for the packing buffer: pending chunks first, then the mixture's choice."""
        if self.pending:
            return self.pending.popleft()
        while True:
            i = self.mixer.choose()
            src = self.sources[i]
            index = self.cursors[i] * self.num_shards + self.shard
            self.cursors[i] += 1
            sample = src.get(index)
            if isinstance(sample, Skipped):
                if src.num_samples is None or index < src.num_samples:
                    self._count_skip(src.name, sample)
                self._skip_run[i] += 1
                if src.num_samples is not None and self._skip_run[i] >= src.num_samples:
                    raise RuntimeError(
                        f"source {src.name!r}: every sample was skipped (the last as "
                        f"{sample.reason}: {sample.detail}); omni validate --sources shows "
                        "the share skipped by reason"
                    )
                continue
            self._skip_run[i] = 0
            self.mixer.record(i, sample.num_tokens)
            if sample.modality == "text" and sample.num_tokens > self.seq_length:
                chunks = split_text(sample, self.seq_length)
                self.pending.extend(chunks[1:])
                return chunks[0]
            return sample

    def _count_skip(self, source: str, sample: Skipped) -> None:
        """Count and log a skipped sample at its first draw: the loader shards' first passes
        over an indexed source cover each sample once, so two bad files count 2 whatever the
        epochs and shards (a stream without an index counts each draw)."""
        self.skipped[source] = self.skipped.get(source, 0) + 1
        why = sample.reason
        self.skipped_reasons[why] = self.skipped_reasons.get(why, 0) + 1
        log.warning("source %s: skipping %s (%s): %s", source, sample.sample_id, why, sample.detail)

    def next_batch(self) -> list[PackedSequence]:
        """This loader's next ``globalBatchSize / num_shards`` packed sequences."""
        batch = [self.packer.pack(self._draw) for _ in range(self.batch_size)]
        for seq in batch:
            self.padding_tokens += seq.seq_length - seq.used
            for seg, s in zip(seq.segments, seq.samples, strict=True):
                m = seg.modality
                self.tokens_per_modality[m] = self.tokens_per_modality.get(m, 0) + seg.length
                if s.chunk <= 0:
                    self.samples_per_modality[m] = self.samples_per_modality.get(m, 0) + 1
        self.steps += 1
        return batch

    @property
    def counters(self) -> dict[str, Any]:
        """Emitted tokens/samples per modality, skipped samples per source, padding, steps."""
        return {
            "steps": self.steps,
            "tokens_per_modality": dict(self.tokens_per_modality),
            "samples_per_modality": dict(self.samples_per_modality),
            "skipped": dict(self.skipped),
            "skipped_samples": dict(self.skipped_reasons),
            "padding_tokens": self.padding_tokens,
            "drawn_tokens_per_modality": dict(self.mixer.tokens),
        }

    # -- checkpointing --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe state; samples are stored as (source, index, chunk) keys, never as data."""
        return {
            "version": STATE_VERSION,
            "seed": self.seed,
            "shard": [self.shard, self.num_shards],
            "sources": [s.name for s in self.sources],
            "cursors": list(self.cursors),
            "skip_run": list(self._skip_run),
            "mixer": self.mixer.state_dict(),
            "pending": [list(s.state_key) for s in self.pending],
            "buffer": [list(s.state_key) for s in self.packer.buffer],
            "counters": self.counters,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where the stream that saved ``state`` was."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"loader state version {state.get('version')} != {STATE_VERSION}")
        names = [s.name for s in self.sources]
        if state["sources"] != names:
            raise ValueError(f"loader state is for sources {state['sources']}, config has {names}")
        if state["seed"] != self.seed:
            raise ValueError(f"loader state is for seed {state['seed']}, not {self.seed}")
        if list(state["shard"]) != [self.shard, self.num_shards]:
            raise ValueError(
                f"loader state is for shard {state['shard'][0]} of {state['shard'][1]}, "
                f"not {self.shard} of {self.num_shards}"
            )
        self.cursors = [int(c) for c in state["cursors"]]
        self._skip_run = [int(c) for c in state["skip_run"]]
        self.mixer.load_state_dict(state["mixer"])
        self.pending = deque(self._regenerate(k) for k in state["pending"])
        self.packer.buffer = [self._regenerate(k) for k in state["buffer"]]
        c = state["counters"]
        self.steps = int(c["steps"])
        self.tokens_per_modality = dict(c["tokens_per_modality"])
        self.samples_per_modality = dict(c["samples_per_modality"])
        self.skipped = dict(c["skipped"])
        self.skipped_reasons = dict(c.get("skipped_samples", {}))  # absent before reasons
        self.padding_tokens = int(c["padding_tokens"])

    def _regenerate(self, key: list[int]) -> Sample:
        source, index, chunk = (int(x) for x in key)
        sample = self.sources[source].get(index)
        if isinstance(sample, Skipped):
            raise ValueError(f"loader state names sample {key}, which its source now skips")
        return chunk_of(sample, chunk, self.seq_length)


DataLoader = MultimodalStream
