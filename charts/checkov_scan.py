"""Scan what a cluster receives with checkov: the chart's objects (defaults and cluster-wide)
and the pods the operator renders for a GPU job with RDMA (``examples/vlm-7b.yaml``) and a CPU
job (``examples/tiny-cpu.yaml``).

checkov runs from its own virtual environment (``make checkov`` creates ``.venv-checkov``: its
pins conflict with the project's). Every failure must be a check listed in :data:`ACCEPTED`
with the reason it stays; any other failure fails the scan, naming the check and the objects.

    make checkov
    python charts/checkov_scan.py --checkov .venv-checkov/bin/checkov
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "megascale-omni"
NODES = REPO / "tests" / "unit" / "operator" / "data" / "nodes-16.yaml"
VALUE_SETS = {"defaults": {}, "cluster-wide": {"operator": {"clusterWide": True}}}
JOBS = {"vlm-7b": "examples/vlm-7b.yaml", "tiny-cpu": "examples/tiny-cpu.yaml"}
NAMESPACE = "team-a"
"""The jobs' namespace (the examples name none, and `default` is a finding of its own)."""

ACCEPTED: dict[str, str] = {
    "CKV_K8S_8": "trainer pods have no liveness probe: the operator finds a hung trainer from its "
    "step heartbeats (restartPolicy.hangTimeoutSeconds) and restarts every rank together from a "
    "checkpoint; a kubelet probe would restart one container behind the gang's back",
    "CKV_K8S_11": "no CPU limit by default: CFS quotas throttle the data loader and NCCL proxy "
    "threads of a GPU trainer; the operator's limit is a chart value (resources.limits)",
    "CKV_K8S_13": "a job without resources.memory (examples/tiny-cpu.yaml) gets no memory limit; "
    "with it, the pods' request and limit are that value",
    "CKV_K8S_15": "imagePullPolicy IfNotPresent: trainer images are many GB and pinned by tag or "
    "digest; Always would pull again at every in-place restart",
    "CKV_K8S_43": "the image is the user's (spec.image) or the chart's image.repository/tag: "
    "either may be given as a digest",
    "CKV_K8S_23": "RDMA pods only (resources.rdma): registering InfiniBand memory needs IPC_LOCK, "
    "which a non-root process holds only as root; pods without RDMA run as a non-root UID",
    "CKV_K8S_40": "RDMA pods only, as CKV_K8S_23 (other pods run as UID 10001)",
    "CKV_K8S_25": "RDMA pods only: IPC_LOCK is added for InfiniBand memory registration, no other "
    "capability (all dropped otherwise)",
    "CKV_K8S_35": "S3 credentials come from the user's Secret through envFrom: the AWS SDKs read "
    "AWS_* from the environment; nothing logs them (checked by the sandbox's credential test)",
    "CKV_K8S_38": "the operator's own service-account token: it talks to the API server; trainer "
    "pods do not mount one",
}


def chart_objects() -> dict[str, list[dict]]:
    import helm_python as helm

    chart = helm.Chart.load(CHART)
    out = {}
    for name, values in VALUE_SETS.items():
        docs = chart.render(values, name="omni", namespace="omni-system")
        out[f"chart-{name}"] = [
            d
            for path, text in sorted(docs.items())
            if not path.endswith("NOTES.txt")
            for d in yaml.safe_load_all(text)
            if d
        ]
    return out


def job_objects() -> dict[str, list[dict]]:
    from omni_operator.cli import load_nodes
    from omni_operator.placement import place
    from omni_operator.render import render_all
    from omni_operator.spec import parse_job

    nodes = load_nodes(NODES)
    out = {}
    for name, manifest in JOBS.items():
        doc = yaml.safe_load((REPO / manifest).read_text())
        doc.setdefault("metadata", {})["namespace"] = NAMESPACE
        job = parse_job(doc)
        out[f"job-{name}"] = list(render_all(job, place(nodes, job.spec), attempt=0))
    return out


def scan(checkov: str, objects: dict[str, list[dict]]) -> dict[str, set[str]]:
    """checkov's failed checks -> the objects failing each (file:resource)."""
    with tempfile.TemporaryDirectory() as tmp:
        for name, docs in objects.items():
            (Path(tmp) / f"{name}.yaml").write_text(yaml.safe_dump_all(docs))
        proc = subprocess.run(
            [checkov, "-d", tmp, "--framework", "kubernetes", "--quiet", "-o", "json"],
            capture_output=True,
            text=True,
        )
    if not proc.stdout.strip():
        sys.exit(f"checkov produced no report (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    reports = json.loads(proc.stdout)
    failed: dict[str, set[str]] = collections.defaultdict(set)
    for report in reports if isinstance(reports, list) else [reports]:
        for check in report["results"]["failed_checks"]:
            where = Path(check["file_path"]).stem + ":" + check["resource"]
            failed[f"{check['check_id']} {check['check_name']}"].add(where)
    return failed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkov", default=str(REPO / ".venv-checkov" / "bin" / "checkov"))
    args = p.parse_args()
    objects = {**chart_objects(), **job_objects()}
    failed = scan(args.checkov, objects)
    print(f"scanned {sum(map(len, objects.values()))} objects: {', '.join(objects)}")
    unexplained = []
    for check, where in sorted(failed.items()):
        files = collections.Counter(w.split(":")[0] for w in where)
        print(f"FAILED {check}: {', '.join(f'{f} x{n}' for f, n in sorted(files.items()))}")
        reason = ACCEPTED.get(check.split()[0])
        print(f"  accepted: {reason}" if reason else "  NOT ACCEPTED: fix it or state why")
        if not reason:
            unexplained.append(check)
    if unexplained:
        sys.exit(f"{len(unexplained)} failing checks without a reason: {', '.join(unexplained)}")


if __name__ == "__main__":
    main()
