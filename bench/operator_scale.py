"""The operator at scale: job creation -> all pods, node loss -> all pods recreated, API cost.

Runs the real kopf operator (``omni_operator.handlers``) in-process against the kmock API
emulator of ``tests/operator`` (imported from there: ``Emulator``, ``Cluster``, ``Clock``,
``job_manifest``, ``gpu_node``), for jobs of N nodes x 8 GPUs (tensor 8, data parallel N):

* create: wall time from the POST of the job until all N pods of attempt 0 exist and the job's
  phase is Running;
* node lost: the pods are "run" (nodeName + phase Running through /status, like a kubelet), one
  node's Ready condition turns Unknown with a transition longer than ``nodeLostGraceSeconds``
  ago; wall time from that Node update until all N pods of attempt 1 exist (the Node watch
  event wakes the job's reconcile loop: no timer is waited for).

API requests are those of the operator's own client (``handlers.kube.Kube``; kopf's watches,
finalizer/annotation patches and Events go through kopf's client and are not counted). A
reconcile is one run of ``handlers._reconcile`` (create/resume, spec update, or the job's loop
woken by a pod/Node event, a deadline or the resync); each is attributed its own requests
through a context variable set around it (the bench wraps ``_reconcile`` and ``Kube.request``
in this process only), so overlapping reconciles are not double counted. "max" is the reconcile
that did the work (creates/deletes); "idle" is the median cost of a reconcile that created and
deleted nothing; "rec s" the slowest reconcile's wall time. "steady" is 3 resync periods with
all pods Running and nothing to do.

Absolute times are mostly the emulator's: kmock matches every stored object against each
request's criteria, so its cost grows with objects x requests (at 512 nodes most CPU time is
in ``kmock._internal.filtering``). The request counts are the operator's own.

    make bench-operator
    python bench/operator_scale.py --nodes 8 64 --resync 0.5
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextvars
import copy
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[8, 64, 512])
    p.add_argument(
        "--resync",
        type=float,
        default=1.0,
        help="the operator's resync period (OMNI_RESYNC_SECONDS; production default 10)",
    )
    p.add_argument("--timeout", type=float, default=240, help="seconds per wait")
    return p.parse_args()


ARGS = _args() if __name__ == "__main__" else None
# Read when the handlers are imported (tests/operator/conftest.py imports them).
os.environ["OMNI_RESYNC_SECONDS"] = str(ARGS.resync if ARGS else 1.0)
sys.path.insert(0, str(REPO))

import aiohttp  # noqa: E402
import kmock  # noqa: E402

import omni_operator.handlers as handlers  # noqa: E402
from omni_operator.crd import crd  # noqa: E402
from omni_operator.handlers.kube import Kube  # noqa: E402
from omni_operator.reconcile import Progress  # noqa: E402
from omni_operator.render import ANNOTATION_NODE, LABEL_ATTEMPT, LABEL_JOB  # noqa: E402
from omni_operator.sandbox.emulator import Emulator  # noqa: E402
from omni_operator.spec import parse_job  # noqa: E402
from tests.operator.conftest import JOBS, NS, Cluster, gpu_node, job_manifest  # noqa: E402

GPUS = 8
ARGS_RESYNC = float(os.environ["OMNI_RESYNC_SECONDS"])
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

_orig_reconcile = handlers._reconcile
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


handlers._reconcile = _counted_reconcile  # looked up as a module global by every handler
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
    dp = n  # world n*8 / tensor 8
    t["data"].update(globalBatchSize=dp * 2, microBatchSize=1, loaderShards=dp)
    parse_job(copy.deepcopy(doc))  # the operator's own validation, layout checks included
    return doc


def count_pods(emu: Emulator, attempt: int) -> int:
    """Live pods of the job's attempt, read straight from the store (no copies)."""
    want = str(attempt)
    n = 0
    for (res, _, _), obj in list(emu._objects.items()):
        if res != PODS or obj.deleted:
            continue
        labels = obj.raw["metadata"].get("labels") or {}
        n += labels.get(LABEL_JOB) == JOB and labels.get(LABEL_ATTEMPT) == want
    return n


def job_status(c: Cluster) -> dict[str, Any]:
    """The job's status straight from the store (no copies)."""
    key = (kmock.resource(JOBS), NS, JOB)
    if key not in c.emu._objects or c.emu._objects[key].deleted:
        return {}
    return c.emu._objects[key].raw.get("status") or {}


def phase(c: Cluster) -> str | None:
    return job_status(c).get("phase")


async def wait(what: str, pred: Any, timeout: float) -> float:
    t0 = time.perf_counter()
    while not pred():
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(0.01)
    return time.perf_counter()


