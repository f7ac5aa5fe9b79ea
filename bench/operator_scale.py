"""The operator at scale: job -> pods, node loss -> pods recreated, in-place restart, API cost.

Runs the real kopf operator (``omni_operator.handlers``) in-process against the kmock API
emulator (``omni_operator.sandbox.testbed``: the cluster the operator tests use, with
``job_manifest`` and ``gpu_node``), for jobs of N nodes x 8 GPUs (tensor 8, data parallel N):

* create: wall time from the POST of the job until all N pods of attempt 0 exist and the job's
  phase is Starting (until the trainer's first step);
* node lost: the pods are "run" (nodeName + phase Running through /status, like a kubelet), one
  node's Ready condition turns Unknown with a transition longer than ``nodeLostGraceSeconds``
  ago; wall time from that Node update until all N pods of attempt 1 exist (the Node watch
  event wakes the job's reconcile loop: no timer is waited for);
* crash in place: attempt 1's pods run, one trainer container exits 1 and the kubelet restarts
  it in its pod (``restartPolicy.mode: in-place``, the default); wall time from that pod status
  update until every one of the N pods carries the order to run attempt 2 (its supervisor
  starts the trainer on it) with no pod recreated.

API requests are those of the operator's own client (``handlers.kube.Kube``; kopf's watches,
finalizer/annotation patches and Events go through kopf's client and are not counted). A
reconcile is one run of ``handlers.engine.reconcile_job`` (create/resume, spec update, or the
job's loop woken by a pod/Node event, a deadline or the resync); each is attributed its own
requests through a context variable set around it (the bench wraps ``reconcile_job`` and
``Kube.request`` in this process only), so overlapping reconciles are not double counted.
"max" is the reconcile that did the work (creates/deletes/patches); "idle" is the median cost
of a reconcile that created and deleted nothing; "rec s" the slowest reconcile's wall time.
"steady" is 3 resync periods with all pods Running and nothing to do.

Absolute times are mostly the emulator's: kmock matches every stored object against each
request's criteria, so its cost grows with objects x requests (at 512 nodes most CPU time is
in ``kmock._internal.filtering``). The request counts are the operator's own.

    make bench-operator
    python bench/operator_scale.py --nodes 8 64 --resync 0.5
    python bench/operator_scale.py --smoke     # 4 nodes, resync 0.2 s: every phase in seconds
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextvars
import copy
import logging
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import kmock

import omni_operator.handlers.engine as engine
from omni_operator.handlers.kube import Kube
from omni_operator.reconcile import Progress
from omni_operator.render import ANNOTATION_NODE, LABEL_ATTEMPT, LABEL_JOB
from omni_operator.reports import ordered
from omni_operator.sandbox.emulator import Emulator
from omni_operator.sandbox.testbed import JOBS, NS, Cluster, job_manifest, running_cluster
from omni_operator.spec import parse_job

GPUS = 8
GRACE = 30
JOB = "scale"
PODS = kmock.resource("v1/pods")


# -- per-reconcile request accounting ------------------------------------------------------------
class Rec:
    def __init__(self, handler: str) -> None:
        self.handler = handler
        self.verbs: collections.Counter[str] = collections.Counter()
        self.seconds = 0.0

    @property
    def requests(self) -> int:
        return sum(self.verbs.values())


CURRENT: contextvars.ContextVar[Rec | None] = contextvars.ContextVar("reconcile", default=None)
RECONCILES: list[Rec] = []
IN_FLIGHT: set[Rec] = set()
UNATTRIBUTED = collections.Counter[str]()

_orig_reconcile = engine.reconcile_job
_orig_request = Kube.request


async def _counted_reconcile(st: Any, namespace: str, name: str, handler: str) -> Any:
    rec = Rec(handler)
    token = CURRENT.set(rec)
    IN_FLIGHT.add(rec)
    t0 = time.perf_counter()
    try:
        return await _orig_reconcile(st, namespace, name, handler)
    finally:
        rec.seconds = time.perf_counter() - t0
        CURRENT.reset(token)
        IN_FLIGHT.discard(rec)
        RECONCILES.append(rec)


async def _counted_request(self: Kube, method: str, path: str, **kw: Any) -> Any:
    rec = CURRENT.get()
    verb = method if method != "GET" else ("LIST" if _is_list(path) else "GET")
    (rec.verbs if rec is not None else UNATTRIBUTED)[verb] += 1
    return await _orig_request(self, method, path, **kw)


def _is_list(path: str) -> bool:
    parts = path.strip("/").split("/")
    # /api/v1/nodes, /api/v1/namespaces/ns/pods, /apis/g/v/namespaces/ns/plural
    base = 2 if parts[0] == "api" else 3
    rest = parts[base:]
    if rest[:1] == ["namespaces"]:
        rest = rest[2:]
    return len(rest) == 1


engine.reconcile_job = _counted_reconcile  # looked up on the module by every handler
Kube.request = _counted_request  # type: ignore[method-assign]


class CountingEmulator(Emulator):
    """Counts every request the API emulator serves (operator, kopf, and this bench)."""

    async def _handle(self, request: Any) -> Any:
        self.__dict__["hits"] = self.__dict__.get("hits", 0) + 1
        return await super()._handle(request)


# -- the cluster ---------------------------------------------------------------------------------
def layout(n: int) -> tuple[int, int, list[str]]:
    """(reorder group size, nodes per spine, spine of each node): N nodes in spines of at
    least one group, plus a spare spine of one group for the re-placement after a node loss
    (the lost node's spine is then one group short)."""
    group = 4 if n <= 8 else 8
    per_spine = max(group, n // 4)
    spines = [f"s{i // per_spine}" for i in range(n)]
    spines += [f"s{n // per_spine}"] * group
    return group, per_spine, spines


def manifest(n: int, group: int) -> dict[str, Any]:
    doc = job_manifest(JOB)
    spec = doc["spec"]
    spec.update(nodes=n, gpusPerNode=GPUS)
    spec["topology"]["reorderGroupSize"] = group
    spec["restartPolicy"]["nodeLostGraceSeconds"] = GRACE
    t = spec["trainer"]
    t["parallelism"] = {**(t.get("parallelism") or {}), "tensor": GPUS}
    t["model"]["llm"].update(numAttentionHeads=GPUS, numQueryGroups=GPUS)  # heads split by tensor
    for encoder in t["model"]["encoders"].values():
        encoder["numHeads"] = GPUS
    dp = n  # world n*8 / tensor 8
    t["data"].update(globalBatchSize=dp * 2, microBatchSize=1, loaderShards=dp)
    parse_job(copy.deepcopy(doc))  # the operator's own validation, layout checks included
    return doc


def live_pods(emu: Emulator, attempt: int) -> list[dict[str, Any]]:
    """Live pods of the job's attempt, read straight from the store (no copies)."""
    want = str(attempt)
    found = []
    for (res, _, _), obj in list(emu._objects.items()):
        if res != PODS or obj.deleted:
            continue
        labels = obj.raw["metadata"].get("labels") or {}
        if labels.get(LABEL_JOB) == JOB and labels.get(LABEL_ATTEMPT) == want:
            found.append(obj.raw)
    return found


def count_pods(emu: Emulator, attempt: int) -> int:
    return len(live_pods(emu, attempt))


def job_status(c: Cluster) -> dict[str, Any]:
    """The job's status straight from the store (no copies)."""
    key = (kmock.resource(JOBS), NS, JOB)
    if key not in c.emu._objects or c.emu._objects[key].deleted:
        return {}
    return c.emu._objects[key].raw.get("status") or {}


def phase(c: Cluster) -> str | None:
    return job_status(c).get("phase")


async def wait(what: str, pred: Callable[[], bool], timeout: float) -> float:
    t0 = time.perf_counter()
    while not pred():
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(0.01)
    return time.perf_counter()


def pods_running(c: Cluster) -> bool:
    conds = job_status(c).get("conditions") or []
    return any(x["type"] == "PodsRunning" and x["status"] == "True" for x in conds)


async def settle(timeout: float) -> int:
    """Let the reconciles in flight finish (the one that created the pods still writes the
    status and Events); the index of the next reconcile to be recorded."""
    await wait("reconciles in flight", lambda: not IN_FLIGHT, timeout)
    return len(RECONCILES)


def window(since: int, until: int | None = None) -> dict[str, Any]:
    recs = RECONCILES[since:until]
    reqs = [r.requests for r in recs]
    idle = [r.requests for r in recs if not (r.verbs["POST"] or r.verbs["DELETE"])]
    verbs: collections.Counter[str] = collections.Counter()
    for r in recs:
        verbs.update(r.verbs)
    return {
        "reconciles": len(recs),
        "requests": sum(reqs),
        "per": sum(reqs) / max(len(recs), 1),
        "max": max(reqs, default=0),
        "idle": statistics.median(idle) if idle else 0,
        "verbs": verbs,
        "slowest": max((r.seconds for r in recs), default=0.0),
    }


# -- the measured phases: each returns its seconds and its reconciles' window ------------------
async def create(c: Cluster, doc: dict[str, Any], n: int, timeout: float) -> dict[str, Any]:
    """The job's POST -> all N pods of attempt 0 and phase Starting."""
    t0 = time.perf_counter()
    await c.apply(doc)
    t1 = await wait(
        f"{n} pods of attempt 0 and phase Starting",
        lambda: count_pods(c.emu, 0) == n and phase(c) == "Starting",
        timeout,
    )
    return {"create_s": t1 - t0, "create": window(0, await settle(timeout))}


async def run_attempt(c: Cluster, attempt: int, timeout: float) -> None:
    """Every pod of the attempt bound and Running, 32 at a time (a crowd of kubelets), until
    the operator sees them all running."""
    await c.run_pods(JOB, attempt, at_once=32)
    await wait("PodsRunning", lambda: pods_running(c), timeout)


async def steady(c: Cluster, resync: float, timeout: float) -> dict[str, Any]:
    """3 resync periods with nothing to do: resync reconciles only."""
    quiet = await settle(timeout)
    t = time.perf_counter()
    await asyncio.sleep(3 * resync)
    w = window(quiet, await settle(timeout))
    return {"steady_s": time.perf_counter() - t, "steady": w}


async def node_lost(c: Cluster, n: int, timeout: float) -> dict[str, Any]:
    """A node went NotReady longer than the grace ago -> all N pods of attempt 1."""
    victim = c.pods(JOB, 0)[n // 2]["metadata"]["annotations"][ANNOTATION_NODE]
    mark = await settle(timeout)
    t0 = time.perf_counter()
    await c.node_not_ready(victim, seconds_ago=GRACE + 1)
    t1 = await wait(
        "restart decided", lambda: phase(c) == "Restarting" or count_pods(c.emu, 1) > 0, timeout
    )
    t2 = await wait(f"{n} pods of attempt 1", lambda: count_pods(c.emu, 1) == n, timeout)
    return {
        "detect_s": t1 - t0,
        "recover_s": t2 - t0,
        "recover": window(mark, await settle(timeout)),
    }


async def crash_in_place(c: Cluster, n: int, timeout: float) -> dict[str, Any]:
    """One trainer of attempt 1 crashed, its container restarted by the kubelet -> every pod
    ordered to run attempt 2, in the same pods."""
    crashed = c.pods(JOB, 1)[n // 2]["metadata"]["name"]
    mark = await settle(timeout)
    t0 = time.perf_counter()
    await c.crash_trainer(crashed)
    t1 = await wait(
        f"{n} pods ordered to run attempt 2",
        lambda: sum(ordered(p) == 2 for p in live_pods(c.emu, 1)) == n,
        timeout,
    )
    w = window(mark, await settle(timeout))
    (last, *_) = reversed(job_status(c)["restartHistory"])
    if last["mode"] != "in-place" or count_pods(c.emu, 2) or count_pods(c.emu, 1) != n:
        raise RuntimeError(f"the crash was not restarted in place: {last}")
    return {"inplace_s": t1 - t0, "inplace": w}


async def bench(n: int, *, resync: float, timeout: float) -> dict[str, Any]:
    group, _, spines = layout(n)
    doc = manifest(n, group)
    emu = CountingEmulator()
    async with running_cluster(spines, emulator=emu, resync_seconds=resync) as c:
        await asyncio.sleep(0.5)  # kopf starts its watches
        RECONCILES.clear()
        UNATTRIBUTED.clear()
        hits0 = emu.__dict__.get("hits", 0)
        r: dict[str, Any] = {"n": n, "spines": len(set(spines)), "cluster": len(spines)}
        r.update(group=group, **await create(c, doc, n, timeout))
        c.progress[JOB] = Progress(step=120, checkpoint_step=100, tokens_per_second=1e6)
        await run_attempt(c, 0, timeout)
        r.update(await steady(c, resync, timeout))
        r.update(await node_lost(c, n, timeout))
        await run_attempt(c, 1, timeout)
        r.update(await crash_in_place(c, n, timeout))
        r.update(emu_hits=emu.__dict__.get("hits", 0) - hits0)
        r.update(unattributed=sum(UNATTRIBUTED.values()))
        return r


def verbs(c: collections.Counter[str]) -> str:
    return " ".join(f"{k}:{c[k]}" for k in ("GET", "LIST", "POST", "PATCH", "DELETE") if c[k])


PHASES = (("create", "create_s", "create"), ("steady", "steady_s", "steady"),
          ("node-lost", "recover_s", "recover"), ("crash", "inplace_s", "inplace"))  # fmt: skip
"""(label, seconds key, window key) of each measured phase, in the order they run."""


def report(rows: Sequence[dict[str, Any]], resync: float) -> None:
    print(
        f"\nOperator scale (kmock emulator, in-process kopf operator, resync {resync:g} s, "
        f"{GPUS} GPUs/node, tensor {GPUS})"
    )
    hdr = (
        f"{'nodes':>5} {'cluster':>7} {'phase':<9} {'wall s':>7} {'reconciles':>10} "
        f"{'requests':>8} {'req/rec':>7} {'max':>4} {'idle':>4} {'rec s':>5}  by verb"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        for label, secs, key in PHASES:
            w = r[key]
            print(
                f"{r['n']:>5} {r['cluster']:>7} {label:<9} {r[secs]:>7.2f} {w['reconciles']:>10} "
                f"{w['requests']:>8} {w['per']:>7.1f} {w['max']:>4} {w['idle']:>4g} "
                f"{w['slowest']:>5.2f}  {verbs(w['verbs'])}"
            )
    print()
    for r in rows:
        print(
            f"N={r['n']}: {r['spines']} spines, reorder groups of {r['group']}; node-lost time "
            f"includes {r['detect_s']:.2f} s until the restart was decided (Node event); "
            f"crash: one trainer exited 1, all {r['n']} pods ordered to restart in place; "
            f"{r['emu_hits']} requests reached the emulator in all (kopf, kubelets, bench); "
            f"run {r['wall']:.0f} s"
        )
    if any(r["unattributed"] for r in rows):
        print("operator requests outside a reconcile:", [r["unattributed"] for r in rows])


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[8, 64, 512])
    p.add_argument(
        "--resync",
        type=float,
        default=1.0,
        help="the operator's resync period (OMNI_RESYNC_SECONDS; production default 10)",
    )
    p.add_argument("--timeout", type=float, default=240, help="seconds per wait")
    p.add_argument("--smoke", action="store_true", help="4 nodes, resync 0.2 s, waits of 30 s")
    args = p.parse_args(argv)
    if args.smoke:
        args.nodes, args.resync, args.timeout = [4], 0.2, 30.0
    logging.getLogger("kopf").setLevel(logging.ERROR)
    logging.getLogger("aiohttp").setLevel(logging.ERROR)
    rows = []
    for n in args.nodes:
        t = time.perf_counter()
        r = asyncio.run(bench(n, resync=args.resync, timeout=args.timeout))
        r["wall"] = time.perf_counter() - t
        rows.append(r)
        print(f"  N={n}: done in {r['wall']:.1f} s", file=sys.stderr, flush=True)
    report(rows, args.resync)


if __name__ == "__main__":
    main()
