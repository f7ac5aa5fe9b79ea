"""The OmniTrainingJob spec: examples validate; invalid jobs name the field to change."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from omni_operator.spec import DEFAULT_IMAGE, OmniTrainingJobSpec, parse_job
from omni_trainer.config import ManifestError

from ...conftest import EXAMPLES


def _vlm() -> dict[str, Any]:
    doc = yaml.safe_load((EXAMPLES / "paper-workload-a.yaml").read_text())
    doc["spec"].update(nodes=8, gpusPerNode=8)  # tp4 x pp2 on 64 GPUs: dp 8
    return doc


def _with(doc: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A copy of ``doc`` with the dotted ``path`` (digits index lists) set to ``value``."""
    doc = copy.deepcopy(doc)
    *parents, leaf = path.split(".")
    node = doc
    for key in parents:
        node = node[int(key)] if key.isdigit() else node.setdefault(key, {})
    node[int(leaf) if leaf.isdigit() else leaf] = value
    return doc


def test_vlm_example_is_a_valid_job_with_defaults() -> None:
    job = parse_job(_vlm())
    spec = job.spec
    assert (spec.world_size, spec.group_size, spec.image) == (64, 8, DEFAULT_IMAGE)
    assert spec.restart_policy.backoff_seconds.max == 600
    assert spec.resources.shm_size == "64Gi"


def test_tiny_example_is_a_valid_cpu_job() -> None:
    doc = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    job = parse_job(_with(doc, "spec.gpusPerNode", 0))
    assert (job.spec.procs_per_node, job.spec.world_size) == (1, 1)


def test_full_spec_round_trips_through_camel_case() -> None:
    doc = _vlm()
    doc["spec"].update(
        resources={"rdma": {"resourceName": "rdma/ib", "count": 2}, "cpu": 96, "memory": "1Ti"},
        topology={"networkDomainLabels": ["topology.kubernetes.io/zone"], "reorderGroupSize": 4},
        scheduling={"kueueQueue": "train", "tolerations": [{"key": "gpu", "operator": "Exists"}]},
        nccl={"ibHca": "mlx5_0,mlx5_1", "env": {"NCCL_DEBUG": "INFO"}},
        restartPolicy={"budget": 3, "nonRetryableExitCodes": [2, 3], "hangTimeoutSeconds": 600},
        suspend=True,
    )
    spec = parse_job(doc).spec
    dumped = spec.model_dump(mode="json", by_alias=True, exclude_unset=True)
    assert OmniTrainingJobSpec.model_validate(dumped) == spec
    assert spec.resources.cpu == 96 and spec.nccl.env == {"NCCL_DEBUG": "INFO"}


INVALID = [
    # (path, value, the error's field path, words the message must contain)
    ("spec.trainer.parallelism.context", 3, "spec.nodes", "(8 x 8 = 64) must be a multiple"),
    ("spec.nodes", 3, "spec.trainer.parallelism.pipeline", "pipeline (2) and nodes (3)"),
    ("spec.trainer.parallelism.tensor", 16, "spec.trainer.parallelism.tensor", "inside one node"),
    ("spec.gpusPerNode", 6, "spec.trainer.parallelism.tensor", "(6 = gpusPerNode)"),
    ("spec.topology.reorderGroupSize", 3, "spec.topology.reorderGroupSize", "divide nodes (8)"),
    ("spec.topology.reorderGroupSize", 8, None, None),  # valid: the whole job, both stages
    ("spec.nodes", 0, "spec.nodes", "greater than or equal to 1"),
    ("spec.resources.memory", "lots", "spec.resources.memory", "not a Kubernetes quantity"),
    ("spec.resources.shmSize", "64GB", "spec.resources.shmSize", "not a Kubernetes quantity"),
    ("spec.resources.gpu", 8, "spec.resources.gpu", "unknown field"),
    ("spec.restartPolicy.budget", -1, "spec.restartPolicy.budget", "greater than or equal to 0"),
    (
        "spec.restartPolicy.backoffSeconds",
        {"base": 30, "max": 10},
        "spec.restartPolicy.backoffSeconds.max",
        "max (10.0) must be >= base (30.0)",
    ),
    (
        "spec.restartPolicy.nonRetryableExitCodes",
        [1, 0],
        "spec.restartPolicy.nonRetryableExitCodes[1]",
        "greater than or equal to 1",
    ),
    ("spec.restartPolicy.hangTimeoutSeconds", 5, "spec.restartPolicy.hangTimeoutSeconds", "60"),
    ("spec.nccl.env", {"RANK": "3"}, "spec.nccl.env.RANK", "set by the operator"),
    ("spec.nccl.env", {"OMNI_RESUME": "no"}, "spec.nccl.env.OMNI_RESUME", "set by the operator"),
    ("spec.nccl.env", {"1BAD": "x"}, "spec.nccl.env.1BAD", "pattern"),
    (
        "spec.scheduling",
        {"kueueQueue": "q", "volcanoGang": True},
        "spec.scheduling.kueueQueue",
        "choose one",
    ),
    (
        "spec.scheduling",
        {"volcanoGang": True, "schedulerName": "default-scheduler"},
        "spec.scheduling.schedulerName",
        "Volcano scheduler",
    ),
    (
        "spec.scheduling",
        {"topologyAware": True},
        "spec.scheduling.topologyAware",
        "set kueueQueue or volcanoGang, or remove topologyAware",
    ),
    (
        "spec.scheduling",
        {"topologyAware": True, "kueueQueue": "q"},
        "spec.topology.networkDomainLabels",
        "derives the topology levels from these labels; list the node labels",
    ),
    (
        "spec.scheduling",
        {"volcanoQueue": "research"},
        "spec.scheduling.volcanoQueue",
        "set volcanoGang true or remove volcanoQueue",
    ),
    (
        "spec.topology.networkDomainLabels",
        ["zone", "zone"],
        "spec.topology.networkDomainLabels",
        "duplicated: ['zone']",
    ),
    (
        "spec.topology.networkDomainLabels",
        ["not a label"],
        "spec.topology.networkDomainLabels[0]",
        "pattern",
    ),
    ("spec.trainer.data.globalBatchSize", 4, "spec.trainer.data.globalBatchSize", "(1 x 8 = 8)"),
    ("spec.trainer.parallelism.pipeline", 3, "spec.nodes", "(4 x 3 x 1 = 12)"),
    ("spec.scheduling.tolerations", [{"operator": "Maybe"}], "spec.scheduling.tolerations[0]", ""),
    ("spec.suspend", "sometimes", "spec.suspend", "boolean"),
    ("metadata.name", "1-vlm", "metadata.name", "must start with a letter"),
    ("metadata.name", "a" * 51, "metadata.name", "at most 50"),
]


