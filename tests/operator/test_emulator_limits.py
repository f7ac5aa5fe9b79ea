"""The sandbox's API server answers oversized and pathologically nested manifests with a
Status that says what is wrong, as a real API server does (not a bare 413 or a crash)."""

from __future__ import annotations

import json

import aiohttp
import kmock
import pytest

from omni_operator.sandbox.emulator import MAX_BODY_BYTES, Emulator

pytestmark = pytest.mark.asyncio


async def _post(body: bytes) -> tuple[int, dict]:
    async with Emulator() as emu, kmock.Server(emu) as server:
        emu.declare("v1/configmaps", kind="ConfigMap", namespaced=True, status=False)
        url = f"{str(server.url).rstrip('/')}/api/v1/namespaces/default/configmaps"
        async with aiohttp.ClientSession() as session:
            headers = {"Content-Type": "application/json"}
            async with session.post(url, data=body, headers=headers) as resp:
                return resp.status, await resp.json()


async def test_an_oversized_manifest_gets_413_with_a_message() -> None:
    big = {"metadata": {"name": "big"}, "data": {"x": "a" * (MAX_BODY_BYTES + 10)}}
    code, status = await _post(json.dumps(big).encode())
    assert code == 413 and status["reason"] == "RequestEntityTooLarge"
    assert "more than the API server takes" in status["message"], status


async def test_a_500_deep_manifest_gets_422_with_a_message() -> None:
    deep: dict = {}
    node = deep
    for _ in range(500):
        node["x"] = {}
        node = node["x"]
    code, status = await _post(json.dumps({"metadata": {"name": "deep"}, "data": deep}).encode())
    assert code == 422 and "nests 502 levels deep, more than the 100" in status["message"], status
