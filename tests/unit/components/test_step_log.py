"""The step log: every run that appends is told apart, even with the same restart attempt."""

from __future__ import annotations

import json
from pathlib import Path

from omni_trainer.components.progress import StepLog, read_step_log

from ...step_logs import read_step_samples


def _run(path: Path, steps: range, *, attempt: int) -> None:
    log = StepLog(path, attempt=attempt)
    log.start(len(steps), "")
    for step in steps:
        log.update(
            step, loss=float(step), tokens_per_s=1.0, mfu=0.1, fingerprint=f"{attempt}:{step}"
        )
    log.close()


def test_replayed_steps_carry_the_run_that_produced_them(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    _run(path, range(1, 4), attempt=0)
    _run(path, range(3, 5), attempt=1)  # restarted by the operator from the checkpoint at 2
    _run(path, range(4, 6), attempt=0)  # the job deleted and applied again: attempt 0 again
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(x["step"], x["attempt"], x["run"]) for x in lines] == [
        (1, 0, 0), (2, 0, 0), (3, 0, 0), (3, 1, 1), (4, 1, 1), (4, 0, 2), (5, 0, 2),
    ]  # fmt: skip
    assert read_step_log(path) == {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0, 5: 5.0}
    # The samples each step consumed, as finally counted (a replayed step's last record).
    assert read_step_samples(path) == {1: "0:1", 2: "0:2", 3: "1:3", 4: "0:4", 5: "0:5"}
