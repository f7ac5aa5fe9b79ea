"""The fast checkpoint tier across real processes (torchrun, gloo, 4 ranks as 2 nodes): each
share is copied to the peer node; a lost node's shares are restored from its peer exactly; with
a share lost on its node and its peer too, the resume falls back to the persistent tier."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from omni_trainer.launch import warm_torchrun_argv

pytestmark = pytest.mark.dist

WORKER = Path(__file__).with_name("_fast_tier_worker.py")


def test_a_lost_nodes_shares_come_back_from_its_peer(tmp_path: Path) -> None:
    proc = subprocess.run(
        warm_torchrun_argv(4, "--entry=script", str(WORKER), str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for rank, res in enumerate(results):
        assert res["saved2"] and res["saved3"], rank
        assert res["node1_lost"] == {"step": 3, "loader": {"step": 3}, "same": True}, rank
        assert res["both_lost"] == {"step": 2, "loader": {"step": 2}, "same": True}, rank
    node0 = results[0]["files"]  # node 0 holds its ranks' files and node 1's copies
    step3 = [f.removeprefix("step-00000003/") for f in node0 if f.startswith("step-00000003/")]
    assert sorted(step3) == sorted(
        ["COMMITTED", "loader/rank-00000.json", "model/.metadata"]
        + [f"model/__{r}_0.distcp" for r in range(4)]
    )