@pytest.mark.parametrize(("path", "value", "where", "words"), INVALID)
def test_invalid_jobs_name_the_field(path: str, value: Any, where: str | None, words: str) -> None:
    doc = _with(_vlm(), path, value)
    if where is None:
        parse_job(doc)
        return
    with pytest.raises(ManifestError) as info:
        parse_job(doc)
    lines = str(info.value).splitlines()
    hits = [line for line in lines if line.startswith(f"{where}:") or line.startswith(f"{where}.")]
    assert hits, f"no error at {where}: {lines}"
    assert any(words in line for line in hits), hits


def test_pipeline_must_align_with_nodes() -> None:
    # tp2 pp8: 8 stages on 4 nodes (2 whole stages per node) is fine; on 12 nodes a stage would
    # be 1.5 nodes.
    doc = _with(_vlm(), "spec.trainer.parallelism", {"tensor": 2, "pipeline": 8})
    doc["spec"]["trainer"]["data"]["globalBatchSize"] = 8
    parse_job(_with(doc, "spec.nodes", 4))
    with pytest.raises(ManifestError, match=r"spec.trainer.parallelism.pipeline: pipeline \(8\)"):
        parse_job(_with(doc, "spec.nodes", 12))


def test_reorder_group_must_not_straddle_stages() -> None:
    # 12 nodes, pp 2: 6 nodes per stage; groups of 4 would mix stages, groups of 3 or 12 do not.
    doc = _with(_vlm(), "spec.nodes", 12)
    doc["spec"]["trainer"]["data"]["globalBatchSize"] = 12
    parse_job(_with(doc, "spec.topology.reorderGroupSize", 3))
    parse_job(_with(doc, "spec.topology.reorderGroupSize", 12))
    with pytest.raises(ManifestError, match=r"reorderGroupSize: .*nodes per pipeline stage"):
        parse_job(_with(doc, "spec.topology.reorderGroupSize", 4))


def test_all_problems_are_reported_at_once() -> None:
    doc = _with(_vlm(), "spec.nodes", 3)
    doc = _with(doc, "spec.nccl.env", {"RANK": "1"})
    doc = _with(doc, "spec.resources.memory", "lots")
    with pytest.raises(ManifestError) as info:
        parse_job(doc)
    assert "spec.resources.memory:" in str(info.value)  # pydantic's own checks...
    # ...stop the semantic ones (they need a well-formed spec); fixing it shows both of those.
    with pytest.raises(ManifestError) as info:
        parse_job(_with(doc, "spec.resources", {}))
    message = str(info.value)
    assert "spec.trainer.parallelism.pipeline:" in message and "spec.nccl.env.RANK:" in message
