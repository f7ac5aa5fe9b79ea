"""A shared cluster under load: jobs of 1-8 nodes arrive over time on a 32-node GPU cluster.

The operator's own admission code decides (``omni_operator.admission.admit`` on free capacity,
``queue_ahead`` for the queue order, ``render.render_all`` for the pods whose requests hold the
nodes), on a simulated clock: no trainer runs, each job holds its nodes for a drawn duration.
After every decision the nodes are checked: none may be overcommitted (any resource), and every
job must finish. Reported per policy: queue wait (mean, median, p95, max), makespan and cluster
GPU utilisation (GPU-seconds used over GPU-seconds available until the last job ends).

Policies: ``fifo`` is the operator's (first come first served within a priority, no
overtaking); ``backfill`` lets any job that fits start at once (no ``queue_ahead``), which fills
gaps but can starve large jobs; ``scheduler`` is ``fifo`` admission with
``scheduling.placement: scheduler``: the pods name no node and an emulated scheduler binds them
(the sandbox's kube-scheduler filters, :mod:`omni_operator.sandbox.scheduling`: first fit by
node name on free capacity, honouring the pods' affinity; a job's pods bind all or none, as a
gang scheduler admits them). A job whose pods do not all bind waits, holding nothing, and is
tried again at every later event (the start timeout is not simulated).

    python bench/shared_cluster.py --jobs 48 --nodes 32 --seed 0
"""

from __future__ import annotations

import argparse
import datetime as dt
import heapq
import json
import random
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from omni_operator import capacity
from omni_operator.admission import admit, queue_ahead
from omni_operator.render import render_all
from omni_operator.sandbox.cluster import SPINE, ZONE, node_object
from omni_operator.sandbox.scheduling import first_fit
from omni_operator.spec import OmniTrainingJob, parse_job

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
GPUS = 8
EPOCH = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


