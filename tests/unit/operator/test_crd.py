"""The CRD: generated from the models, up to date, structural, accepted by Kubernetes' schema."""

from __future__ import annotations

from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from omni_operator import crd

from ...conftest import EXAMPLES, REPO

CRD_FILE = REPO / "crds" / crd.FILE_NAME
K8S_VERSIONS = ["1.31.0", kubernetes_validate.latest_version()]


@pytest.fixture(scope="module")
def generated() -> dict[str, Any]:
    return crd.crd()


@pytest.fixture(scope="module")
def openapi(generated: dict[str, Any]) -> dict[str, Any]:
    return generated["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


@pytest.fixture(scope="module")
def validator(openapi: dict[str, Any]) -> jsonschema.Validator:
    schema = crd.to_jsonschema(openapi)
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_committed_crd_is_up_to_date() -> None:
    assert CRD_FILE.read_text() == crd.render_yaml(), "crds/ is stale: run `make crds`"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_crd_passes_kubernetes_validate_strict(version: str) -> None:
    kubernetes_validate.validate(yaml.safe_load(CRD_FILE.read_text()), version, strict=True)


def test_schema_is_structural(openapi: dict[str, Any]) -> None:
    assert crd.structural_violations(openapi) == []


def test_structural_check_catches_violations() -> None:
    bad = {
        "type": "object",
        "properties": {
            "a": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
            "b": {"type": "object", "additionalProperties": False},
            "c": {"$ref": "#/$defs/C"},
        },
    }
    found = crd.structural_violations(bad)
    assert any(".a: anyOf" in v for v in found) and any(".a: no type" in v for v in found)
    assert any(".b: additionalProperties: false" in v for v in found)
    assert any(".c: $ref" in v for v in found)


def test_unknown_fields_are_kept_only_where_needed(openapi: dict[str, Any]) -> None:
    def walk(node: dict[str, Any], path: str):
        if node.get("x-kubernetes-preserve-unknown-fields"):
            yield path
        for name, sub in node.get("properties", {}).items():
            yield from walk(sub, f"{path}.{name}")
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                yield from walk(node[key], f"{path}.{key}")

    assert list(walk(openapi, "")) == [".status.kopf"]  # kopf's own bookkeeping


def test_names_columns_and_subresources(generated: dict[str, Any]) -> None:
    spec = generated["spec"]
    assert generated["metadata"]["name"] == "omnitrainingjobs.omni.megascale.io"
    assert spec["names"]["shortNames"] == ["otj"]
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Phase", "Step", "Tokens/s", "MFU", "Restarts", "Nodes", "Age"]
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    for col in version["additionalPrinterColumns"]:
        head, field = col["jsonPath"].split(".")[1:3]
        if head == "status":
            assert field in status, col


def test_conversions(openapi: dict[str, Any]) -> None:
    spec = openapi["properties"]["spec"]["properties"]
    resources = spec["resources"]["properties"]
    assert resources["cpu"] == {
        "description": "CPU request per pod (e.g. 96)",
        "x-kubernetes-int-or-string": True,
        "nullable": True,
    }
    assert resources["rdma"]["nullable"] is True and resources["rdma"]["type"] == "object"
    sources = spec["trainer"]["properties"]["data"]["properties"]["sources"]["items"]
    assert sources["properties"]["kind"]["enum"] == [
        "synthetic",
        "shards",
        "conversations",
        "webdataset",
        "parquet",
    ]  # merged union
    assert sources["required"] == ["kind", "modality", "name"]  # common to both kinds
    env = spec["nccl"]["properties"]["env"]
    assert env["additionalProperties"] == {"type": "string"}
    assert "default: 64Gi" in resources["shmSize"]["description"]
    image = spec["trainer"]["properties"]["model"]["properties"]["encoders"]["properties"]["image"]
    assert "required" not in image  # a preset fills the shape: pydantic checks


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_examples_match_the_crd_schema(name: str, validator: jsonschema.Validator) -> None:
    validator.validate(yaml.safe_load((EXAMPLES / name).read_text()))


@pytest.mark.parametrize(
    ("path", "value", "complaint"),
    [
        ("nodes", "eight", "is not of type 'integer'"),
        ("nodes", 0, "less than the minimum"),
        ("suspend", "yes", "is not of type 'boolean'"),
        ("colour", "red", "Additional properties"),
        ("resources", {"memory": 1.5}, "is not of type 'integer', 'string', 'null'"),
        ("restartPolicy", {"nonRetryableExitCodes": [300]}, "greater than the maximum"),
    ],
)
def test_schema_rejects_what_the_api_server_would(
    path: str, value: Any, complaint: str, validator: jsonschema.Validator
) -> None:
    doc = yaml.safe_load((EXAMPLES / "vlm-7b.yaml").read_text())
    doc["spec"][path] = value
    errors = [e.message for e in validator.iter_errors(doc)]
    assert any(complaint in e for e in errors), errors


def test_a_full_spec_matches_the_schema(validator: jsonschema.Validator) -> None:
    doc = yaml.safe_load((EXAMPLES / "vlm-7b.yaml").read_text())
    doc["spec"].update(
        image="registry.local/trainer:1",
        nodes=8,
        gpusPerNode=8,
        resources={"rdma": {"resourceName": "rdma/ib", "count": 1}, "cpu": 96, "memory": "1Ti"},
        topology={"networkDomainLabels": ["topology.kubernetes.io/zone"], "reorderGroupSize": 4},
        scheduling={"volcanoGang": True, "tolerations": [{"key": "g", "operator": "Exists"}]},
        nccl={"ibHca": "mlx5_0", "socketIfname": "eth0", "env": {"NCCL_DEBUG": "WARN"}},
        restartPolicy={"budget": 3, "backoffSeconds": {"base": 5, "max": 60}},
        suspend=False,
    )
    doc["status"] = {
        "phase": "Running",
        "step": 12,
        "mfu": 0.41,
        "conditions": [{"type": "Placed", "status": "True", "reason": "Placed"}],
        "kopf": {"progress": {"anything": 1}},
    }
    validator.validate(doc)


def test_write_creates_the_file(tmp_path) -> None:
    path = crd.write(tmp_path / "out")
    assert path.name == "omnitrainingjobs.omni.megascale.io.yaml"
    assert path.read_text() == crd.render_yaml()


def test_unsupported_constructs_fail_loudly() -> None:
    with pytest.raises(crd.SchemaConversionError, match="unsupported keyword 'if'"):
        crd.structural({"type": "object", "if": {}})
    with pytest.raises(crd.SchemaConversionError, match="cannot make a union"):
        crd.structural({"anyOf": [{"type": "string"}, {"type": "array"}]})
