"""Paths a manifest names: no '..', no system or kubelet directory, the fast tier's hostPath
under an allowed node directory; each error names the field and the fix."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from omni_operator.host_paths import PREFIXES_ENV, allowed_prefixes, fast_path_problem
from omni_operator.spec import parse_job
from omni_trainer.config import ManifestError
from omni_trainer.path_rules import path_problem, under

from ...conftest import EXAMPLES


def _job(checkpoint: dict[str, Any] | None = None, volumes: list | None = None) -> dict:
    doc = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    if checkpoint is not None:
        doc["spec"]["trainer"]["checkpoint"] = {"intervalSteps": 10, **checkpoint}
    if volumes is not None:
        doc["spec"]["volumes"] = volumes
    return doc


FAST = {"intervalSteps": 2}


@pytest.mark.parametrize(
    ("checkpoint", "field", "says"),
    [
        ({"path": "/data/ck/../../../etc"}, "checkpoint.path", "has a '..' component"),
        ({"path": "/etc/omni-ck"}, "checkpoint.path", "the system directory /etc"),
        ({"path": "/data/ck", "stagingDir": "/var/lib/kubelet/x"}, "checkpoint.stagingDir",
         "the system directory /var/lib/kubelet"),
        ({"path": "/data/ck", "initFrom": "/data/../x"}, "checkpoint.initFrom", "'..'"),
        ({"path": "/data/ck", "fast": {"path": "/", **FAST}}, "checkpoint.fast.path",
         "the root directory"),
        ({"path": "/data/ck", "fast": {"path": "/mnt/../var/lib/kubelet", **FAST}},
         "checkpoint.fast.path", "'..'"),
        ({"path": "/data/ck", "fast": {"path": "/var/lib/kubelet/pods", **FAST}},
         "checkpoint.fast.path", "/var/lib/kubelet"),
        ({"path": "/data/ck", "fast": {"path": "/home/me/fast", **FAST}},
         "checkpoint.fast.path", "not under an allowed node directory (/mnt, /local"),
    ],
)  # fmt: skip
def test_bad_checkpoint_paths_name_the_field(
    checkpoint: dict[str, Any], field: str, says: str
) -> None:
    with pytest.raises(ManifestError) as err:
        parse_job(_job(checkpoint))
    assert f"spec.trainer.{field}: " in str(err.value) and says in str(err.value), str(err.value)


@pytest.mark.parametrize(
    ("volume", "field"),
    [
        ({"mountPath": "/data/../etc"}, "mountPath"),
        ({"mountPath": "/data", "subPath": "a/../../b"}, "subPath"),
    ],
)
def test_volume_paths_have_no_parent_steps(volume: dict[str, str], field: str) -> None:
    with pytest.raises(ManifestError, match=rf"spec\.volumes\[0\]\.{field}: .*'\.\.' component"):
        parse_job(_job(volumes=[{"name": "data", "claimName": "pvc", **volume}]))


def test_good_paths_pass() -> None:
    ok = {"path": "s3://bucket/run", "fast": {"path": "/var/lib/omni-fast", **FAST}}
    assert parse_job(_job(ok)).spec.trainer.checkpoint is not None
    assert parse_job(_job({"path": "/data/ck", "fast": {"path": "/mnt/nvme0/ck", **FAST}}))


def test_the_allowed_prefixes_come_from_the_operators_environment() -> None:
    assert allowed_prefixes({PREFIXES_ENV: "/nvme, /ssd/omni"}) == ("/nvme", "/ssd/omni")
    assert "/mnt" in allowed_prefixes({})
    assert fast_path_problem("/ssd/omni/x", ("/ssd/omni",)) is None
    assert fast_path_problem("/ssd/omnix", ("/ssd/omni",)) is not None  # by component


def test_path_rules() -> None:
    assert under("/mnt/a", "/mnt") and not under("/mntx", "/mnt") and under("/mnt", "/mnt/")
    assert path_problem("/tmp/ck") is None and path_problem("relative/ck") is None
    assert path_problem("s3://b/../x", local=False) is not None
    assert path_problem("/proc/self", local=False) is None  # a URL-like read is not local


@pytest.mark.parametrize(
    "name", ["LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHONPATH", "PYTHONSTARTUP", "PYTHONHOME"]
)
def test_nccl_env_refuses_loader_and_interpreter_variables(name: str) -> None:
    doc = _job()
    doc["spec"]["nccl"] = {"env": {name: "/tmp/x", "NCCL_DEBUG": "INFO"}}
    with pytest.raises(ManifestError) as err:
        parse_job(doc)
    assert f"spec.nccl.env.{name}: {name} makes the loader or an interpreter" in str(err.value)
    assert "NCCL_DEBUG" not in str(err.value)
