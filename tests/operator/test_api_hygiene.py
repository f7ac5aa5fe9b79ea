"""The operator's API hygiene: conditional status writes, RBAC for owner references, no
credential files left behind."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import tempfile
from pathlib import Path
from typing import Any

import kopf
import pytest

from omni_operator.handlers.kube import Kube
from omni_operator.sandbox.testbed import Cluster, job_manifest

pytestmark = pytest.mark.asyncio


def _race_status_writes(cluster: Cluster, job: str, times: int) -> list[int]:
    """Before each of the operator's next ``times`` status writes, another writer changes the
    job (an annotation, as kopf or kubectl would): the write must meet a 409 and be re-decided.
    Returns the HTTP statuses of the operator's status writes as they happen."""
    kube = cluster._memos[-1]["omni"].kube
    request = kube.request
    statuses: list[int] = []

    async def racing(method: str, path: str, **kwargs: Any) -> Any:
        if method == "PATCH" and path.endswith(f"/{job}/status") and len(statuses) < times:
            n = len(statuses)
            await cluster.patch_job(job, {"metadata": {"annotations": {"race": str(n)}}})
        try:
            result = await request(method, path, **kwargs)
        except Exception as err:
            if path.endswith(f"/{job}/status"):
                statuses.append(getattr(err, "status", 0))
            raise
        if method == "PATCH" and path.endswith(f"/{job}/status"):
            statuses.append(200)
        return result

    kube.request = racing
    return statuses


async def test_a_restart_decision_is_written_over_the_state_it_was_made_from(
    cluster: Cluster,
) -> None:
    """A pod fails; the operator's status write meets a newer job twice (409), so it re-reads
    and decides again. The restart happens once, for the pod's failure: the pods were not
    deleted before the decision was recorded (else the retry would see them going and record
    a PodDeleted restart)."""
    from omni_operator.reconcile import Progress

    cluster.progress["train"] = Progress(step=3)
    await cluster.apply(job_manifest())
    await cluster.wait("pods", lambda: len(cluster.pods("train", 0)) == 2)
    await cluster.run_pods("train")
    await cluster.wait("Running", lambda: cluster.status("train").get("step") == 3)
    statuses = _race_status_writes(cluster, "train", times=2)
    await cluster.exit_pod("train-a0-n1", 1)
    await cluster.wait("attempt 1", lambda: cluster.status("train").get("attempt") == 1)
    await asyncio.sleep(0.3)
    st = cluster.status("train")
    assert statuses[:3] == [409, 409, 200], statuses
    assert st["restarts"] == 1
    (record,) = st["restartHistory"]
    assert record["reason"] == "PodFailed" and "train-a0-n1" in record["message"]
    assert cluster.job("train")["metadata"]["annotations"]["race"] == "1"  # theirs kept too


async def test_spec_change_of_an_invalid_job_is_retried_under_the_lock(cluster: Cluster) -> None:
    doc = job_manifest()
    doc["spec"]["trainer"]["parallelism"] = {"tensor": 3}
    await cluster.apply(doc)
    await cluster.wait("Failed", lambda: cluster.status("train").get("phase") == "Failed")
    statuses = _race_status_writes(cluster, "train", times=1)
    await cluster.patch_job("train", {"spec": {"trainer": {"parallelism": {"tensor": 1}}}})
    await cluster.wait("pods", lambda: len(cluster.pods("train", 0)) == 2)
    await cluster.wait("Starting", lambda: cluster.status("train").get("phase") == "Starting")
    assert statuses[:2] == [409, 200], statuses


def _self_signed() -> tuple[bytes, bytes]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "omni-operator")])
    now = dt.datetime.now(tz=dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now)
        .not_valid_after(now + dt.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    pem_key = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert.public_bytes(serialization.Encoding.PEM), pem_key


async def test_inline_client_certificates_leave_no_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kubeconfig's client-certificate-data must reach ssl through files: they are owner-only
    while loaded and removed at once (no private keys pile up in /tmp across re-logins)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    cert, key = _self_signed()
    seen: list[tuple[str, int]] = []
    real_load = __import__("ssl").SSLContext.load_cert_chain

    def spy(self: Any, certfile: str, keyfile: str | None = None, password: Any = None) -> None:
        seen.append((certfile, os.stat(certfile).st_mode & 0o777))
        real_load(self, certfile, keyfile, password)

    monkeypatch.setattr("ssl.SSLContext.load_cert_chain", spy)
    kube = Kube(
        kopf.ConnectionInfo(
            server="https://127.0.0.1:6443", certificate_data=cert, private_key_data=key
        )
    )
    for _ in range(3):  # a session per (re-)login
        session = kube._make_session()
        await session.close()
    assert len(seen) == 3 and all(mode == 0o600 for _, mode in seen)
    assert all(Path(p).parent == tmp_path for p, _ in seen)
    assert list(tmp_path.iterdir()) == []
