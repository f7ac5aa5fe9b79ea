"""The dataset layouts of examples/data-formats.yaml, each file written as its project writes it
(LLaVA JSON, ms-swift JSONL, LLaMA-Factory ShareGPT, OpenAI content parts, WebDataset's
TarWriter, Hugging Face datasets' ``to_parquet``): ``omni data preview --json`` reads every
sample, with its media, and puts the loss on the assistant turns only."""

from __future__ import annotations

import base64
import io
import json
import tarfile
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from omni_trainer.cli import app
from omni_trainer.data.tinyset import make_tiny_dataset

from ...conftest import EXAMPLES

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

ROLE = {"human": "user", "gpt": "assistant"}
END = "<|im_end|>"  # the tokenizer's ChatML end of turn, part of each reply's loss


def medium(record: dict) -> tuple[str, str]:
    """(modality, path) of a tiny-dataset record (one image or one clip each)."""
    return ("image", record["image"]) if "image" in record else ("audio", record["audio"])


def replies(conv: list[dict]) -> str:
    return "".join(m["value"] + END for m in conv if m["from"] == "gpt")


def bare(text: str) -> str:
    """A turn's text without its placeholder (content parts carry the media instead)."""
    return text.replace("<image>", "").replace("<audio>", "").strip()


def write_swift(records: list[dict], path: Path) -> list[str]:
    """ms-swift's JSONL: ``messages`` with ``<image>`` in the text, ``images``/``audios``."""
    lines = []
    for r in records:
        modality, media = medium(r)
        messages = [{"role": ROLE[m["from"]], "content": m["value"]} for m in r["conversations"]]
        lines.append(json.dumps({"messages": messages, f"{modality}s": [media]}))
    path.write_text("\n".join(lines) + "\n")
    return [replies(r["conversations"]) for r in records]


def write_sharegpt(records: list[dict], path: Path) -> list[str]:
    """LLaMA-Factory's ShareGPT: ``conversations`` of ``from``/``value``, ``system``, lists."""
    rows = [
        {"conversations": r["conversations"], "system": "Answer briefly.",
         f"{medium(r)[0]}s": [medium(r)[1]]}
        for r in records
    ]  # fmt: skip
    path.write_text(json.dumps(rows, indent=2, ensure_ascii=False))
    return [replies(r["conversations"]) for r in records]


def write_openai(records: list[dict], root: Path, path: Path) -> list[str]:
    """OpenAI chat content parts: images by relative path, ``file://`` URL or ``data:`` URL,
    audio as ``input_audio`` base64."""
    lines = []
    for i, r in enumerate(records):
        modality, media = medium(r)
        data = base64.b64encode((root / media).read_bytes()).decode()
        if modality == "audio":
            part = {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}
        else:
            url = [media, f"file://{root / media}", f"data:image/png;base64,{data}"][i % 3]
            part = {"type": "image_url", "image_url": {"url": url}}
        messages = []
        for k, m in enumerate(r["conversations"]):
            content = [part, {"type": "text", "text": bare(m["value"])}] if k == 0 else m["value"]
            messages.append({"role": ROLE[m["from"]], "content": content})
        lines.append(json.dumps({"messages": messages}))
    path.write_text("\n".join(lines) + "\n")
    return [replies(r["conversations"]) for r in records]


def write_webdataset(records: list[dict], root: Path, out: Path) -> list[str]:
    """As ``webdataset.TarWriter`` writes: ``key.ext`` members (mode 0444, user bigdata); a
    ``.txt`` caption for single-turn samples, a ``.json`` conversation for the others."""
    out.mkdir()
    expected = []
    with tarfile.open(out / "shard-000000.tar", "w") as tar:
        for i, r in enumerate(records):
            modality, media = medium(r)
            conv = r["conversations"]
            members = {media.rsplit(".", 1)[1]: (root / media).read_bytes()}
            if len(conv) == 2 and modality == "image":
                members["txt"] = conv[1]["value"].encode()
            else:
                members["json"] = json.dumps({"conversations": conv}).encode()
            expected.append(replies(conv))
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{i:09d}.{ext}")
                info.size, info.mode, info.uname, info.gname = (
                    len(data),
                    0o444,
                    "bigdata",
                    "bigdata",
                )
                tar.addfile(info, io.BytesIO(data))
    return expected


def write_parquet(records: list[dict], root: Path, out: Path) -> list[str]:
    """As Hugging Face datasets' ``to_parquet`` writes ``Sequence(Image())`` and ``Audio()``
    columns ({bytes, path} structs) beside ``messages``, with its features in the metadata."""
    out.mkdir()
    cell = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema(
        [
            ("messages", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
            ("images", pa.list_(cell)),
            ("audio", cell),
        ],
        metadata={"huggingface": json.dumps({"info": {"features": {
            "messages": [{"content": {"dtype": "string", "_type": "Value"},
                          "role": {"dtype": "string", "_type": "Value"}}],
            "images": {"feature": {"_type": "Image"}, "_type": "Sequence"},
            "audio": {"_type": "Audio"},
        }}})},
    )  # fmt: skip
    rows = []
    for r in records:
        modality, media = medium(r)
        item = {"bytes": (root / media).read_bytes(), "path": Path(media).name}
        rows.append({
            "messages": [{"content": m["value"], "role": ROLE[m["from"]]}
                         for m in r["conversations"]],
            "images": [item] if modality == "image" else [],
            "audio": item if modality == "audio" else None,
        })  # fmt: skip
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), out / "train-00000-of-00001.parquet")
    return [replies(r["conversations"]) for r in records]


def test_every_layout_reads_with_the_loss_on_the_replies(tmp_path) -> None:
    root = tmp_path / "data"
    paths = make_tiny_dataset(str(root), images=6, audio=2)
    records = json.loads(Path(paths["annotations"]).read_text())
    expected = {
        "llava": [replies(r["conversations"]) for r in records],
        "swift": write_swift(records, root / "swift.jsonl"),
        "sharegpt": write_sharegpt(records, root / "sharegpt.json"),
        "openai": write_openai(records, root, root / "openai.jsonl"),
        "wds": write_webdataset(records, root, root / "wds"),
        "hf-parquet": write_parquet(records, root, root / "parquet"),
    }
    urls = {"llava": paths["annotations"], "swift": root / "swift.jsonl",
            "sharegpt": root / "sharegpt.json", "openai": root / "openai.jsonl",
            "wds": root / "wds", "hf-parquet": root / "parquet"}  # fmt: skip
    doc = yaml.safe_load((EXAMPLES / "data-formats.yaml").read_text())
    doc["spec"]["trainer"]["tokenizer"] = paths["tokenizer"]
    for source in doc["spec"]["trainer"]["data"]["sources"]:
        source["url"] = str(urls[source["name"]])
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))

    out = CliRunner().invoke(app, ["data", "preview", str(job), "--samples", "8", "--json"])
    assert out.exit_code == 0, out.output
    got: dict[str, list[dict]] = {}
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            got.setdefault(rec["source"], []).append(rec)
    assert set(got) == set(expected)
    for name, want in expected.items():
        for rec, loss, record in zip(got[name], want, records, strict=True):
            where = f"{name} {rec['id']}"
            assert rec["skipped"] is None, f"{where}: {rec['skipped']} {rec['detail']}"
            assert rec["loss_text"] == loss, where
            assert [m["modality"] for m in rec["media"]] == [medium(record)[0]], where
