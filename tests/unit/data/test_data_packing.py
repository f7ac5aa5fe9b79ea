"""Packing and collation: exact masks on a hand-built case, invariants over many batches."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest

from omni_trainer.data import (
    DataConfig,
    MediaGeometry,
    MediaRef,
    MultimodalStream,
    PackedSequence,
    Packer,
    Sample,
    Segment,
    collate,
    split_micro_batches,
)


def _text(i: int, ids: list[int]) -> Sample:
    return Sample(key=(1, i), sample_id=f"t/{i}", modality="text", text=np.array(ids))


def test_collate_hand_built_case() -> None:
    image = Sample(
        key=(0, 0),
        sample_id="img/0",
        modality="image",
        text=np.array([3, 70, 71]),
        media=MediaRef(source=0, index=0, shape=(3, 14, 28)),
        media_tokens=2,
    )
    text = _text(0, [80, 81, 82])
    seq = PackedSequence(
        seq_length=10,
        segments=[Segment("img/0", "image", 0, 5, 2), Segment("t/0", "text", 5, 3, 0)],
        samples=[image, text],
    )
    mb = collate([seq], 10)
    np.testing.assert_array_equal(mb.tokens[0], [0, 0, 3, 70, 71, 80, 81, 82, 0, 0])
    np.testing.assert_array_equal(mb.labels[0], [0, 3, 70, 71, 80, 81, 82, 0, 0, 0])
    # the last media position predicts the class token; no loss across segments or on padding
    np.testing.assert_array_equal(mb.loss_mask[0], [0, 1, 1, 1, 0, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(mb.segment_ids[0], [0, 0, 0, 0, 0, 1, 1, 1, -1, -1])
    np.testing.assert_array_equal(mb.position_ids[0], [0, 1, 2, 3, 4, 0, 1, 2, 0, 0])
    assert mb.num_loss_tokens == 5
    assert mb.sample_ids == ["img/0", "t/0"]
    (item,) = mb.media
    assert (item.modality, item.row, item.offset, item.num_tokens) == ("image", 0, 0, 2)
    assert item.ref is image.media  # collation references media, it never loads it
    assert mb.tokens.dtype == np.int64 and mb.loss_mask.dtype == np.float32
    assert mb.segment_ids.dtype == np.int32


def test_best_fit_takes_largest_that_fits() -> None:
    sizes = iter([6, 3, 5, 2, 4, 1, 1, 1, 1, 1])
    stream = (_text(i, list(range(100, 100 + n))) for i, n in enumerate(sizes))
    packer = Packer(seq_length=10, buffer_size=3)
    first = packer.pack(lambda: next(stream))
    # buffer [6,3,5] -> 6; refill [3,5,2] -> room 4: 3; refill [5,2,4] -> room 1: none fits
    assert [s.length for s in first.segments] == [6, 3]
    assert [s.offset for s in first.segments] == [0, 6]
    second = packer.pack(lambda: next(stream))
    assert [s.length for s in second.segments] == [5, 4, 1]


def test_packer_rejects_oversized_sample() -> None:
    packer = Packer(seq_length=4, buffer_size=1)
    with pytest.raises(ValueError, match="t/0 has 5 tokens"):
        packer.pack(lambda: _text(0, [100] * 5))


def test_no_sample_lost_or_duplicated_over_many_batches(
    make_config: Callable[..., DataConfig], geometry: MediaGeometry
) -> None:
    cfg = make_config(
        sources=[
            {
                "kind": "synthetic",
                "name": "img",
                "modality": "image",
                "preset": "openimages",
                "lengthScale": 0.03,
            },
            {
                "kind": "synthetic",
                "name": "vid",
                "modality": "video",
                "length": {"mean": 150, "sigma": 0.5},
            },
            {
                "kind": "synthetic",
                "name": "txt",
                "modality": "text",
                "preset": "longtext",
                "lengthScale": 0.1,
            },
        ]
    )
    stream = MultimodalStream(cfg, seed=0, vocab_size=256, geometry=geometry)
    seen: Counter[tuple[int, int, int]] = Counter()
    by_key: dict[tuple[int, int], list[Sample]] = {}
    for _ in range(25):
        for seq in stream.next_batch():
            end = 0
            assert seq.segments, "a sequence is never empty"
            for seg, s in zip(seq.segments, seq.samples, strict=True):
                assert seg.offset == end  # contiguous, in order
                end = seg.offset + seg.length
                assert seg.length == s.num_tokens  # media never split
                assert seg.media_tokens == geometry.media_tokens(s.modality, s.media)
                if s.chunk >= 0:
                    assert s.modality == "text"
                seen[s.state_key] += 1
                by_key.setdefault(s.key, []).append(s)
            assert end <= cfg.seq_length
    for s in [*stream.packer.buffer, *stream.pending]:
        seen[s.state_key] += 1
        by_key.setdefault(s.key, []).append(s)
    assert max(seen.values()) == 1, "duplicated sample"
    # every drawn index of every source is accounted for
    want = {(src, i) for src, n in enumerate(stream.cursors) for i in range(n)}
    assert set(by_key) == want
    chunked = 0
    for key, parts in by_key.items():
        original = stream.sources[key[0]].get(key[1])
        if len(parts) > 1 or parts[0].chunk >= 0:  # chunks exactly for over-long text
            chunked += 1
            assert original.modality == "text" and original.num_tokens > cfg.seq_length
            parts.sort(key=lambda s: s.chunk)
            assert [p.chunk for p in parts] == list(range(len(parts)))
            np.testing.assert_array_equal(np.concatenate([p.text for p in parts]), original.text)
            assert parts[1].sample_id == f"{original.sample_id}#1"
        else:
            assert original.num_tokens <= cfg.seq_length
    assert chunked > 0
    assert {"image", "video", "text"} <= set(stream.counters["samples_per_modality"])


def test_batches_have_full_sequences_and_split(
    make_config: Callable[..., DataConfig], geometry: MediaGeometry
) -> None:
    cfg = make_config()
    batch = MultimodalStream(cfg, seed=1, vocab_size=256, geometry=geometry).next_batch()
    assert len(batch) == cfg.global_batch_size
    assert all(s.seq_length == cfg.seq_length for s in batch)
    mbs = split_micro_batches(batch, 2)
    assert [x for mb in mbs for x in mb] == batch and mbs[1] == [batch[2], batch[3]]
    with pytest.raises(ValueError, match="divide 8 sequences"):
        split_micro_batches(batch, 3)
    mb = collate(batch[:2], cfg.seq_length)
    assert mb.tokens.shape == (2, cfg.seq_length)
    # a loss position's label is a text token of its own segment
    rows, cols = np.nonzero(mb.loss_mask)
    assert (mb.labels[rows, cols] > 0).all()
    assert (mb.segment_ids[rows, cols] == mb.segment_ids[rows, cols + 1]).all()
    assert (mb.loss_mask[mb.segment_ids < 0] == 0).all()
