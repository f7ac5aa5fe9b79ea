"""``kind: parquet``: HF-datasets-style parquet (image/audio bytes columns, text or conversation
columns) gives the same samples and pixels as the LLaVA JSON it was exported from."""

from __future__ import annotations

import json

import numpy as np
import pytest

from omni_trainer.data import DataConfig, MediaGeometry
from omni_trainer.data.loader import MultimodalStream
from omni_trainer.data.tinyset import make_tiny_dataset

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

GEOMETRY = MediaGeometry(n_mels=16)


def _source(kind: str, url: str, tokenizer: str):
    cfg = DataConfig.model_validate(
        {
            "seqLength": 256,
            "globalBatchSize": 2,
            "microBatchSize": 1,
            "sources": [{"kind": kind, "name": "s", "url": url, "modality": "image"}],
            "media": {"maxPixels": 14 * 14 * 64},
        }
    )
    stream = MultimodalStream(cfg, seed=0, vocab_size=512, geometry=GEOMETRY, tokenizer=tokenizer)
    return stream.sources[0]


def test_parquet_rows_equal_the_llava_records(tmp_path):
    paths = make_tiny_dataset(str(tmp_path), images=10, audio=3, missing=[2])
    with open(paths["annotations"]) as f:
        records = json.load(f)
    rows = []
    for r in records:
        media = r.get("image") or r.get("audio")
        path = tmp_path / media
        data = path.read_bytes() if path.exists() else None
        cell = {"bytes": data, "path": media}
        kind = "image" if "image" in r else "audio"
        rows.append({"id": r["id"], "image": cell if kind == "image" else None,
                     "audio": cell if kind == "audio" else None,
                     "conversations": r["conversations"]})  # fmt: skip
    out = tmp_path / "pq"
    out.mkdir()
    pq.write_table(pa.Table.from_pylist(rows[:7]), out / "a.parquet", row_group_size=3)
    pq.write_table(pa.Table.from_pylist(rows[7:]), out / "b.parquet", row_group_size=3)

    ours = _source("parquet", str(out), paths["tokenizer"])
    ref = _source("conversations", paths["annotations"], paths["tokenizer"])
    assert ours.num_samples == len(records)
    for i in range(len(records)):
        a, b = ours.get(i), ref.get(i)
        if i == 2:
            assert a.reason == b.reason == "missing"
            continue
        assert a.sample_id == b.sample_id
        np.testing.assert_array_equal(a.text, b.text)
        np.testing.assert_array_equal(a.targets, b.targets)
        (sa,), (sb,) = a.spans, b.spans
        assert (sa.offset, sa.tokens, sa.ref.shape) == (sb.offset, sb.tokens, sb.ref.shape)
        np.testing.assert_array_equal(ours.load_media(sa.ref), ref.load_media(sb.ref))
