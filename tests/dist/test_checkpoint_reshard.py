"""A checkpoint saved with one layout loads into another, exactly (real torchrun, gloo, CPU).

One 2-rank launch: the real trainer trains 2 steps with tp2 (+ ZeRO-2 encoders), pp2, dp2 (ZeRO-1
LLM + ZeRO-2 encoders: the optimizer state is gathered whole for the save) and cp2, saves
asynchronously while it keeps training, and each checkpoint is loaded into other layouts
(tp2 -> tp1 x dp2, pp2 -> tp1 x dp2, pp2 -> tp2, dp2 -> pp2 and tp2, cp2 -> dp2 and tp2; the
dp2 targets run ZeRO-1, which scatters the loaded state into its slices). The pp2 checkpoint goes to
a real S3 endpoint (moto server) so multi-rank upload + commit run too. Parameters and AdamW state
(exp_avg, exp_avg_sq, step) must be bit-identical after load, and the next training step after the
load must give the loss the saving run gave (1e-6: fp32 reductions differ between layouts).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from omni_trainer.launch import warm_torchrun_argv

from ..conftest import EXAMPLES

pytestmark = pytest.mark.dist

STEPS = 2
WORKER = Path(__file__).with_name("_checkpoint_worker.py")


def job(tensor: int = 1, pipeline: int = 1, zero: int | None = 0, context: int = 1) -> dict:
    doc = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    trainer = doc["spec"]["trainer"]
    trainer["data"]["mixture"] = [{"atTokens": 0, "weights": {"image": 1, "audio": 1, "text": 1}}]
    trainer["parallelism"] = {"tensor": tensor, "pipeline": pipeline, "context": context,
                              "encoder": {} if zero is None else {"zero": zero}}  # fmt: skip
    return doc


@pytest.fixture(scope="module")
def launch(tmp_path_factory, moto_endpoint) -> Path:
    import boto3

    out = tmp_path_factory.mktemp("ckpt")
    bucket = "reshard"
    boto3.client(
        "s3",
        endpoint_url=moto_endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    ).create_bucket(Bucket=bucket)
    scenarios = {
        "tp2": {
            "path": str(out / "store-tp2"),
            "save": job(tensor=2, zero=2),
            "load": {"dp2": job(), "tp2": job(tensor=2)},
        },
        "pp2": {
            "path": f"s3://{bucket}/runs/pp2",
            "save": job(pipeline=2),
            "load": {"dp2": job(), "tp2": job(tensor=2)},
        },
        "dp2": {  # ZeRO-1 (on by default at dp2) and the encoders' ZeRO-2 it brings
            "path": str(out / "store-dp2"),
            "save": job(zero=None),
            "load": {"pp2": job(pipeline=2), "tp2": job(tensor=2)},
        },
        "cp2": {  # CP ranks hold equal LLM weights: one of them writes each shard
            "path": str(out / "store-cp2"),
            "save": job(context=2),
            "load": {"dp2": job(), "tp2": job(tensor=2)},
        },
    }
    for name in scenarios:
        (out / name).mkdir()
    spec = out / "spec.json"
    spec.write_text(json.dumps({"steps": STEPS, "out": str(out), "scenarios": scenarios}))
    env = {
        **os.environ,
        "AWS_ENDPOINT_URL": moto_endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    proc = subprocess.run(
        warm_torchrun_argv(2, "--entry=script", str(WORKER), str(spec)),
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return out


def merged(directory: Path, pattern: str) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob(pattern)):
        part = torch.load(f)
        assert not state.keys() & part.keys(), f"{f}: written twice"
        state.update(part)
    return state


@pytest.mark.parametrize("name", ["tp2", "pp2", "dp2", "cp2"])
def test_load_into_another_layout_is_exact(launch: Path, name: str) -> None:
    report = json.loads((launch / "report.json").read_text())[name]
    saved = merged(launch / name, "saved-rank*.pt")
    assert any(k.endswith(".exp_avg_sq") for k in saved)
    assert any("linear_fc1.weight" in k for k in saved)  # stride-2 SwiGLU shards
    assert any(k.startswith("encoders.") and k.endswith(".exp_avg") for k in saved)
    for target, loss in report["loads"].items():
        loaded = merged(launch / name, f"load-{target}-rank*.pt")
        assert loaded.keys() == saved.keys(), target
        for key, expected in saved.items():
            assert torch.equal(loaded[key], expected), f"{name} -> {target}: {key}"
        assert loss == pytest.approx(report["reference"], abs=1e-6), target


def test_saves_blocked_the_loop_briefly(launch: Path) -> None:
    report = json.loads((launch / "report.json").read_text())
    assert all(entry["blocking_s"] < 1.0 for entry in report.values())
