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


def _validate(tmp_path: Path, dataset: Path, **changes: object) -> tuple[int, str]:
    """``omni validate --sources`` of examples/llava-tiny.yaml on ``dataset`` with ``changes``
    (dotted paths under spec.trainer); (exit code, stderr)."""
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
        "spec.trainer.data.sources[0] (llava-tiny): all 24 samples read are longer than "
        "data.seqLength (40) and would be skipped as too_long; raise seqLength"
    ) in err
    code, err = _validate(tmp_path, dataset, **{"data.seqLength": 100})
    assert code == 0
    assert (
        "warning: spec.trainer.data.sources[0] (llava-tiny): 18 of 24 samples read (75%) are "
        "longer than data.seqLength (100) and are skipped as too_long"
    ) in " ".join(err.split())
    assert "skipping" not in err  # the survey's skips are summed, not logged one by one
