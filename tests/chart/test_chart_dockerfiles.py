"""What can be checked of the images without Docker: entrypoints, users, ports, no torch."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib import metadata
from importlib.util import find_spec
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from omni_operator.render import RDZV_PORT, TRAINER_UID
from omni_trainer.components.metrics import DEFAULT_PORT as TRAINER_METRICS_PORT

from .conftest import CHART_DIR, REPO

DOCKERFILES = REPO / "dockerfiles"
TORCH_LIKE = {"torch", "megatron-core", "transformer-engine", "triton"}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n(\s*#.*\n)*", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def last(path: Path, instruction: str) -> str:
    return [a for i, a in instructions(path) if i == instruction][-1]


def test_operator_entrypoint_is_kopf_run_on_the_handlers_module() -> None:
    df = DOCKERFILES / "operator.Dockerfile"
    entry = json.loads(last(df, "ENTRYPOINT"))
    assert entry == ["kopf", "run", "-m", "omni_operator.handlers"]
    scripts = {ep.name for ep in metadata.entry_points(group="console_scripts")}
    assert "kopf" in scripts
    from kopf.cli import main

    assert "run" in main.commands


@pytest.mark.xfail(
    find_spec("omni_operator.handlers") is None,
    reason="omni_operator.handlers arrives with the reconcile handlers",
    strict=True,
)
def test_operator_handlers_module_exists() -> None:
    assert find_spec("omni_operator.handlers") is not None


def test_operator_image_is_slim_non_root_and_matches_the_chart() -> None:
    df = DOCKERFILES / "operator.Dockerfile"
    text = df.read_text()
    assert "slim" in last(df, "ARG") or "slim" in text.split("FROM", 1)[1].splitlines()[0]
    runs = " ".join(a for i, a in instructions(df) if i == "RUN")
    installs = [i.strip() for i in re.findall(r"pip install ([^&]+)", runs)]
    assert installs == ['".[operator]"'], installs  # the operator extra only, no torch
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    uid = values["podSecurityContext"]["runAsUser"]
    assert last(df, "USER") == f"{uid}:{uid}"
    exposed = {int(p) for p in last(df, "EXPOSE").split()}
    assert exposed == {values["operator"]["healthPort"], values["operator"]["metricsPort"]}


def test_trainer_image() -> None:
    df = DOCKERFILES / "trainer.Dockerfile"
    text = df.read_text()
    froms = [a for i, a in instructions(df) if i == "FROM"]
    assert all(f.startswith("nvidia/cuda:") for f in froms)
    assert '".[trainer,gpu]"' in text  # megatron-core + TransformerEngine through the extras
    assert json.loads(last(df, "ENTRYPOINT")) == ["omni", "train"]
    assert last(df, "USER") == f"{TRAINER_UID}:{TRAINER_UID}"  # the operator's pod securityContext
    assert {int(p) for p in last(df, "EXPOSE").split()} == {RDZV_PORT, TRAINER_METRICS_PORT}
    # `omni train` is a real command of the `omni` console script; the operator's pods run
    # `torchrun ... -m omni_trainer.cli train`, which the image gets with torch.
    assert "omni" in {ep.name for ep in metadata.entry_points(group="console_scripts")}
    from omni_trainer.cli import app

    assert "train" in {c.name or c.callback.__name__ for c in app.registered_commands}
    assert find_spec("omni_trainer.cli") is not None


def test_gpu_extra_carries_transformer_engine() -> None:
    reqs = [Requirement(r) for r in metadata.requires("megascale-omni") or []]
    gpu = {
        canonicalize_name(r.name) for r in reqs if r.marker and r.marker.evaluate({"extra": "gpu"})
    }
    assert "transformer-engine" in gpu


def _closure(extra: str) -> set[str]:
    """Every distribution `pip install .[extra]` pulls, resolved from installed metadata."""
    seen: set[str] = set()
    todo = [
        r
        for r in (Requirement(s) for s in metadata.requires("megascale-omni") or [])
        if r.marker is None or r.marker.evaluate({"extra": extra})
    ]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue  # not installed here: cannot descend, but the name itself is checked
        for sub in map(Requirement, requires):
            extras = req.extras or {""}
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in extras):
                todo.append(sub)
    return seen


def test_operator_extra_pulls_no_torch() -> None:
    deps = _closure("operator")
    assert {"kopf", "kubernetes", "prometheus-client", "pydantic"} <= deps
    assert not deps & TORCH_LIKE, sorted(deps & TORCH_LIKE)
    assert not any(d.startswith("nvidia-") for d in deps)
    assert "torch" in _closure("trainer")  # the check can see torch where it is pulled


@pytest.mark.slow
def test_operator_extra_pip_dry_run_pulls_no_torch(tmp_path: Path) -> None:
    """The real resolver against the package index (skipped where the index is unreachable)."""
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
         "--disable-pip-version-check", "--report", str(report), f"{REPO}[operator]"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if proc.returncode != 0:
        pytest.skip(f"pip could not resolve here: {proc.stderr.strip()[-300:]}")
    names = {
        canonicalize_name(i["metadata"]["name"]) for i in json.loads(report.read_text())["install"]
    }
    assert "kopf" in names
    assert not names & TORCH_LIKE and not any(n.startswith("nvidia-") for n in names)