async def run_pods(c: Cluster, attempt: int) -> None:
    """Bind and start every pod of the attempt, 32 at a time (a crowd of kubelets)."""
    limit = asyncio.Semaphore(32)

    async def one(pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        node = pod["metadata"]["annotations"][ANNOTATION_NODE]
        async with limit:
            await c.call(
                "PATCH", f"/api/v1/namespaces/{NS}/pods/{name}", {"spec": {"nodeName": node}}
            )
            await c.set_pod(name, {"phase": "Running"})

    await asyncio.gather(*(one(p) for p in c.pods(JOB, attempt)))


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


async def bench(n: int, timeout: float) -> dict[str, Any]:
    group, _, spines = layout(n)
    doc = manifest(n, group)
    async with CountingEmulator() as emu, kmock.Server(emu) as server:
        emu.declare(JOBS, kind="OmniTrainingJob", namespaced=True, status=True)
        url = str(server.url).rstrip("/")
        async with aiohttp.ClientSession() as session:
            c = Cluster(emu, url, session)
            ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}
            await c.call("POST", "/api/v1/namespaces", ns)
            await c.call(
                "POST",
                "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
                copy.deepcopy(crd()),
            )
            for i, spine in enumerate(spines):
                await c.call("POST", "/api/v1/nodes", gpu_node(f"n{i}", spine, clock=c.clock))
            await c.start_operator()
            try:
                await asyncio.sleep(0.5)  # kopf starts its watches
                RECONCILES.clear()
                UNATTRIBUTED.clear()
                hits0 = emu.__dict__.get("hits", 0)

                # 1. create -> all pods, phase Running
                t0 = time.perf_counter()
                await c.apply(doc)
                t1 = await wait(
                    f"{n} pods of attempt 0 and phase Running",
                    lambda: count_pods(emu, 0) == n and phase(c) == "Running",
                    timeout,
                )
                create_s = t1 - t0
                create = window(0, await settle(timeout))

                # 2. the pods run and report progress; the operator sees them running
                c.progress[JOB] = Progress(step=120, checkpoint_step=100, tokens_per_second=1e6)
                await run_pods(c, 0)
                await wait("PodsRunning", lambda: pods_running(c), timeout)
                quiet = await settle(timeout)
                t = time.perf_counter()
                await asyncio.sleep(3 * ARGS_RESYNC)  # steady state: resync reconciles only
                steady = window(quiet, await settle(timeout))
                steady_s = time.perf_counter() - t

                # 3. a node is lost: it went NotReady longer than the grace ago (the Node
                #    watch event wakes the job's reconcile loop; no timer involved)
                victim = c.pods(JOB, 0)[n // 2]["metadata"]["annotations"][ANNOTATION_NODE]
                mark = len(RECONCILES)
                t2 = time.perf_counter()
                await c.node_not_ready(victim, seconds_ago=GRACE + 1)
                t3 = await wait(
                    "restart decided",
                    lambda: phase(c) == "Restarting" or count_pods(emu, 1) > 0,
                    timeout,
                )
                t4 = await wait(f"{n} pods of attempt 1", lambda: count_pods(emu, 1) == n, timeout)
                recover = window(mark, await settle(timeout))
                hits = emu.__dict__.get("hits", 0) - hits0
                return {
                    "n": n,
                    "spines": len(set(spines)),
                    "cluster": len(spines),
                    "group": group,
                    "create_s": create_s,
                    "create": create,
                    "steady_s": steady_s,
                    "steady": steady,
                    "detect_s": t3 - t2,
                    "recover_s": t4 - t2,
                    "recover": recover,
                    "emu_hits": hits,
                    "unattributed": sum(UNATTRIBUTED.values()),
                }
            finally:
                await c.stop_operator()


def verbs(c: collections.Counter[str]) -> str:
    return " ".join(f"{k}:{c[k]}" for k in ("GET", "LIST", "POST", "PATCH", "DELETE") if c[k])


def main() -> None:
    assert ARGS is not None
    logging.getLogger("kopf").setLevel(logging.ERROR)
    logging.getLogger("aiohttp").setLevel(logging.ERROR)
    rows = []
    for n in ARGS.nodes:
        t = time.perf_counter()
        r = asyncio.run(bench(n, ARGS.timeout))
        r["wall"] = time.perf_counter() - t
        rows.append(r)
        print(f"  N={n}: done in {r['wall']:.1f} s", file=sys.stderr, flush=True)

    print(
        f"\nOperator scale (kmock emulator, in-process kopf operator, resync {ARGS.resync:g} s, "
        f"{GPUS} GPUs/node, tensor {GPUS})"
    )
    hdr = (
        f"{'nodes':>5} {'cluster':>7} {'phase':<9} {'wall s':>7} {'reconciles':>10} "
        f"{'requests':>8} {'req/rec':>7} {'max':>4} {'idle':>4} {'rec s':>5}  by verb"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        for label, secs, w in (
            ("create", r["create_s"], r["create"]),
            ("steady", r["steady_s"], r["steady"]),
            ("node-lost", r["recover_s"], r["recover"]),
        ):
            print(
                f"{r['n']:>5} {r['cluster']:>7} {label:<9} {secs:>7.2f} {w['reconciles']:>10} "
                f"{w['requests']:>8} {w['per']:>7.1f} {w['max']:>4} {w['idle']:>4g} "
                f"{w['slowest']:>5.2f}  "
                f"{verbs(w['verbs'])}"
            )
    print()
    for r in rows:
        print(
            f"N={r['n']}: {r['spines']} spines, reorder groups of {r['group']}; node-lost time "
            f"includes {r['detect_s']:.2f} s until the restart was decided (Node event); "
            f"{r['emu_hits']} requests reached the emulator in all (kopf, kubelets, bench); "
            f"run {r['wall']:.0f} s"
        )
    if any(r["unattributed"] for r in rows):
        print("operator requests outside a reconcile:", [r["unattributed"] for r in rows])


if __name__ == "__main__":
    main()
