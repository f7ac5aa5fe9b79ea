"""Several media inside one sample (conversations): where collate puts them, which positions are
loss targets, and that the encoder micro-batches list them in collate's order."""

from __future__ import annotations

import numpy as np
import yaml

from omni_trainer.config import parse_manifest
from omni_trainer.data.packing import Packer, collate
from omni_trainer.data.sample import MediaRef, MediaSpan, Sample
from omni_trainer.multiplex.workload import encoder_micro_batches

from ...conftest import EXAMPLES


def _interleaved(i: int) -> Sample:
    text = np.arange(100, 120, dtype=np.int64)
    spans = (
        MediaSpan("image", 2, 4, MediaRef(0, i, (3, 28, 28), item=0)),
        MediaSpan("audio", 8, 3, MediaRef(0, i, (12, 16), item=1)),
        MediaSpan("image", 14, 2, MediaRef(0, i, (3, 14, 28), item=2)),
    )
    for sp in spans:
        text[sp.offset : sp.offset + sp.tokens] = 0
    targets = np.zeros(20, dtype=bool)
    targets[17:20] = True  # the reply
    return Sample((0, i), f"conv/{i}", "image", text, spans=spans, targets=targets)


def _prefix_image(i: int) -> Sample:
    media = MediaRef(1, i, (3, 14, 70))
    return Sample((1, i), f"img/{i}", "image", np.arange(7, 13), media=media, media_tokens=5)


def test_interleaved_media_positions_targets_and_encoder_order():
    queue = [_interleaved(0), _prefix_image(0), _interleaved(1)]
    filler = Sample((2, 0), "long/0", "text", np.arange(1, 61))  # refills; does not fit after

    packer = Packer(seq_length=64, buffer_size=3)
    seq = packer.pack(lambda: queue.pop() if queue else filler)
    assert len(seq.samples) == 3 and filler not in seq.samples
    mb = collate([seq], 64)
    by_sample: dict[str, list] = {}
    for item in mb.media:
        by_sample.setdefault(item.sample_id, []).append(item)
    for seg, sample in zip(seq.segments, seq.samples, strict=True):
        items = by_sample[seg.sample_id]
        if sample.spans:
            assert [(it.modality, it.offset - seg.offset, it.num_tokens) for it in items] == [
                (sp.modality, sp.offset, sp.tokens) for sp in sample.spans
            ]
            # loss at position p predicts token p + 1: exactly the reply's 3 tokens
            targets = np.flatnonzero(mb.loss_mask[0, seg.offset : seg.offset + seg.length])
            assert (targets + 1).tolist() == [17, 18, 19]
            assert seg.media_lengths() == [("image", 4), ("audio", 3), ("image", 2)]
        else:
            assert [(it.offset - seg.offset, it.num_tokens) for it in items] == [(0, 5)]
    doc = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    model = parse_manifest(doc).spec.trainer.model
    mbs, lengths = encoder_micro_batches(model, [[seq]], stages=1)
    for e in mbs:  # the anchor pairs these lengths with collate's arrays, in order
        assert lengths[e.id] == [it.num_tokens for it in mb.media if it.modality == e.modality]
    assert sorted(e.modality for e in mbs) == ["audio", "image"]
