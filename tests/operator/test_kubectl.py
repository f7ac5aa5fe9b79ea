"""The real kubectl against the sandbox's API emulator behaves as against a real API server:
plain `kubectl apply` (OpenAPI v3 says the server validates fields), admission rejects what the
CRD schema or the name rules reject (422 with the field paths), `kubectl get events` in its
forms prints Events whose times carry fractions and offsets (as clients post them)."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import kmock
import pytest
import pytest_asyncio
import yaml

from omni_operator.crd import crd
from omni_operator.sandbox.cluster import kubeconfig
from omni_operator.sandbox.emulator import Emulator
from omni_operator.sandbox.tables import printer_columns
from omni_operator.spec import GROUP, PLURAL, VERSION

from ..conftest import EXAMPLES

pytestmark = pytest.mark.asyncio
KUBECTL = str(Path(sys.executable).parent / "kubectl")


class Api:
    def __init__(self, emu: Emulator, kubeconfig_path: Path, url: str) -> None:
        self.emu, self.url = emu, url
        self.env = {**os.environ, "KUBECONFIG": str(kubeconfig_path)}

    async def kubectl(self, *args: str, stdin: str | None = None) -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec(
            KUBECTL, *args, env=self.env, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(stdin.encode() if stdin else None), 60)
        return proc.returncode or 0, out.decode(), err.decode()


@pytest_asyncio.fixture
async def api(tmp_path: Path) -> AsyncIterator[Api]:
    async with Emulator() as emu, kmock.Server(emu) as server:
        definition = crd()
        (served,) = definition["spec"]["versions"]
        emu.declare(f"{GROUP}/{VERSION}/{PLURAL}", kind="OmniTrainingJob", namespaced=True,
                    status=True, short_names=definition["spec"]["names"]["shortNames"],
                    columns=printer_columns(definition),
                    schema=served["schema"]["openAPIV3Schema"])  # fmt: skip
        url = str(server.url).rstrip("/")
        path = tmp_path / "kubeconfig"
        path.write_text(yaml.safe_dump(kubeconfig(url)))
        yield Api(emu, path, url)


def _job(name: str = "tiny-cpu", **spec: object) -> str:
    doc = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    doc["metadata"]["name"] = name
    doc["spec"].update(spec)
    return yaml.safe_dump(doc)


async def test_plain_apply_validates_on_the_server(api: Api) -> None:
    code, out, err = await api.kubectl("apply", "-f", "-", stdin=_job())
    assert code == 0 and "omnitrainingjob.omni.megascale.io/tiny-cpu created" in out, err
    code, out, err = await api.kubectl("apply", "-f", "-", stdin=_job(nodes=2))  # a PATCH
    assert code == 0 and "configured" in out, err
    assert (
        api.emu.stored(f"{GROUP}/{VERSION}/{PLURAL}", "default", "tiny-cpu")["spec"]["nodes"] == 2
    )
    code, _, err = await api.kubectl("apply", "-f", "-", stdin=_job(nodes=0))
    assert code == 1 and 'The OmniTrainingJob "tiny-cpu" is invalid' in err
    assert "spec.nodes: Invalid value: 0: 0 is less than the minimum of 1" in err


async def test_admission_rejects_bad_names_and_schema_violations_at_once(api: Api) -> None:
    code, _, err = await api.kubectl(
        "apply", "-f", "-", stdin=_job("Bad-Upper", gpusPerNode=-1, suspend="maybe")
    )
    assert code == 1 and 'The OmniTrainingJob "Bad-Upper" is invalid' in err
    assert '* metadata.name: Invalid value: "Bad-Upper": a lowercase RFC 1123 subdomain' in err
    assert "* spec.gpusPerNode: Invalid value: -1" in err
    assert "* spec.suspend: Invalid value: \"maybe\": 'maybe' is not of type 'boolean'" in err
    assert not api.emu.stored_all(f"{GROUP}/{VERSION}/{PLURAL}")
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "Under_score"},
           "spec": {"containers": [{"name": "c", "image": "x"}]}}  # fmt: skip
    code, _, err = await api.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(pod))
    assert code == 1 and 'metadata.name: Invalid value: "Under_score"' in err


async def test_get_events_in_all_forms(api: Api) -> None:
    now = dt.datetime.now(tz=dt.UTC)
    for i, stamp in enumerate((now.isoformat(), now.strftime("%Y-%m-%dT%H:%M:%SZ"))):
        event = {  # as kopf posts them: microseconds and an offset
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"tiny-cpu.{i}", "namespace": "default"},
            "involvedObject": {"kind": "OmniTrainingJob", "name": "tiny-cpu",
                               "namespace": "default"},
            "reason": "Checkpoint", "message": f"checkpoint at step {10 * (i + 1)} complete",
            "type": "Normal", "firstTimestamp": stamp, "lastTimestamp": stamp,
            "eventTime": None, "source": {"component": "kopf"},
        }  # fmt: skip
        code, _, err = await api.kubectl("create", "-f", "-", stdin=yaml.safe_dump(event))
        assert code == 0, err
    for args in ([], ["-o", "wide"], ["-A"], ["--field-selector", "involvedObject.name=tiny-cpu"],
                 ["--sort-by=.lastTimestamp"]):  # fmt: skip
        code, out, err = await api.kubectl("get", "events", *args)
        assert code == 0, (args, err)
        assert "checkpoint at step 10 complete" in out and "step 20" in out, (args, out, err)
        assert "<invalid>" not in out and "<unknown>" not in out


async def test_short_names_resolve_as_on_a_cluster(api: Api) -> None:
    """``kubectl get svc`` (and every short name a real API server lists for these kinds)."""
    svc = {"apiVersion": "v1", "kind": "Service",
           "metadata": {"name": "job-a0-rdzv", "namespace": "default"},
           "spec": {"clusterIP": "None", "ports": [{"port": 29500}]}}  # fmt: skip
    code, _, err = await api.kubectl("create", "-f", "-", stdin=yaml.safe_dump(svc))
    assert code == 0, err
    code, out, err = await api.kubectl("get", "svc")
    assert code == 0 and "job-a0-rdzv" in out, (out, err)
    for short in ("ns", "no", "po", "cm", "pvc", "ev", "crd", "pg"):
        code, _, err = await api.kubectl("get", short, "-A")
        assert code == 0, (short, err)


async def test_watches_stream_json_for_get_w_and_delete(api: Api) -> None:
    """``kubectl get -w`` (the README's ``kubectl get otj -w``) prints a row per change with the
    printer columns, and ``kubectl delete`` waits through a watch-list (initial events, then a
    bookmark) without client-go errors; both failed on kmock's untyped watch stream."""
    code, _, err = await api.kubectl("apply", "-f", "-", stdin=_job())
    assert code == 0, err
    proc = await asyncio.create_subprocess_exec(
        KUBECTL, "get", "otj", "-w", env=api.env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    try:
        header = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert b"PHASE" in header and b"RESTARTS" in header, header
        await asyncio.wait_for(proc.stdout.readline(), 30)  # the job as it is
        status = json.dumps({"status": {"phase": "Running", "step": 42, "restarts": 0}})
        code, _, err = await api.kubectl("patch", "otj", "tiny-cpu", "--subresource=status",
                                         "--type=merge", "-p", status)  # fmt: skip
        assert code == 0, err
        row = await asyncio.wait_for(proc.stdout.readline(), 30)  # the change, as a row
        assert b"tiny-cpu" in row and b"Running" in row and b"42" in row, row
    finally:
        proc.kill()
        _, err_bytes = await proc.communicate()
    assert b"serializer" not in err_bytes, err_bytes
    code, out, err = await api.kubectl("delete", "otj", "tiny-cpu")
    assert code == 0 and "deleted" in out and "Failed to watch" not in err, (out, err)
    assert "serializer" not in err and "bookmark" not in err, err


async def test_stored_objects_survive_an_api_server_restart(tmp_path: Path) -> None:
    store = tmp_path / "api-objects.json"
    async with Emulator(store=store) as emu, kmock.Server(emu) as server:
        url = str(server.url).rstrip("/")
        path = tmp_path / "kc"
        path.write_text(yaml.safe_dump(kubeconfig(url)))
        api = Api(emu, path, url)
        cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "keep"},
              "data": {"a": "1"}}  # fmt: skip
        for name in ("keep", "gone"):
            cm["metadata"]["name"] = name
            assert (await api.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(cm)))[0] == 0
        assert (await api.kubectl("delete", "configmap", "gone"))[0] == 0
        before = emu.stored("v1/configmaps", "default", "keep")
    async with Emulator(store=store) as emu:
        assert emu.restore() >= 1
        assert emu.stored("v1/configmaps", "default", "keep") == before
        assert emu.stored("v1/configmaps", "default", "gone") is None
        assert int(emu._next_rv()) > int(before["metadata"]["resourceVersion"])


async def test_served_requests_leave_the_request_log(api: Api) -> None:
    """kmock scans its whole request log for every request it matches: a log of every request
    served made each read slower than the last (a sandbox's API server spent most of a core
    there). Served requests leave it; a watch in flight stays, and a job is still served."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        watch = await session.get(f"{api.url}/api/v1/namespaces/default/pods?watch=true")
        for _ in range(50):
            async with session.get(f"{api.url}/api/v1/namespaces/default/pods") as r:
                assert r.status == 200
        assert len(api.emu._requests) == 1  # the watch, still streaming
        watch.close()
    code, _, err = await api.kubectl("get", "pods", "-A")
    assert code == 0, err
