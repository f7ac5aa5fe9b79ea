"""The manifest: examples validate; bad manifests fail with the field path and what is allowed."""

from __future__ import annotations

import copy

import pytest
import yaml

from omni_trainer.config import ManifestError, load_manifest, parse_manifest

from ...conftest import EXAMPLES


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_examples_validate(name: str) -> None:
    """As the operator validates them: imported models live on the pods' storage, unread."""
    job = load_manifest(EXAMPLES / name, defer_hf=True)
    assert job.kind == "OmniTrainingJob"
    assert job.spec.trainer.data.sources


def test_paper_workload_a_has_its_shape() -> None:
    cfg = load_manifest(EXAMPLES / "paper-workload-a.yaml").spec.trainer
    assert (cfg.model.llm.num_layers, cfg.model.llm.hidden_size) == (32, 4096)
    assert cfg.model.encoders.image.hidden_size == 1024
    assert cfg.data.seq_length == 16384 and cfg.data.global_batch_size == 256


def _set(doc: dict, path: str, value) -> dict:
    doc = copy.deepcopy(doc)
    *parents, leaf = path.split(".")
    node = doc
    for key in parents:
        node = node[int(key)] if key.isdigit() else node[key]
    if value is _DELETE:
        del node[leaf]
    else:
        node[int(leaf) if leaf.isdigit() else leaf] = value
    return doc


_DELETE = object()


@pytest.mark.parametrize(
    ("path", "value", "expected"),
    [
        (
            "spec.trainer.data.microBatchSize",
            3,
            "spec.trainer.data.microBatchSize: microBatchSize (3) must divide globalBatchSize (8)",
        ),
        (
            "spec.trainer.data.sources.0.colour",
            "red",
            "spec.trainer.data.sources[0].colour: unknown field (check the spelling",
        ),
        (
            "spec.trainer.data.sources.0.lenghtScale",
            0.5,
            "spec.trainer.data.sources[0].lenghtScale: unknown field; did you mean 'lengthScale'?",
        ),
        (
            "spec.trainer.model.encoders.image.featurSelect",
            "full",
            "spec.trainer.model.encoders.image.featurSelect: unknown field; did you mean "
            "'featureSelect'?",
        ),
        (
            "spec.trainer.model.llm.preset",
            "gpt-5",
            "spec.trainer.model.llm.preset: must be one of 'tiny', 'llama-7b'",
        ),
        (
            "spec.trainer.optimizer.lr",
            -1.0,
            "spec.trainer.optimizer.lr: Input should be greater than 0",
        ),
        (
            "spec.trainer.data.sources.1.preset",
            "librispeech",
            "preset 'librispeech' is for modality 'audio', not 'image'",
        ),
        (
            "spec.trainer.model.encoders.audio",
            _DELETE,
            "data.sources[2] ('librispeech') has modality 'audio' but model.encoders has no",
        ),
        (
            "apiVersion",
            "omni.megascale.io/v2",
            "apiVersion: must be one of 'omni.megascale.io/v1alpha1'",
        ),
        ("metadata.name", "Tiny_CPU", "metadata.name: String should match pattern"),
        (
            "spec.trainer.data.mixture.1.atTokens",
            0,
            "mixture[1].atTokens (0) must be > mixture[0].atTokens (0)",
        ),
        (
            "spec.trainer.model.llm.numAttentionHeads",
            5,
            "hiddenSize (128) must be a multiple of numAttentionHeads (5)",
        ),
    ],
)
def test_bad_manifest_names_field(tiny_manifest: dict, path: str, value, expected: str) -> None:
    with pytest.raises(ManifestError) as info:
        parse_manifest(_set(tiny_manifest, path, value))
    assert expected in str(info.value)


def test_all_errors_reported_at_once(tiny_manifest: dict) -> None:
    doc = _set(tiny_manifest, "spec.trainer.optimizer.lr", 0)
    doc = _set(doc, "spec.trainer.train.steps", 0)
    with pytest.raises(ManifestError) as info:
        parse_manifest(doc)
    lines = str(info.value).splitlines()
    assert any(line.startswith("spec.trainer.optimizer.lr:") for line in lines)
    assert any(line.startswith("spec.trainer.train.steps:") for line in lines)


def test_explicit_llm_needs_every_dim_without_preset(tiny_manifest: dict) -> None:
    doc = _set(tiny_manifest, "spec.trainer.model.llm", {"numLayers": 2, "hiddenSize": 64})
    with pytest.raises(ManifestError, match="'numAttentionHeads' is required when no 'preset'"):
        parse_manifest(doc)


def test_explicit_fields_override_preset(tiny_manifest: dict) -> None:
    doc = _set(tiny_manifest, "spec.trainer.model.llm.numLayers", 3)
    llm = parse_manifest(doc).spec.trainer.model.llm
    assert (llm.num_layers, llm.hidden_size) == (3, 128)


def test_cluster_fields_outside_trainer_pass_through(tiny_manifest: dict) -> None:
    doc = _set(tiny_manifest, "spec.image", "registry.example/omni:1")
    assert parse_manifest(doc).spec.trainer.seed == 1234


def test_file_errors_name_the_file(tmp_path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ManifestError, match=r"nope\.yaml: no such file"):
        load_manifest(missing)
    broken = tmp_path / "broken.yaml"
    broken.write_text("spec: [unclosed\n")
    with pytest.raises(ManifestError, match=r"broken\.yaml: not valid YAML"):
        load_manifest(broken)
    listy = tmp_path / "list.yaml"
    listy.write_text(yaml.safe_dump([1, 2]))
    with pytest.raises(ManifestError, match="must be a YAML mapping"):
        load_manifest(listy)


def test_context_parallel_layouts_are_accepted_where_the_sequence_splits(
    tiny_manifest: dict,
) -> None:
    from omni_trainer.distributed.layout import layout_for

    tiny_manifest["spec"]["trainer"]["parallelism"] = {"context": 2}
    cfg = parse_manifest(tiny_manifest).spec.trainer
    assert layout_for(cfg, 4).as_dict()["cp"] == 2  # dp2 x cp2
    tiny_manifest["spec"]["trainer"]["data"]["seqLength"] = 255
    with pytest.raises(ManifestError, match=r"seqLength \(255\) must be a multiple of .*context"):
        layout_for(parse_manifest(tiny_manifest).spec.trainer, 2)
