"""The import graphs of omni_trainer and omni_operator: no circles, every import points down.

Each package's floors are written once below, from the ground up. A module stands on the floor of
the longest entry naming it or a package above it; it may import modules on its own floor or
below, never above. Imports are read from the source (module level, inside functions, under
``TYPE_CHECKING``), so an import hidden in a function counts like any other.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

TRAINER_LAYERS: list[tuple[str, list[str]]] = [
    (
        "spec: the torch-free manifest, its formulas, the operator<->pod protocol, one URL layer",
        [
            "omni_trainer",
            "omni_trainer.config_base",
            "omni_trainer.megatron_imports",
            "omni_trainer.field_names",
            "omni_trainer.path_rules",
            "omni_trainer.pod_protocol",
            "omni_trainer.termination",
            "omni_trainer.failure_report",
            "omni_trainer.storage",
            "omni_trainer.costs",
            "omni_trainer.config",
            "omni_trainer.checkpoint.config",
            "omni_trainer.checkpoint.owner",
            "omni_trainer.data.config",
            "omni_trainer.data.lengths",
            "omni_trainer.distributed.config",
            "omni_trainer.models.config",
            "omni_trainer.models.encoders.config",
            "omni_trainer.interop.hf_config",
            "omni_trainer.interop.qwen2_5_vl",
            "omni_trainer.interop.source",
        ],
    ),
    (
        "data, balance, the step's cost model, collectives and process groups",
        [
            "omni_trainer.data",
            "omni_trainer.balance",
            "omni_trainer.costs.step_costs",
            "omni_trainer.distributed",
            "omni_trainer.mcore",
        ],
    ),
    (
        "models, checkpoints, Hugging Face interop",
        ["omni_trainer.models", "omni_trainer.checkpoint", "omni_trainer.interop"],
    ),
    (
        "multiplex dataflow: megatron's op order, the table, its happens-before graph, validation",
        [
            "omni_trainer.multiplex.dataflow",
            "omni_trainer.multiplex.dataflow.schedule",
            "omni_trainer.multiplex.dataflow.table",
            "omni_trainer.multiplex.dataflow.graph",
            "omni_trainer.multiplex.dataflow.validate",
        ],
    ),
    (
        "multiplex planners: the fixed policies, auto and its refinement, the policies' entry",
        [
            "omni_trainer.multiplex.dataflow.policies",
            "omni_trainer.multiplex.dataflow.refine",
            "omni_trainer.multiplex.dataflow.auto",
            "omni_trainer.multiplex.dataflow.plan",
        ],
    ),
    (
        "multiplex: the tables' simulation, display and replay, the step's encoder workload",
        [
            "omni_trainer.multiplex",
            "omni_trainer.multiplex.dataflow.simulate",
            "omni_trainer.multiplex.dataflow.display",
        ],
    ),
    ("components: the step's runtime parts", ["omni_trainer.components"]),
    (
        "the training loop and its launch (torchrun, the zygote its workers fork from)",
        ["omni_trainer.trainer", "omni_trainer.launch", "omni_trainer.warm"],
    ),
    (
        "offline planning, the pod's supervisor, the command line",
        [
            "omni_trainer.planner",
            "omni_trainer.plan",
            "omni_trainer.preflight",
            "omni_trainer.supervisor",
            "omni_trainer.cli",
        ],
    ),
]

OPERATOR_LAYERS: list[tuple[str, list[str]]] = [
    (
        "Kubernetes object access and plain helpers",
        [
            "omni_operator",
            "omni_operator.status",
            "omni_operator.rbac",
            "omni_operator.pod_access",
            "omni_operator.times",
            "omni_operator.host_paths",
            "omni_operator.capacity",
            "omni_operator.failure_origin",
            "omni_operator.dashboards",
        ],
    ),
    ("the job spec and metrics", ["omni_operator.spec", "omni_operator.metrics"]),
    (
        "placement, CRD, queues, quarantine",
        [
            "omni_operator.placement",
            "omni_operator.crd",
            "omni_operator.kueue",
            "omni_operator.volcano",
            "omni_operator.quarantine",
        ],
    ),
    ("rendering the job's objects", ["omni_operator.render"]),
    ("reading pods and Nodes", ["omni_operator.kube_objects"]),
    (
        "failure classification, reports, admission",
        ["omni_operator.recovery.failures", "omni_operator.reports", "omni_operator.admission"],
    ),
    ("restart decisions", ["omni_operator.recovery", "omni_operator.recovery.restarts"]),
    ("spares and stragglers", ["omni_operator.spares", "omni_operator.stragglers"]),
    ("the pure reconcile", ["omni_operator.reconcile"]),
    (
        "the operator's API client and shared state",
        ["omni_operator.handlers.kube", "omni_operator.handlers.operator_state"],
    ),
    ("one job's observe, reconcile, apply", ["omni_operator.handlers.engine"]),
    ("the per-job reconcile loop", ["omni_operator.handlers.loop"]),
    ("kopf handlers", ["omni_operator.progress", "omni_operator.handlers"]),
    (
        "the sandbox's plain parts: fault control, scheduler filters, tables, wire formats",
        [
            "omni_operator.sandbox.control",
            "omni_operator.sandbox.scheduling",
            "omni_operator.sandbox.tables",
            "omni_operator.sandbox.protobuf",
            "omni_operator.sandbox.downward",
            "omni_operator.sandbox.degrade",
            "omni_operator.sandbox.probes",
        ],
    ),
    ("the sandbox's API server, a class per layer", ["omni_operator.sandbox.emulator"]),
    (
        "the sandbox kubelet's API calls, network, nodes, back-off, containers",
        [
            "omni_operator.sandbox.kubelet.api",
            "omni_operator.sandbox.kubelet.network",
            "omni_operator.sandbox.kubelet.node",
            "omni_operator.sandbox.kubelet.backoff",
            "omni_operator.sandbox.kubelet.container",
        ],
    ),
    (
        "the sandbox kubelet's roles: images, volumes, scheduler, runtime, faults",
        [
            "omni_operator.sandbox.kubelet.images",
            "omni_operator.sandbox.kubelet.volumes",
            "omni_operator.sandbox.kubelet.scheduler",
            "omni_operator.sandbox.kubelet.command",
            "omni_operator.sandbox.kubelet.runtime",
            "omni_operator.sandbox.kubelet.faults",
        ],
    ),
    ("the sandbox kubelet", ["omni_operator.sandbox.kubelet"]),
    ("the sandbox cluster, its controllers, the testbed", ["omni_operator.sandbox"]),
    ("the command line", ["omni_operator.cli"]),
]

TORCH_FREE = [
    "omni_trainer.config",
    "omni_trainer.costs.flops",
    "omni_trainer.costs.model_flops",
    "omni_trainer.costs.activation_bytes",
    "omni_trainer.costs.devices",
    "omni_trainer.pod_protocol",
    "omni_trainer.supervisor",
    "omni_trainer.warm",
    "omni_trainer.termination",
    "omni_trainer.failure_report",
    "omni_trainer.storage",
]
"""Modules the operator, the planner and the pod's supervisor import without torch."""


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    where: str


