"""Manifest validation of the data section: every error names its field and what is allowed."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from omni_trainer.data import DataConfig, SyntheticSourceConfig
from omni_trainer.data.config import PRESETS


def base(**overrides: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "seqLength": 128,
        "globalBatchSize": 4,
        "microBatchSize": 2,
        "sources": [
            {"kind": "synthetic", "name": "img", "modality": "image", "preset": "refcocog"},
            {"kind": "synthetic", "name": "txt", "modality": "text", "preset": "longtext"},
        ],
    }
    raw.update(overrides)
    return raw


def error_of(raw: dict[str, Any]) -> tuple[str, str]:
    """(dotted loc, message) of the single validation error."""
    with pytest.raises(ValidationError) as info:
        DataConfig.model_validate(raw)
    errors = info.value.errors()
    assert len(errors) == 1, errors
    return ".".join(str(x) for x in errors[0]["loc"]), errors[0]["msg"]


def test_valid_config_gets_equal_default_mixture() -> None:
    cfg = DataConfig.model_validate(base())
    assert len(cfg.mixture) == 1
    assert cfg.mixture[0].at_tokens == 0
    assert cfg.mixture[0].weights == {"image": 1.0, "text": 1.0}
    assert cfg.pack_buffer == 64
    src = cfg.sources[0]
    assert isinstance(src, SyntheticSourceConfig)
    assert src.length_distribution() == PRESETS["refcocog"][1]


def test_preset_must_match_modality() -> None:
    raw = base()
    raw["sources"][0]["preset"] = "librispeech"
    loc, msg = error_of(raw)
    assert loc == "sources.0.synthetic.preset"
    assert "'audio'" in msg and "openimages" in msg and "refcocog" in msg


def test_preset_or_length_required() -> None:
    raw = base()
    del raw["sources"][1]["preset"]
    loc, msg = error_of(raw)
    assert loc == "sources.1.synthetic.length"
    assert "preset or length" in msg


def test_explicit_length_overrides_preset_and_checks_bounds() -> None:
    raw = base()
    raw["sources"][1]["length"] = {"mean": 50, "sigma": 0, "min": 10, "max": 100}
    src = DataConfig.model_validate(raw).sources[1]
    assert src.length_distribution().mean == 50
    raw["sources"][1]["length"] = {"mean": 50, "min": 10, "max": 5}
    loc, msg = error_of(raw)
    assert loc == "sources.1.synthetic.length.max" and "min (10)" in msg


def test_micro_batch_must_divide_global() -> None:
    loc, msg = error_of(base(globalBatchSize=6, microBatchSize=4))
    assert loc == "microBatchSize"
    assert "globalBatchSize (6)" in msg


@pytest.mark.parametrize(
    ("mixture", "needle"),
    [
        ([{"atTokens": 5, "weights": {"image": 1}}], "mixture[0].atTokens must be 0"),
        (
            [{"atTokens": 0, "weights": {"image": 1}}, {"atTokens": 0, "weights": {"text": 1}}],
            "strictly increasing",
        ),
        ([{"atTokens": 0, "weights": {"audio": 1, "text": 1}}], "mixture[0].weights.audio"),
    ],
)
def test_mixture_errors(mixture: list[dict[str, Any]], needle: str) -> None:
    loc, msg = error_of(base(mixture=mixture))
    assert loc == "mixture"
    assert needle in msg


def test_mixture_point_needs_positive_weight_and_known_modality() -> None:
    loc, msg = error_of(base(mixture=[{"atTokens": 0, "weights": {"image": 0}}]))
    assert loc == "mixture.0.weights" and "at least one weight" in msg
    loc, _ = error_of(base(mixture=[{"atTokens": 0, "weights": {"imag": 1}}]))
    assert loc == "mixture.0.weights.imag.[key]"


def test_unknown_fields_kinds_and_duplicates_are_rejected() -> None:
    raw = base()
    raw["sources"][0]["lenghtScale"] = 0.1
    loc, _ = error_of(raw)
    assert loc == "sources.0.synthetic.lenghtScale"
    raw = base()
    raw["sources"][0]["kind"] = "tfrecord"
    loc, msg = error_of(raw)
    assert loc == "sources.0" and "synthetic" in msg and "shards" in msg and "parquet" in msg
    raw = base()
    raw["sources"][1]["name"] = "img"
    loc, msg = error_of(raw)
    assert loc == "sources" and "['img']" in msg
    loc, _ = error_of(base(sources=[]))
    assert loc == "sources"
    loc, _ = error_of(base(seqLength=4))
    assert loc == "seqLength"


def test_data_package_imports_no_torch_or_boto3() -> None:
    import subprocess
    import sys

    code = (
        "import sys, omni_trainer.data; "
        "bad = [m for m in ('torch', 'boto3') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
