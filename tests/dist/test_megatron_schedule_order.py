"""``stage_ops`` is the order megatron-core really runs: recorded from real torchrun processes.

The dataflow table places encoder work by index into each stage's forward calls and reasons about
deadlocks with that order, so it must match megatron's schedules exactly (forward calls and
backward ops, 1F1B and interleaved). Scenarios are grouped per world size: one launch each.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from omni_trainer.launch import warm_torchrun_argv
from omni_trainer.multiplex.dataflow.schedule import LLMOp, stage_ops

pytestmark = pytest.mark.dist

WORKER = Path(__file__).with_name("_schedule_order_worker.py")


@pytest.mark.parametrize(
    ("nproc", "scenarios"),
    [(2, [(2, 1, 4), (2, 2, 4)]), (4, [(4, 1, 8), (4, 2, 8)])],
    ids=["pp2", "pp4"],
)
def test_stage_ops_equal_recorded_megatron_order(tmp_path, nproc, scenarios) -> None:
    proc = subprocess.run(
        warm_torchrun_argv(
            nproc, "--entry=script", str(WORKER), json.dumps(scenarios), str(tmp_path)
        ),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    for stage in range(nproc):
        records = json.loads((tmp_path / f"rank{stage}.json").read_text())
        assert [(r["pp"], r["vpp"], r["num_microbatches"]) for r in records] == scenarios
        for r in records:
            recorded = [LLMOp(kind, m, c) for kind, m, c in r["ops"]]
            expected = stage_ops(
                stage=stage, pp=r["pp"], vpp=r["vpp"], num_microbatches=r["num_microbatches"]
            )
            assert recorded == expected, f"stage {stage} of {r['pp'], r['vpp']}"
