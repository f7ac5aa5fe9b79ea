from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

# NCCL's rules on CPU for every process the suite starts (omni_trainer.distributed.strict).
os.environ.setdefault("OMNI_STRICT_COLLECTIVES", "1")
# The suite's processes outnumber the cores: OpenMP threads that spin between parallel regions
# (libgomp's default) take the cores from the processes with work (a tiny run: 7x the tokens/s,
# a quarter of the CPU time with two lanes running). Read when torch loads libgomp, so before.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The CPU's matmul rate (MFU's peak) measured once per session, not at every trainer's start,
# and never into the user's own cache (omni_trainer.components.throughput).
os.environ["OMNI_CACHE_DIR"] = tempfile.mkdtemp(prefix="omni-test-cache-")
atexit.register(shutil.rmtree, os.environ["OMNI_CACHE_DIR"], ignore_errors=True)

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"


@pytest.fixture(scope="session", autouse=True)
def warm_zygote() -> Iterator[None]:
    """One zygote (omni_trainer.warm) for the session's trainer workers: the stand-ins the tests
    start (``omni train --nproc``, ``warm_torchrun_argv``) fork from it instead of importing
    torch and the trainer again, about 7 s of CPU each. Started after the settings above, which
    its imports read."""
    from omni_trainer.warm import zygote_for_run

    with zygote_for_run() as env:
        os.environ.update(env)
        yield
        for name in env:
            os.environ.pop(name, None)


@pytest.fixture
def tiny_manifest() -> dict:
    """examples/tiny-cpu.yaml as a dict, for tests that derive variants of it."""
    return yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """A real S3 endpoint (moto server) on loopback."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_bucket(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh bucket on the moto server, with the AWS env pointing at it."""
    import uuid

    import boto3

    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    name = f"data-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=moto_endpoint).create_bucket(Bucket=name)
    return name
