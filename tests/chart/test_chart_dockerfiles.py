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


def test_transformer_engine_is_pinned_inside_megatron_cores_tested_range() -> None:
    """The gpu extra's TE range (pyproject.toml) lies within the range the installed
    megatron-core declares for itself (its ``dev`` extra), and has an upper bound."""
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    (ours,) = [r for r in map(Requirement, extras["gpu"]) if r.name == "transformer-engine"]
    megatron = [
        r
        for r in map(Requirement, metadata.requires("megatron-core") or [])
        if canonicalize_name(r.name) == "transformer-engine"
    ]
    assert megatron, "megatron-core no longer declares a TransformerEngine range: re-read it"
    theirs = megatron[0].specifier
    probes = [f"{major}.{minor}.0" for major in (1, 2, 3) for minor in range(20)]
    accepted = [v for v in probes if ours.specifier.contains(v)]
    assert accepted and "3.0.0" not in accepted  # bounded above
    assert all(theirs.contains(v, prereleases=True) for v in accepted), (ours, theirs)
    assert "pytorch" in ours.extras


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


OPERATOR_ENTRY_POINTS = (
    "omni_operator.handlers",  # `kopf run -m omni_operator.handlers`: the image's entrypoint
    "omni_operator.metrics",
    "omni_operator.progress",
    "omni_operator.crd",
    "omni_operator.cli",  # `omni operator` / `omni render` (the `omni.commands` entry point)
)
_ONLY_OPERATOR_EXTRA = """
import importlib, importlib.abc, json, sys

blocked = set(json.loads(sys.argv[1]))

class OnlyOperatorExtra(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r} (not in .[operator])", name=name)
        return None

sys.meta_path.insert(0, OnlyOperatorExtra())
for module in sys.argv[2:]:
    importlib.import_module(module)
import typer
import omni_operator.cli
omni_operator.cli.register(typer.Typer())
leaked = sorted(m for m in ("numpy", "torch", "megatron", "boto3") if m in sys.modules)
assert not leaked, leaked
print("imported", len(sys.argv) - 2)
"""


def test_operator_entry_points_import_with_the_operator_extra_alone() -> None:
    """As `pip install .[operator]` installs them: every installed distribution outside the
    extra's closure (numpy, torch, megatron-core, boto3, psutil...) is made unimportable."""
    allowed = _closure("operator") | {"megascale-omni"}
    blocked = sorted(
        top
        for top, dists in metadata.packages_distributions().items()
        if not any(canonicalize_name(d) in allowed for d in dists)
        and top not in sys.stdlib_module_names
        and not top.startswith(("omni_", "_"))
    )
    assert {"numpy", "torch", "megatron", "boto3"} <= set(blocked)  # the check can bite
    proc = subprocess.run(
        [sys.executable, "-c", _ONLY_OPERATOR_EXTRA, json.dumps(blocked), *OPERATOR_ENTRY_POINTS],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"imported {len(OPERATOR_ENTRY_POINTS)}" in proc.stdout
    runs = " ".join(a for i, a in instructions(DOCKERFILES / "operator.Dockerfile") if i == "RUN")
    assert "import kopf, omni_operator.handlers" in runs  # the image build smoke-imports them
