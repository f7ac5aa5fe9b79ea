"""Reading a trainer's step log in tests: what each step trained on, as it finally counted."""

from __future__ import annotations

import json
from pathlib import Path


def read_step_samples(path: str | Path) -> dict[int, str]:
    """The sample fingerprint per step as it finally counted: a step re-run after a restart
    replaces the lost one (like :func:`omni_trainer.components.progress.read_step_log`)."""
    out: dict[int, str] = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            record = json.loads(line)
            out[record["step"]] = record.get("samples", "")
    return dict(sorted(out.items()))