def _modules(package: Path) -> dict[str, tuple[Path, bool]]:
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        out[".".join(parts)] = (path, is_package)
    return out


def _imports(name: str, path: Path, is_package: bool) -> Iterator[tuple[str, int]]:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                yield f"{module}.{alias.name}", node.lineno
            yield module, node.lineno


def import_graph(package: Path) -> list[Edge]:
    """Every import between two modules of ``package`` (``from a import b`` names module ``a.b``
    when there is one, else ``a``)."""
    modules = _modules(package)
    top = package.name

    def resolve(target: str) -> str | None:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target or None

    edges = {}
    for name, (path, is_package) in modules.items():
        seen_lines: dict[int, set[str]] = {}
        for target, line in _imports(name, path, is_package):
            resolved = resolve(target)
            if resolved is None or not resolved.startswith(top) or resolved == name:
                continue
            seen_lines.setdefault(line, set()).add(resolved)
        for line, targets in seen_lines.items():
            # ``from a import b`` yields both ``a.b`` and ``a``: keep the most specific
            for t in targets:
                if any(o != t and o.startswith(t + ".") for o in targets):
                    continue
                where = f"{path.relative_to(ROOT)}:{line}"
                edges.setdefault((name, t), Edge(name, t, where))
    return sorted(edges.values(), key=lambda e: (e.importer, e.imported))


def floor_of(module: str, layers: list[tuple[str, list[str]]]) -> int | None:
    best, floor = -1, None
    for i, (_, entries) in enumerate(layers):
        for entry in entries:
            if (module == entry or module.startswith(entry + ".")) and len(entry) > best:
                best, floor = len(entry), i
    return floor


def cycles(edges: list[Edge]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    graph: dict[str, list[str]] = {}
    for e in edges:
        graph.setdefault(e.importer, []).append(e.imported)
        graph.setdefault(e.imported, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


PACKAGES = [
    pytest.param(ROOT / "trainer" / "omni_trainer", TRAINER_LAYERS, id="trainer"),
    pytest.param(ROOT / "operator" / "omni_operator", OPERATOR_LAYERS, id="operator"),
]


@pytest.mark.parametrize(("package", "layers"), PACKAGES)
def test_every_module_stands_on_a_floor(package: Path, layers: list) -> None:
    unplaced = [m for m in _modules(package) if floor_of(m, layers) is None]
    assert not unplaced, f"modules on no floor: {unplaced}"


@pytest.mark.parametrize(("package", "layers"), PACKAGES)
def test_no_import_cycles(package: Path, layers: list) -> None:
    edges = import_graph(package)
    problems = []
    for component in cycles(edges):
        members = set(component)
        inside = [f"  {e.where}: {e.importer} -> {e.imported}" for e in edges
                  if e.importer in members and e.imported in members]  # fmt: skip
        problems.append("cycle among " + ", ".join(component) + ":\n" + "\n".join(inside))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(("package", "layers"), PACKAGES)
def test_imports_point_down(package: Path, layers: list) -> None:
    upward = []
    for e in import_graph(package):
        low, high = floor_of(e.importer, layers), floor_of(e.imported, layers)
        if low is None or high is None or high <= low:
            continue
        upward.append(
            f"  {e.where}: {e.importer} (floor {low}: {layers[low][0]}) imports "
            f"{e.imported} (floor {high}: {layers[high][0]})"
        )
    assert not upward, "imports that point up:\n" + "\n".join(upward)


def test_torch_free_modules_import_no_torch() -> None:
    code = (
        f"import sys, importlib; [importlib.import_module(m) for m in {TORCH_FREE!r}];"
        "heavy = sorted(m for m in ('torch', 'megatron', 'numpy') if m in sys.modules);"
        "sys.exit(', '.join(heavy) or None)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
