"""``kind: webdataset``: standard tars (key.jpg/png/wav + key.txt/json), captions as replies."""

from __future__ import annotations

import io
import json
import os
import tarfile

import numpy as np
import pytest

from omni_trainer.data import DataConfig, MediaGeometry
from omni_trainer.data.loader import MultimodalStream
from omni_trainer.data.packing import collate
from omni_trainer.data.tinyset import make_tiny_dataset
from omni_trainer.data.tokenizer import load_tokenizer

GEOMETRY = MediaGeometry(n_mels=16)


def _write_tars(root: str, records: list[dict], out: str, per_tar: int = 5) -> None:
    """Our LLaVA records as WebDataset tars: image/audio member + caption .txt or Q/A .json."""
    os.makedirs(out, exist_ok=True)
    for t in range(0, len(records), per_tar):
        with tarfile.open(os.path.join(out, f"part-{t // per_tar:04d}.tar"), "w") as tar:
            for r in records[t : t + per_tar]:
                media = r.get("image") or r.get("audio")
                with open(os.path.join(root, media), "rb") as f:
                    members = {media.rsplit(".", 1)[1]: f.read()}
                reply = next(m["value"] for m in r["conversations"] if m["from"] == "gpt")
                if len(r["conversations"]) > 2:  # multi-turn: the json carries the conversation
                    members["json"] = json.dumps({"conversations": r["conversations"]}).encode()
                else:
                    members["txt"] = reply.encode()
                for suffix, data in members.items():
                    info = tarfile.TarInfo(f"shard/{r['id']}.{suffix}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))


@pytest.fixture(scope="module")
def wds(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("wds"))
    paths = make_tiny_dataset(root, images=12, audio=3, corrupt=[4])
    with open(paths["annotations"]) as f:
        records = json.load(f)
    _write_tars(root, records, os.path.join(root, "tars"))
    return root, paths, records


def _stream(url: str, tokenizer: str) -> MultimodalStream:
    cfg = DataConfig.model_validate(
        {
            "seqLength": 256,
            "globalBatchSize": 2,
            "microBatchSize": 1,
            "packBuffer": 4,
            "sources": [
                {
                    "kind": "webdataset",
                    "name": "wds",
                    "url": url,
                    "modality": "image",
                    "prompt": "What is shown?",
                }
            ],
            "media": {"maxPixels": 14 * 14 * 64},
        }
    )
    return MultimodalStream(cfg, seed=0, vocab_size=512, geometry=GEOMETRY, tokenizer=tokenizer)


def test_captions_and_conversations_from_tars(wds):
    root, paths, records = wds
    stream = _stream(os.path.join(root, "tars"), paths["tokenizer"])
    src = stream.sources[0]
    assert src.num_samples == len(records)
    tok = load_tokenizer(paths["tokenizer"])
    for i, r in enumerate(records):
        got = src.get(i)
        if i == 4:
            assert got.reason == "corrupt"
            continue
        replies = [m["value"] for m in r["conversations"] if m["from"] == "gpt"]
        if len(r["conversations"]) == 2:
            replies = replies[:1]
            assert "What is shown?" in tok.decode(got.text.tolist())
        assert tok.decode(got.text[got.targets].tolist()) == "".join(
            x + "<|im_end|>" for x in replies
        )
        (span,) = got.spans
        assert span.modality == ("image" if "image" in r else "audio")
        local = os.path.join(root, r.get("image") or r.get("audio"))
        if span.modality == "image":  # the same pixels as reading the file itself
            want = src.image.resized(local)
            np.testing.assert_array_equal(src.load_media(span.ref), want)
    mb = collate(stream.next_batch(), 256)
    assert mb.media and stream.counters["skipped_samples"] in ({}, {"corrupt": 1})


def test_tars_on_s3(wds, s3_bucket):
    import boto3

    root, paths, _ = wds
    s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
    for name in os.listdir(os.path.join(root, "tars")):
        s3.upload_file(os.path.join(root, "tars", name), s3_bucket, f"wds/{name}")
    local = _stream(os.path.join(root, "tars"), paths["tokenizer"])
    remote = _stream(f"s3://{s3_bucket}/wds", paths["tokenizer"])
    a, b = collate(local.next_batch(), 256), collate(remote.next_batch(), 256)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(
        local.sources[0].load_media(a.media[0].ref), remote.sources[0].load_media(b.media[0].ref)
    )
