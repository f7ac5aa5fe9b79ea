"""Least privilege in what the operator renders for a job: trainer pods with a read-only root
filesystem and a writable scratch emptyDir, the job's identity for its checkpoints."""

from __future__ import annotations

import pytest

from omni_operator.pod_access import SCRATCH_DIR
from omni_operator.render import SCRATCH_ENV

from .test_render import RDMA, _job, _objects


@pytest.mark.parametrize("extra", [{}, RDMA])
def test_trainer_pods_have_a_read_only_root_and_a_scratch_dir(extra: dict) -> None:
    job = _job(**extra)
    objs = _objects(job, attempt=2)
    pods = [o for o in objs if o["kind"] == "Pod"]
    assert pods
    for pod in pods:
        (c,) = pod["spec"]["containers"]
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        assert mounts[SCRATCH_DIR] == "scratch"
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert volumes["scratch"] == {"name": "scratch", "emptyDir": {}}
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["TMPDIR"] == SCRATCH_DIR and all(env[k] == v for k, v in SCRATCH_ENV.items())
        assert (env["OMNI_JOB_NAMESPACE"], env["OMNI_JOB_NAME"], env["OMNI_JOB_UID"]) == (
            "ml",
            job.metadata.name,
            "5f1c-uid",
        )
