"""``omni data make-tiny | preview | stats`` on the llava-tiny example."""

from __future__ import annotations

import json

import yaml
from typer.testing import CliRunner

from omni_trainer.cli import app

from ...conftest import EXAMPLES


def test_make_preview_and_stats(tmp_path):
    runner = CliRunner()
    data = tmp_path / "data"
    made = runner.invoke(
        app, ["data", "make-tiny", str(data), "--images", "9", "--audio", "3", "--missing", "1"]
    )
    assert made.exit_code == 0, made.output
    doc = yaml.safe_load((EXAMPLES / "llava-tiny.yaml").read_text())
    doc["spec"]["trainer"]["tokenizer"] = str(data / "tokenizer")
    doc["spec"]["trainer"]["data"]["sources"][0]["url"] = str(data / "train.json")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))

    out = runner.invoke(app, ["data", "preview", str(job), "--samples", "3", "--json"])
    assert out.exit_code == 0, out.output
    lines = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    assert [x["id"] for x in lines] == [f"llava-tiny/img-{i:05d}" for i in range(3)]
    ok, missing = lines[0], lines[1]
    assert {"id", "text", "loss_text", "num_tokens", "media", "skipped"} <= set(ok)
    assert ok["skipped"] is None and missing["skipped"] == "missing"
    (media,) = ok["media"]
    assert media["modality"] == "image" and f"<image x {media['tokens']}>" in ok["text"]
    assert ok["loss_text"].endswith("<|im_end|>") and f"[[{ok['loss_text']}]]" in ok["text"]
    assert ok["num_tokens"] > media["tokens"]

    human = runner.invoke(app, ["data", "preview", str(job), "--samples", "2"])
    assert human.exit_code == 0 and "skipped (missing)" in human.stdout

    stats = runner.invoke(app, ["data", "stats", str(job), "--json"])
    assert stats.exit_code == 0, stats.output
    report = json.loads(stats.stdout[stats.stdout.index("{") :])["llava-tiny"]
    assert report["samples"] == 11 and report["skipped"] == {"missing": 1}
    assert set(report["media_tokens"]) == {"image", "audio"}
    assert sum(c for _, _, c in report["sample_tokens"]["histogram"]) == 11
