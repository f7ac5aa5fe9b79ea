"""Shared by the equivalence tests: one in-process reference run, launches of many scenarios."""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
from pathlib import Path

import pytest
import torch

from omni_trainer.launch import warm_torchrun_argv

WORKER = Path(__file__).with_name("_multiplex_worker.py")


def _worker_module():
    spec = importlib.util.spec_from_file_location("_multiplex_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    """A TCP port free on the loopback now, for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_reference(doc: dict, steps: int) -> dict:
    """The single-process run (a world of one, in this process) the others must equal."""
    from omni_trainer.mcore.parallel import destroy_distributed

    try:
        return _worker_module().run_scenario(doc, steps, None)
    finally:
        destroy_distributed()


def launch(world: int, scenarios: dict[str, dict], steps: int, out: Path) -> Path:
    """Run every scenario in one torchrun launch of ``world`` processes; results under ``out``."""
    spec = out / "spec.json"
    spec.write_text(json.dumps({"steps": steps, "out": str(out), "scenarios": scenarios}))
    proc = subprocess.run(
        warm_torchrun_argv(world, "--entry=script", str(WORKER), str(spec)),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out


def assert_same_training(scenario: Path, reference: dict) -> None:
    """Loss of every step within 1e-6; gradients after step 1 within 1e-5 abs + 1e-4 rel; and
    every rank audited every step under strict collectives (``distributed.strict``)."""
    losses = json.loads((scenario / "losses.json").read_text())
    for f in sorted(scenario.glob("data*.json")):
        assert json.loads(f.read_text())["strict"]["audits"] == len(losses), (scenario.name, f.name)
    assert losses == pytest.approx(reference["losses"], abs=1e-6), scenario.name
    grads: dict[str, torch.Tensor] = {}
    for f in sorted(scenario.glob("rank*.pt")):
        grads.update(torch.load(f))
    assert grads.keys() == reference["grads"].keys(), scenario.name
    for key, expected in reference["grads"].items():
        torch.testing.assert_close(
            grads[key], expected, atol=1e-5, rtol=1e-4, msg=f"{scenario.name}: {key}"
        )
