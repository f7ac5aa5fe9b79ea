"""The network preflight across three real processes (one per node, gloo): a healthy gang passes
with its figures, a slow node and a silent one are named by every rank that can, each process
ends with EXIT_PREFLIGHT and the PreflightFailed termination message, within the timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from omni_trainer.distributed.netcheck_rules import EXIT_PREFLIGHT, parse_failure

from .harness import free_port

pytestmark = pytest.mark.dist

WORKER = Path(__file__).with_name("_netcheck_worker.py")
WORLD = 3


def run(scenario: str, tmp_path: Path) -> tuple[list[int], list[dict | None], list[str]]:
    port = free_port()
    procs = []
    for rank in range(WORLD):
        env = os.environ | {
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
            "WORLD_SIZE": str(WORLD), "LOCAL_RANK": "0",
            "OMNI_TERMINATION_LOG": str(tmp_path / f"term{rank}"),
        }  # fmt: skip
        argv = [sys.executable, str(WORKER), str(tmp_path), scenario]
        procs.append(
            subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        )
    codes = [p.wait(timeout=120) for p in procs]
    logs = [p.stdout.read().decode() for p in procs]
    results = [
        json.loads(f.read_text()) if (f := tmp_path / f"rank{r}.json").exists() else None
        for r in range(WORLD)
    ]
    terms = [f.read_text() if (f := tmp_path / f"term{r}").exists() else "" for r in range(WORLD)]
    assert all(c in (0, EXIT_PREFLIGHT) for c in codes[:2]), (codes, [x[-1500:] for x in logs])
    return codes, results, terms


def test_healthy_gang_passes_with_figures(tmp_path):
    codes, results, terms = run("healthy", tmp_path)
    assert codes == [0, 0, 0] and terms == ["", "", ""]
    for r in results:
        assert r["failed"] == [] and r["complete"]
        assert set(r["nodes"]) == {"n0", "n1", "n2"} and all(g > 0 for g in r["nodes"].values())
        assert r["all_reduce_gbps"] > 0 and r["all_gather_gbps"] > 0
    assert results[0]["nodes"] == results[2]["nodes"]  # every rank agrees


def test_slow_node_is_named_by_every_rank(tmp_path):
    codes, results, terms = run("slow", tmp_path)
    assert codes == [EXIT_PREFLIGHT] * WORLD
    for r, term in zip(results, terms, strict=True):
        assert r["failed"] == ["n1"]
        assert parse_failure(term)["failed"] == ["n1"]
    assert results[0]["nodes"]["n1"] < 0.5 * results[0]["median_gbps"]


def test_silent_node_is_named_by_its_neighbours_within_the_timeout(tmp_path):
    codes, results, terms = run("silent", tmp_path)
    assert codes[:2] == [EXIT_PREFLIGHT] * 2
    for r, term in zip(results[:2], terms[:2], strict=True):
        assert r["failed"] == ["n2"] and not r["complete"]
        assert parse_failure(term)["failed"] == ["n2"]
    # bounded: a few timeouts of 5 s, not a hang (the silent rank sleeps 15 s before it exits)
    assert all(r["preflight_seconds"] < 30 for r in results[:2]), results