@dataclass
class SimJob:
    name: str
    nodes: int
    arrival: float
    duration: float
    priority: str | None
    job: OmniTrainingJob
    scheduled: OmniTrainingJob
    """The same job with ``scheduling.placement: scheduler``."""
    start: float | None = None
    pods: list[dict[str, Any]] = field(default_factory=list)

    def raw(self, phase: str) -> dict[str, Any]:
        """The job as the API lists it (what ``queue_ahead`` reads)."""
        created = (EPOCH + dt.timedelta(seconds=self.arrival)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        sched = {"priorityClassName": self.priority} if self.priority else {}
        return {"metadata": {"name": self.name, "namespace": "bench", "creationTimestamp": created},
                "spec": {"scheduling": sched}, "status": {"phase": phase}}  # fmt: skip


def manifest(
    name: str, nodes: int, priority: str | None, placement: str = "operator"
) -> OmniTrainingJob:
    doc = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    doc["metadata"] = {"name": name, "namespace": "bench", "uid": name}
    world = nodes * GPUS
    doc["spec"].update(nodes=nodes, gpusPerNode=GPUS,
                       topology={"networkDomainLabels": [ZONE, SPINE]})  # fmt: skip
    doc["spec"]["scheduling"] = {"placement": placement}
    if priority:
        doc["spec"]["scheduling"]["priorityClassName"] = priority
    doc["spec"]["trainer"]["data"].update(globalBatchSize=world, microBatchSize=1,
                                          loaderShards=world)  # fmt: skip
    return parse_job(doc)


def workload(n_jobs: int, seed: int) -> list[SimJob]:
    """Jobs of 1, 2, 4 or 8 nodes (more small ones), arriving every 0-10 min, running 20-120
    min; one in eight at a higher priority."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n_jobs):
        t += rng.uniform(0, 600)
        nodes = rng.choices([1, 2, 4, 8], weights=[4, 3, 2, 1])[0]
        prio = "high" if rng.random() < 0.125 else None
        name = f"job-{i:02d}"
        out.append(SimJob(name, nodes, t, rng.uniform(1200, 7200), prio,
                          manifest(name, nodes, prio),
                          manifest(name, nodes, prio, "scheduler")))  # fmt: skip
    return out


def cluster(n_nodes: int) -> list[dict[str, Any]]:
    """``n_nodes`` nodes of 8 GPUs and 96 CPUs in 4 spines."""
    per = max(n_nodes // 4, 1)
    return [node_object(f"node-{i}", gpus=GPUS, spine=f"spine-{i // per}", cpu=96)
            for i in range(n_nodes)]  # fmt: skip


def bind(pods: list[dict[str, Any]], nodes: list[dict[str, Any]],
         cluster_pods: list[dict[str, Any]]) -> list[dict[str, Any]] | None:  # fmt: skip
    """The emulated scheduler: each pod in turn on the first node that admits it beside the
    pods bound so far; all of them bound, or None (a gang binds whole)."""
    bound: list[dict[str, Any]] = []
    for pod in pods:
        node = first_fit(pod, nodes, cluster_pods + bound, EPOCH)
        if node is None:
            return None
        bound.append({**pod, "spec": {**pod["spec"], "nodeName": node}})
    return bound


def simulate(jobs: list[SimJob], nodes: list[dict[str, Any]], policy: str) -> dict[str, Any]:
    classes = [{"metadata": {"name": "high"}, "value": 1000}]
    events: list[tuple[float, int, str, str]] = [(j.arrival, 0, "arrive", j.name) for j in jobs]
    heapq.heapify(events)
    by_name = {j.name: j for j in jobs}
    queued: list[SimJob] = []
    unbound: list[SimJob] = []
    """Admitted, their pods created, not all bound by the scheduler yet."""
    running: dict[str, SimJob] = {}
    busy_gpu_s, now, seq = 0.0, 0.0, 1

    def run(job: SimJob) -> None:
        nonlocal seq
        held = [p for r in running.values() for p in r.pods] + job.pods
        over = {n: {k: v for k, v in r.items() if v < -1e-9}
                for n, r in capacity.free(nodes, held).items()}  # fmt: skip
        assert not any(over.values()), f"overcommitted: {over}"
        job.start = now
        running[job.name] = job
        heapq.heappush(events, (now + job.duration, seq, "end", job.name))
        seq += 1

    while events:
        now, _, kind, name = heapq.heappop(events)
        job = by_name[name]
        if kind == "arrive":
            queued.append(job)
        else:
            del running[name]
            busy_gpu_s += job.nodes * GPUS * job.duration
        pods = [p for r in running.values() for p in r.pods]
        for u in list(unbound):  # the scheduler tries the pending pods again
            bound = bind(u.pods, nodes, pods)
            if bound is not None:
                u.pods = bound
                pods += bound
                unbound.remove(u)
                run(u)
        raws = [q.raw("Queued") for q in queued]
        for q in sorted(queued, key=lambda q: (q.priority is None, q.arrival)):
            ahead = queue_ahead(q.raw("Queued"), raws, classes) if policy != "backfill" else []
            ahead = [k for k in ahead if k[1] in {x.name for x in queued}]
            d = admit(nodes, q.job, cluster_pods=pods, ahead=ahead)
            if d.placement is None:
                assert d.queued, d.message  # every job fits the empty cluster
                continue
            spec = q.scheduled if policy == "scheduler" else q.job
            q.pods = [p for p in render_all(spec, d.placement) if p["kind"] == "Pod"]
            queued.remove(q)
            raws = [x.raw("Queued") for x in queued]
            if policy == "scheduler":
                bound = bind(q.pods, nodes, pods)
                if bound is None:
                    unbound.append(q)
                    continue
                q.pods = bound
            pods += q.pods
            run(q)
    assert not queued and not unbound and not running
    assert all(j.start is not None for j in jobs)
    waits = [j.start - j.arrival for j in jobs if j.start is not None]
    makespan = max(j.start + j.duration for j in jobs if j.start is not None) - jobs[0].arrival
    big = [j.start - j.arrival for j in jobs if j.start is not None and j.nodes == 8]
    return {
        "policy": policy,
        "jobs": len(jobs),
        "wait_mean_min": statistics.mean(waits) / 60,
        "wait_p50_min": statistics.median(waits) / 60,
        "wait_p95_min": sorted(waits)[int(0.95 * (len(waits) - 1))] / 60,
        "wait_max_min": max(waits) / 60,
        "wait_8node_mean_min": statistics.mean(big) / 60 if big else 0.0,
        "makespan_h": makespan / 3600,
        "gpu_utilisation": busy_gpu_s / (len(nodes) * GPUS * makespan),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=48)
    parser.add_argument("--nodes", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="8 jobs: the whole path")
    args = parser.parse_args()
    if args.smoke:
        args.jobs = 8
    jobs = workload(args.jobs, args.seed)
    sizes = {n: sum(j.nodes == n for j in jobs) for n in (1, 2, 4, 8)}
    high = sum(j.priority is not None for j in jobs)
    print(f"{args.jobs} jobs on {args.nodes} nodes x {GPUS} GPUs, sizes {sizes}, "
          f"{high} at high priority, seed {args.seed}")  # fmt: skip
    rows = []
    for policy in ("fifo", "backfill", "scheduler"):
        for j in jobs:
            j.start, j.pods = None, []
        rows.append(simulate(jobs, cluster(args.nodes), policy))
    head = ("policy", "wait mean", "p50", "p95", "max", "8-node mean", "makespan h", "GPU util")
    print(" | ".join(head))
    for r in rows:
        print(f"{r['policy']} | {r['wait_mean_min']:.1f} min | {r['wait_p50_min']:.1f} | "
              f"{r['wait_p95_min']:.1f} | {r['wait_max_min']:.1f} | "
              f"{r['wait_8node_mean_min']:.1f} | {r['makespan_h']:.2f} | "
              f"{r['gpu_utilisation']:.1%}")  # fmt: skip
    print("no node overcommitted; every job completed")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
