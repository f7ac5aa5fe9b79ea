"""`omni validate --sources` (and every pod before torchrun) on real files: the tokenizer against
the model's vocabulary, and the sources' sample lengths against ``seqLength``, said once."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from omni_trainer.cli import app
from omni_trainer.data.tinyset import make_tiny_dataset

from ...conftest import EXAMPLES


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("llava-tiny")
    make_tiny_dataset(str(out), images=18, audio=6)
    return out


def _validate(
    tmp_path: Path, dataset: Path, sources: list[dict] = (), **changes: object
) -> tuple[int, str]:
    """``omni validate --sources`` of examples/llava-tiny.yaml on ``dataset`` with ``changes``
    (dotted paths under spec.trainer) and more ``sources``; (exit code, stderr)."""
    doc = yaml.safe_load((EXAMPLES / "llava-tiny.yaml").read_text())
    trainer = doc["spec"]["trainer"]
    trainer["tokenizer"] = str(dataset / "tokenizer")
    trainer["data"]["sources"][0]["url"] = str(dataset / "train.json")
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(".")
        node = trainer
        for key in parents:
            node = node[key]
        node[leaf] = value
    trainer["data"]["sources"] += sources
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    result = CliRunner().invoke(app, ["validate", str(path), "--sources"])
    return result.exit_code, result.stderr


def test_the_example_passes_without_warnings(tmp_path: Path, dataset: Path) -> None:
    code, err = _validate(tmp_path, dataset)
    assert code == 0 and err == ""


def test_a_tokenizer_larger_than_the_vocabulary_is_refused_once(
    tmp_path: Path, dataset: Path
) -> None:
    code, err = _validate(tmp_path, dataset, **{"model.llm.vocabSize": 300})
    assert code == 2
    assert f"spec.trainer.tokenizer: {dataset}/tokenizer has " in err
    assert err.count("the model's vocabulary holds 300 (model.llm.vocabSize)") == 1
    assert "sources[0]" not in err  # the source needs the tokenizer: one problem, not two


def test_sources_too_long_for_seq_length(tmp_path: Path, dataset: Path) -> None:
    """Every image and audio sample of the tiny set takes 80..151 positions: at 40 none fits
    (an error before anything starts), at 100 the images are skipped (a warning with the share)."""
    code, err = _validate(tmp_path, dataset, **{"data.seqLength": 40})
    assert code == 2
    assert (
        "spec.trainer.data.sources[0] (llava-tiny): all 24 readable samples are longer than "
        "data.seqLength (40) and would be skipped as too_long; raise seqLength"
    ) in err
    code, err = _validate(tmp_path, dataset, **{"data.seqLength": 100})
    assert code == 0
    assert (
        "warning: spec.trainer.data.sources[0] (llava-tiny): 18 of 24 readable samples (75%) "
        "are longer than data.seqLength (100) and are skipped as too_long"
    ) in " ".join(err.split())
    assert "skipping" not in err  # the survey's skips are summed, not logged one by one


def test_every_problem_training_would_meet_in_one_pass(
    tmp_path: Path, dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A source whose files are all missing, one whose placeholders have no media, a tokenizer
    without <image>, and a tower whose weights do not fit its config.json: all named at once."""
    import json

    from omni_trainer.data import tinyset

    from ..interop.hf_models import save_vision

    records = json.loads((dataset / "train.json").read_text())
    (tmp_path / "gone.json").write_text(json.dumps(
        [r | {"image": f"nowhere/{i}.png"} for i, r in enumerate(records[:6])]
    ))  # fmt: skip
    turns = [{"role": "user", "content": "<image> What is it?"},
             {"role": "assistant", "content": "A shape."}]  # fmt: skip
    (tmp_path / "swift.jsonl").write_text("\n".join([json.dumps({"messages": turns})] * 4))
    monkeypatch.setattr(tinyset, "MEDIA_TOKENS", ())
    tinyset.train_tokenizer(["what is it", "a shape"] * 20, str(tmp_path / "tok"))
    vision = tmp_path / "siglip"
    save_vision(vision, "siglip")
    config = json.loads((vision / "config.json").read_text())
    (vision / "config.json").write_text(json.dumps(config | {"intermediate_size": 64}))
    sources = [
        {"kind": "conversations", "name": name, "url": str(tmp_path / file), "modality": "image"}
        for name, file in (("gone", "gone.json"), ("swift", "swift.jsonl"))
    ]
    code, err = _validate(
        tmp_path,
        dataset,
        sources,
        **{"tokenizer": str(tmp_path / "tok"), "model.encoders.image": {"hf": str(vision)}},
    )
    err = " ".join(err.split())
    assert code == 2, err
    assert f"spec.trainer.tokenizer ({tmp_path}/tok): no <image> token" in err
    assert (
        f"spec.trainer.model.encoders.image.hf ({vision}): 6 shapes differ from config.json: "
        in err
    )
    assert "encoder.layers.0.mlp.fc1.weight is [48, 32], the config implies [64, 32]" in err
    assert (
        "spec.trainer.data.sources[1] (gone): none of the 6 samples read is usable, every one "
        "would be skipped: missing 6 (e.g. gone/img-00000: nowhere/0.png does not exist)"
    ) in err
    assert (
        "spec.trainer.data.sources[2] (swift): none of the 4 samples read is usable, every one "
        "would be skipped: placeholder_mismatch 4 (e.g. swift/0: more <image> placeholders than "
        "image items); each <image>/<audio>/<video> in the text needs one item"
    ) in err
