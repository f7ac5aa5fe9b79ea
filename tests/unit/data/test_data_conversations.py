"""``kind: conversations``: LLaVA JSON / OpenAI JSONL over real files, skips, exact resume, S3."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from omni_trainer.data import DataConfig, MediaGeometry
from omni_trainer.data.loader import MultimodalStream
from omni_trainer.data.packing import collate
from omni_trainer.data.tinyset import make_tiny_dataset
from omni_trainer.data.tokenizer import load_tokenizer

GEOMETRY = MediaGeometry(n_mels=16)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("llava")
    return make_tiny_dataset(str(out), images=18, audio=6, corrupt=[3, 7], missing=[5])


def _config(url: str, seq_length: int = 256, **source) -> DataConfig:
    return DataConfig.model_validate(
        {
            "seqLength": seq_length,
            "globalBatchSize": 4,
            "microBatchSize": 2,
            "packBuffer": 6,
            "sources": [
                {"kind": "conversations", "name": "llava", "url": url, "modality": "image"} | source
            ],
            "media": {"maxPixels": 14 * 14 * 64},
        }
    )


def _stream(cfg: DataConfig, tokenizer: str, shard: int = 0, shards: int = 1, geometry=GEOMETRY):
    return MultimodalStream(
        cfg, seed=0, vocab_size=512, geometry=geometry, tokenizer=tokenizer,
        shard=shard, num_shards=shards,
    )  # fmt: skip


def test_media_sit_at_their_placeholders_and_loss_is_on_replies(dataset):
    stream = _stream(_config(dataset["annotations"]), dataset["tokenizer"])
    tok = load_tokenizer(dataset["tokenizer"])
    with open(dataset["annotations"]) as f:
        records = {r["id"]: r for r in json.load(f)}
    seqs = stream.next_batch()
    mb = collate(seqs, 256)
    assert mb.media, "the batch holds media"
    for item in mb.media:  # media positions are never text targets, and load to their shape
        assert not mb.loss_mask[item.row, item.offset - 1 : item.offset + item.num_tokens].any()
        array = stream.sources[0].load_media(item.ref)
        assert array.shape == item.ref.shape and np.isfinite(array).all()
        assert GEOMETRY.media_tokens(item.modality, item.ref) == item.num_tokens
    for row, seq in enumerate(seqs):
        for seg, sample in zip(seq.segments, seq.samples, strict=True):
            o, n = seg.offset, seg.length
            targets = np.flatnonzero(mb.loss_mask[row, o : o + n]) + o + 1
            got = tok.decode(mb.tokens[row, targets].tolist())
            conv = records[sample.sample_id.split("/", 1)[1]]["conversations"]
            assert got == "".join(m["value"] + "<|im_end|>" for m in conv if m["from"] == "gpt")


def test_bad_files_are_skipped_by_reason_and_resume_is_exact(dataset):
    cfg = _config(dataset["annotations"])
    first = _stream(cfg, dataset["tokenizer"], shard=1, shards=2)
    for _ in range(3):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))
    again = _stream(cfg, dataset["tokenizer"], shard=1, shards=2)
    again.load_state_dict(state)
    for _ in range(4):
        a, b = first.next_batch(), again.next_batch()
        assert [s.sample_id for q in a for s in q.samples] == [
            s.sample_id for q in b for s in q.samples
        ]
        ma, mb = collate(a, 256), collate(b, 256)
        np.testing.assert_array_equal(ma.tokens, mb.tokens)
        np.testing.assert_array_equal(ma.loss_mask, mb.loss_mask)
    # shard 1 reads the odd records: 3, 5 and 7 are bad (corrupt, missing, corrupt)
    skipped = first.counters["skipped_samples"]
    assert skipped == {"corrupt": 2, "missing": 1}  # each bad file once
    assert again.counters["skipped_samples"] == skipped


def test_too_long_and_malformed_samples_are_skipped(tmp_path, dataset):
    rows = [
        {"id": "ok", "messages": [{"role": "user", "content": "hi"},
                                  {"role": "assistant", "content": "Hello world!"}]},
        {"id": "long", "messages": [{"role": "user", "content": "word " * 300},
                                    {"role": "assistant", "content": "x"}]},
        {"id": "bad", "messages": [{"role": "robot", "content": "?"}]},
        {"id": "noreply", "conversations": [{"from": "human", "value": "hi"}]},
        {"id": "video", "video": "clip.mp4", "messages": [{"role": "user", "content": "<video>"},
                                                          {"role": "assistant", "content": "x"}]},
        {"id": "audio", "audio": "a.wav", "messages": [{"role": "user", "content": "<audio>"},
                                                       {"role": "assistant", "content": "x"}]},
    ]  # fmt: skip
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    images_only = MediaGeometry(n_mels=16, encoders=("image",))  # a model without audio
    cfg = _config(str(path), seq_length=64, modality="text")
    src = _stream(cfg, dataset["tokenizer"], geometry=images_only)
    got = [src.sources[0].get(i) for i in range(len(rows))]
    assert got[0].sample_id == "llava/ok" and got[0].targets.any()
    reasons = [g.reason for g in got[1:]]
    assert reasons == ["too_long", "malformed", "malformed", "missing", "unsupported_media"]


def test_annotations_media_and_tokenizer_on_s3(dataset, s3_bucket):
    import boto3

    s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
    root = dataset["media_root"]
    for folder, _, files in os.walk(root):
        for name in files:
            rel = os.path.relpath(os.path.join(folder, name), root)
            s3.upload_file(os.path.join(folder, name), s3_bucket, f"llava/{rel}")
    local = _stream(_config(dataset["annotations"]), dataset["tokenizer"])
    remote = _stream(
        _config(f"s3://{s3_bucket}/llava/train.json"), f"s3://{s3_bucket}/llava/tokenizer"
    )
    a, b = collate(local.next_batch(), 256), collate(remote.next_batch(), 256)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(
        local.sources[0].load_media(a.media[0].ref), remote.sources[0].load_media(b.media[0].ref)
    )


def test_media_settings_default_to_the_models_processor_config(tmp_path, dataset):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(dataset["tokenizer"], model)
    (model / "preprocessor_config.json").write_text(
        json.dumps({"size": {"shortest_edge": 784, "longest_edge": 14 * 14 * 9}, "fps": 1.0})
    )
    cfg = DataConfig.model_validate(
        _config(dataset["annotations"]).model_dump(by_alias=True) | {"media": {"fps": 3.0}}
    )
    src = _stream(cfg, str(model)).sources[0]
    assert (src.image.min_pixels, src.image.max_pixels) == (784, 14 * 14 * 9)  # the model's
    assert src.video.fps == 3.0  # the manifest's wins
    sample = src.get(0)
    assert sample.spans[0].tokens <= 9
    plain = _stream(_config(dataset["annotations"]), dataset["tokenizer"]).sources[0]
    assert plain.image.max_pixels == 14 * 14 * 64


def test_bad_files_count_and_log_once_over_epochs_and_shards(dataset, caplog) -> None:
    """Records 3 and 7 are corrupt, 5 is missing: over four epochs of two loader shards the
    summed counts are 2 and 1, each logged once."""
    import logging

    cfg = _config(dataset["annotations"])
    shards = [_stream(cfg, dataset["tokenizer"], shard=k, shards=2) for k in range(2)]
    with caplog.at_level(logging.WARNING, logger="omni_trainer.data"):
        for stream in shards:
            while stream.cursors[0] * 2 < 4 * stream.sources[0].num_samples:
                stream.next_batch()
    total: dict[str, int] = {}
    for stream in shards:
        for reason, n in stream.counters["skipped_samples"].items():
            total[reason] = total.get(reason, 0) + n
    assert total == {"corrupt": 2, "missing": 1}
    assert caplog.text.count("skipping") == 3
