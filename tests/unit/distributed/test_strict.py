"""The strict collectives audit (``omni_trainer.distributed.strict``) on two gloo processes:
it names a pair whose unbatched ops do not mirror, a collective one rank skipped, a batch that
creates its group's communicator on one rank only, a pair communicator first used after the
warm-up; mirrored and batched exchanges pass."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from omni_trainer.distributed import strict

WORKER = Path(__file__).with_name("_strict_worker.py")


@pytest.fixture(scope="module")
def audits(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("strict")
    env = os.environ | {
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
        strict.ENV: "1",
    }  # fmt: skip
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(out)],
            env=env | {"RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(2)
    ]
    logs = [p.communicate(timeout=120)[0].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [log[-2000:] for log in logs]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_mirrored_and_batched_exchanges_pass(audits):
    for results in audits:
        assert results["mirrored"] is None
        assert results["batched"] is None


def test_a_pair_that_does_not_mirror_is_named_with_its_sizes(audits):
    for results in audits:
        assert "pair 0<->1, op 0: rank 0 send 3, rank 1 send 5" in results["send_then_receive"]


def test_a_collective_skipped_by_one_rank_is_named(audits):
    for results in audits:
        error = results["skipped_collective"]
        assert "collective 1: rank 0 ('all_reduce', 4), rank 1 nothing" in error


def test_a_batch_creating_its_group_on_one_rank_only_is_named(audits):
    for results in audits:
        error = results["batch_by_a_subset"]
        assert "first operation is a batch_isend_irecv" in error
        assert "rank 0 batch send 2, rank 1 recv 2" in error  # batched on one end only


def test_a_pair_first_used_after_the_warm_up_is_named(audits):
    for results in audits:
        error = results["pair_after_warm_up"]
        assert "rank 0: the communicator of pair 0<->1" in error
        assert "rank 1: the communicator of pair 0<->1" in error
