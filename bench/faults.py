"""What each fault costs the tiny job in the sandbox, restarted in place vs recreated.

A fresh ``omni sandbox up`` per ``restartPolicy.mode`` (4 CPU nodes: the real kopf operator, the
kubelet simulator running the pods as processes, real torchrun trainers) runs the tiny job (2
nodes x 1 process, a checkpoint every ``--interval`` steps) (``in-place``, then ``recreate``).
Each fault is injected once the job trains again after the previous one, a few steps past a
checkpoint, so every fault has steps to recompute:

* crash: ``crash-pod`` on node rank 1 (its newest process, a trainer worker, dies: torchrun
  stops the rest, its peers fail on broken collectives);
* container killed: ``kill-pod`` on node rank 0 (every process of its container);
* hang: ``hang-pod`` on node rank 1 (the trainer stops; found after ``hangTimeoutSeconds``, 60);
* SIGTERM: the pod of node rank 1 deleted with its grace period (an emergency checkpoint);
* node lost: ``node-lost`` on node rank 1's node (``nodeLostGraceSeconds`` 5);
* image missing on restart: ``spec.image`` changed to an image the registry lacks, then a
  crash: a restart that keeps the pods pulls nothing; one that recreates them cannot pull;
* suspend: ``spec.suspend`` set (the pods deleted with their grace), then unset (a new attempt);
* straggler: ``throttle-pod`` on node rank 1 (its trainer stopped half of the time) with
  ``restartPolicy.stragglers.action: replace``: found, then replaced after the next checkpoint.
* storage outage: the job checkpoints to S3 (a moto server, credentials from a Secret) through a
  proxy (``bench/storage_outage.py``) that goes down for ``--outage-seconds`` a few steps before
  a checkpoint upload, resetting its connections and refusing new ones. No restart is expected:
  the cost is the wall time without progress from the outage's start until a checkpoint
  commits again (the time less the steps gained at the median step time: stalls, and a restart
  if a stall outlasts ``hangTimeoutSeconds``), with steps trained twice.

A mode ending in ``+fast`` adds the fast checkpoint tier (``checkpoint.fast`` every
``--fast-interval`` steps on each node's disk, each share copied to the peer node): with
``--faults node-lost --interval 20 --past 12`` the node is lost 12+ steps past a persistent
checkpoint, and the table shows what the fast tier saves (the restart resumes from the fast
step the lost node's peer still holds) and the mean step time shows what it costs.

A mode ending in ``+spare`` keeps one hot spare (``spec.spareNodes: 1``; each fault waits for it
to be ready): with ``--modes in-place+spare in-place --faults node-lost`` the table puts a node
loss continued on the spare beside the same loss recreating the pods. The sandbox pulls images
instantly unless ``--pull-seconds S`` says how long a node takes to pull an image it lacks (an
assumption, printed with the table): a pod recreated on a fresh node pays it, a spare pulled
while the job trained does not.

The kubelets' crash back-off is scaled down (1 s first, the sandbox's default) unless
``--crash-backoff-seconds 10`` makes it a real kubelet's (10 s, doubling to 5 min, reset after 10
min without a crash): with ``--faults crash crash crash crash`` the table shows what repeated
crashes cost a restart that restarts containers (in place) beside one that creates new pods.

Per fault: detection (injection to the operator's restart decision, polled every 0.2 s), first
step (injection to the first step the new attempt logged), steps recomputed (the last step
before the fault minus the step resumed from), and training time lost (first step plus the
recomputed steps at the median step time: the time until training is where it was).

``--suite`` is the fault suite: one in-place job of ``--steps`` steps takes :data:`SUITE` (21
faults of 8 kinds, one after another), trains to the end, and is compared with the same job run
uninterrupted: every step's sample fingerprint and loss must be equal (no sample lost, none
trained twice), recomputed steps included.

    make bench-faults
    make fault-suite
    python bench/faults.py --modes in-place --faults crash kill
    python bench/faults.py --modes recreate recreate+fast --faults node-lost --interval 20 --past 12
    python bench/faults.py --modes in-place+spare in-place --faults node-lost
    python bench/faults.py --modes in-place+spare in-place --faults node-lost --pull-seconds 60
    python bench/faults.py --faults crash crash crash crash --crash-backoff-seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
LABEL_ATTEMPT, LABEL_RANK = "omni.megascale.io/attempt", "omni.megascale.io/node-rank"
FAULTS = ("crash", "kill", "hang", "sigterm", "node-lost", "image-missing", "storage-outage",
          "suspend", "straggler")  # fmt: skip
SUITE = (
    *("crash", "kill", "sigterm", "node-lost", "suspend") * 3,
    "hang", "straggler", "crash", "kill", "hang", "image-missing",
)  # fmt: skip
"""The suite's faults in order: a lost node and the straggler's stay quarantined (four of the
sandbox's eight nodes), and a missing image is a fault only at a restart that pulls, so it comes
last."""
JOB = "tiny-cpu"
NS = "default"
MISSING_IMAGE = "ghcr.io/megascale-omni/trainer:0.0.0-missing"


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", nargs="+", default=["in-place", "recreate"])
    p.add_argument("--faults", nargs="+", default=list(FAULTS[:7]), choices=FAULTS)
    p.add_argument(
        "--suite", action="store_true", help="the fault suite (--modes, --faults unused)"
    )
    p.add_argument("--steps", type=int, default=1200, help="the suite job's steps")
    p.add_argument("--interval", type=int, default=5, help="checkpoint every this many steps")
    p.add_argument("--past", type=int, default=2, help="inject this many steps past a checkpoint")
    p.add_argument("--fast-interval", type=int, default=2, help="the fast tier's interval")
    p.add_argument("--timeout", type=float, default=400, help="seconds per wait")
    p.add_argument(
        "--pull-seconds",
        type=float,
        default=0.0,
        help="an assumed image pull time of a node that lacks the image (sandbox up "
        "--pull-seconds): recreating on a fresh node pays it, an in-place restart or a spare "
        "(pulled while the job trains) does not; 0: pulls are not modelled",
    )
    p.add_argument(
        "--crash-backoff-seconds",
        type=float,
        default=1.0,
        help="the kubelets' first CrashLoopBackOff delay (sandbox up --crash-backoff-seconds; "
        "doubling to 30x): a real kubelet's is 10, the sandbox's default 1",
    )
    p.add_argument("--outage-seconds", type=float, default=20.0,
                   help="how long the storage-outage fault keeps S3 down")  # fmt: skip
    p.add_argument("--dir", type=Path, help="keep the sandbox, logs and checkpoints here")
    p.add_argument("--smoke", action="store_true",
                   help="by default in-place, one crash 1 step past a checkpoint every 2; exit "
                   "1 unless every fault was measured")  # fmt: skip
    args = p.parse_args()
    if args.smoke:  # the smoke run's defaults; options given still apply
        p.set_defaults(modes=["in-place"], faults=["crash"], interval=2, past=1, timeout=300.0)
        args = p.parse_args()
    return args


@dataclass
class Cost:
    fault: str
    mode: str
    detection_s: float | None = None
    first_step_s: float | None = None
    recomputed: int | None = None
    lost_s: float | None = None
    note: str = ""


class Sandbox:
    """``omni sandbox up`` in a directory of its own, driven over its HTTP API."""

    def __init__(
        self, cwd: Path, *, nodes: int = 4, pull_s: float = 0.0, backoff_s: float = 1.0
    ) -> None:
        self.cwd = cwd
        argv = [sys.executable, "-m", "omni_trainer.cli", "sandbox", "up", "--nodes", str(nodes),
                "--gpus-per-node", "0", "--resync", "1", "--dir", ".sandbox",
                "--pull-seconds", str(pull_s),
                "--crash-backoff-seconds", str(backoff_s)]  # fmt: skip
        self.log = (cwd / "sandbox.log").open("w")
        self.proc = subprocess.Popen(argv, cwd=cwd, stdout=self.log, stderr=subprocess.STDOUT)
        state = cwd / ".sandbox" / "sandbox.json"
        self.wait("the sandbox", state.exists, timeout=120)
        self.url = json.loads(state.read_text())["server"]

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def request(self, method: str, path: str, body: Any = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        kind = "application/merge-patch+json" if method == "PATCH" else "application/json"
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": kind})  # fmt: skip
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read() or b"null")

    def job_path(self) -> str:
        return f"/apis/omni.megascale.io/v1alpha1/namespaces/{NS}/omnitrainingjobs/{JOB}"

    def status(self) -> dict[str, Any]:
        try:
            return self.request("GET", self.job_path()).get("status") or {}
        except OSError:
            return {}

    def pods(self) -> list[dict[str, Any]]:
        return self.request("GET", f"/api/v1/namespaces/{NS}/pods")["items"]

    def pod_of_rank(self, rank: int) -> dict[str, Any]:
        st = self.status()
        attempt = st["attempt"] if st.get("podAttempt") is None else st["podAttempt"]
        for pod in self.pods():
            labels = pod["metadata"].get("labels") or {}
            key = (labels.get(LABEL_ATTEMPT), labels.get(LABEL_RANK))
            mine = key == (str(attempt), str(rank))
            if mine and not pod["metadata"].get("deletionTimestamp"):
                return pod
        raise RuntimeError(f"no pod of node rank {rank} in attempt {attempt}")

    def fault(self, fault: str, target: str) -> None:
        from omni_operator.sandbox.cluster import inject_fault

        asyncio.run(inject_fault(self.url, fault, target, namespace=NS))

    def wait(self, what: str, check: Callable[[], Any], *, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = check()
            if value:
                return value
            time.sleep(0.2)
        raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def _job(
    mode: str,
    *,
    interval: int,
    fast_interval: int,
    step_log: str,
    faults: Sequence[str],
    steps: int = 100000,
) -> dict[str, Any]:
    """The measured job; stragglers are replaced only where the straggler fault is injected
    (elsewhere a false positive on a loaded machine would move the job mid-measurement)."""
    doc = yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())
    spec = doc["spec"]
    spec["nodes"] = 2
    restart_mode, _, tier = mode.partition("+")
    action = "replace" if "straggler" in faults else "report"
    spec["restartPolicy"] = {"mode": restart_mode, "nodeLostGraceSeconds": 5,
                             "hangTimeoutSeconds": 60, "backoffSeconds": {"base": 0, "max": 0},
                             "budget": 40, "stopGraceSeconds": 20,
                             "stragglers": {"action": action, "persistSteps": 20}}  # fmt: skip
    trainer = spec["trainer"]
    trainer["train"].update(steps=steps, stepLog=step_log)
    trainer["checkpoint"] = {"path": f"runs/{mode}/ckpt", "intervalSteps": interval}
    if tier == "fast":
        fast = {"path": "/var/lib/omni-fast", "intervalSteps": fast_interval}
        trainer["checkpoint"]["fast"] = fast
    if tier == "spare":
        spec["spareNodes"] = 1
    return doc


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):  # a line being written
            out.append(json.loads(line))
    return out


def _inject(sb: Sandbox, fault: str) -> Callable[[], None]:
    """The action that injects ``fault`` (resolved now, timed by the caller)."""
    if fault in ("crash", "image-missing"):
        pod = sb.pod_of_rank(1)["metadata"]["name"]
        return lambda: sb.fault("crash-pod", pod)
    if fault == "kill":
        pod = sb.pod_of_rank(0)["metadata"]["name"]
        return lambda: sb.fault("kill-pod", pod)
    if fault == "hang":
        pod = sb.pod_of_rank(1)["metadata"]["name"]
        return lambda: sb.fault("hang-pod", pod)
    if fault == "sigterm":
        pod = sb.pod_of_rank(1)["metadata"]["name"]
        return lambda: sb.request("DELETE", f"/api/v1/namespaces/{NS}/pods/{pod}")
    if fault == "straggler":
        pod = sb.pod_of_rank(1)["metadata"]["name"]
        return lambda: sb.fault("throttle-pod", pod)
    if fault == "suspend":
        return lambda: _suspend_and_resume(sb)
    node = sb.pod_of_rank(1)["spec"]["nodeName"]
    return lambda: sb.fault("node-lost", node)


def _suspend_and_resume(sb: Sandbox) -> None:
    sb.request("PATCH", sb.job_path(), {"spec": {"suspend": True}})
    sb.wait("the job suspended", lambda: sb.status().get("phase") == "Suspended", timeout=120)
    sb.request("PATCH", sb.job_path(), {"spec": {"suspend": False}})


def _on_s3(sb: Sandbox, doc: dict[str, Any], s3: Any, mode: str) -> None:
    """The job's checkpoints on ``s3`` (a :class:`storage_outage.FlakyS3`), its credentials in
    a Secret the pods take as their environment."""
    import boto3

    creds = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
             "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": s3.endpoint}  # fmt: skip
    boto3.client("s3", endpoint_url=s3.endpoint, region_name="us-east-1",
                 aws_access_key_id="bench", aws_secret_access_key="bench",
                 ).create_bucket(Bucket="omni-bench")  # fmt: skip
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s3", "namespace": NS},
              "stringData": creds}  # fmt: skip
    sb.request("POST", f"/api/v1/namespaces/{NS}/secrets", secret)
    doc["spec"]["envFrom"] = [{"secretRef": {"name": "s3"}}]
    doc["spec"]["trainer"]["checkpoint"]["path"] = f"s3://omni-bench/{mode}/ckpt"


def run_mode(sb: Sandbox, mode: str, faults: list[str], args: argparse.Namespace) -> list[Cost]:
    """The job in ``mode``, each fault in turn; stops at a fault that fails the job."""
    with contextlib.ExitStack() as stack:
        s3 = None
        if "storage-outage" in faults:
            from storage_outage import FlakyS3

            s3 = stack.enter_context(FlakyS3())
        return _run_mode(sb, mode, faults, args, s3)


def _run_mode(sb: Sandbox, mode: str, faults: list[str], args: argparse.Namespace,
              s3: Any) -> list[Cost]:  # fmt: skip
    step_log = sb.cwd / "runs" / mode / "steps.jsonl"
    doc = _job(mode, interval=args.interval, fast_interval=args.fast_interval,
               step_log=f"runs/{mode}/steps.jsonl", faults=faults)  # fmt: skip
    if s3 is not None:
        _on_s3(sb, doc, s3, mode)
    sb.request("POST", f"/apis/omni.megascale.io/v1alpha1/namespaces/{NS}/omnitrainingjobs", doc)
    costs: list[Cost] = []
    try:
        for fault in faults:
            try:
                if fault == "storage-outage":
                    cost = _measure_outage(sb, Cost(fault, mode), step_log, args, s3)
                else:
                    cost = _measure(sb, Cost(fault, mode), step_log, args)
            except TimeoutError as err:  # the table shows what was measured
                cost = Cost(fault, mode, note=str(err))
            costs.append(cost)
            if cost.lost_s is None:  # not measured: the job failed, or a wait timed out
                break
    finally:
        sb.request("DELETE", sb.job_path())
        sb.wait("the job gone", lambda: not sb.pods(), timeout=120)
    return costs


def _measure(sb: Sandbox, cost: Cost, step_log: Path, args: argparse.Namespace) -> Cost:
    """Inject ``cost.fault`` once the job trains a few steps past a checkpoint; fill in what
    the recovery cost."""
    attempt = sb.status().get("attempt", 0)

    spares = 1 if cost.mode.endswith("+spare") else 0

    def ready() -> bool:
        recs = [r for r in _records(step_log) if r["attempt"] == attempt]
        step = max((r["step"] for r in recs), default=0)
        ready_spares = sum(x.get("ready", False) for x in sb.status().get("spares") or [])
        return (len(recs) >= args.interval + args.past and step % args.interval >= args.past
                and ready_spares >= spares)  # fmt: skip

    sb.wait(f"{cost.mode}: attempt {attempt} training", ready, timeout=args.timeout)
    if cost.fault == "image-missing":
        sb.request("PATCH", sb.job_path(), {"spec": {"image": MISSING_IMAGE}})
    lost = sb.pod_of_rank(1)["spec"]["nodeName"] if cost.fault == "node-lost" else None
    inject = _inject(sb, cost.fault)
    before = sb.status().get("restarts", 0)
    t0 = time.time()
    inject()
    reached = max(r["step"] for r in _records(step_log))

    def decided() -> bool:  # a resumed suspend is no restart, but a new attempt
        st = sb.status()
        new_attempt = st.get("attempt", attempt) > attempt
        return st.get("restarts", 0) > before or new_attempt or st.get("phase") == "Failed"

    sb.wait(f"{cost.mode}/{cost.fault}: a restart decision", decided, timeout=args.timeout)
    cost.detection_s = time.time() - t0
    new = sb.status()["attempt"]

    def first() -> dict[str, Any] | None:  # of this attempt or a later one (a peer's failure
        # found while the first restart began restarts again at once)
        recs = [r for r in _records(step_log) if r["attempt"] >= new]
        if not recs and sb.status().get("phase") == "Failed":
            return {"failed": True}
        return min(recs, key=lambda r: r["time"]) if recs else None

    try:
        rec = sb.wait(f"the first step of attempt {new}", first, timeout=args.timeout)
    except TimeoutError as err:
        cost.note = str(err)
        return cost
    if rec.get("failed"):
        cost.note = f"job Failed: {sb.status().get('message', '')[:100]}"
        return cost

    def last_record() -> dict[str, Any]:
        return (sb.status().get("restartHistory") or [{}])[-1]

    try:  # the operator's own figure, one poll after the first step
        history = sb.wait("the operator's lostSeconds",
                          lambda: (r := last_record()).get("lostSeconds") is not None and r,
                          timeout=20)  # fmt: skip
    except TimeoutError:
        history = last_record()
    cost.first_step_s = rec["time"] - t0
    cost.recomputed = max(reached - (rec["step"] - 1), 0)
    median = statistics.median(_step_times(_records(step_log)))
    cost.lost_s = cost.first_step_s + cost.recomputed * median
    mean = statistics.mean(_step_times(_records(step_log)))
    restarts = sb.status().get("restarts", 0) - before
    how = (f"{history.get('mode')} ({history.get('reason')})" if restarts
           else "no restart (a resumed suspend is a new attempt)")  # fmt: skip
    if restarts > 1:
        how += f", {restarts} restarts"
    cost.note = (f"{how}, step time median {median:.2f} s "
                 f"mean {mean:.3f} s, resumed at {rec['step'] - 1} (reached {reached}), "
                 f"operator lostSeconds {history.get('lostSeconds')}")  # fmt: skip
    if lost is not None:
        sb.fault("node-ready", lost)  # the node comes back for later placements
    return cost


def _measure_outage(sb: Sandbox, cost: Cost, step_log: Path, args: argparse.Namespace,
                    s3: Any) -> Cost:  # fmt: skip
    """S3 down for ``--outage-seconds`` a few steps before a checkpoint: the training the
    stalls took until a checkpoint commits again, and what was not committed."""
    attempt = sb.status().get("attempt", 0)
    before = sb.status().get("restarts", 0)

    def ready() -> bool:
        recs = [r for r in _records(step_log) if r["attempt"] == attempt]
        step = max((r["step"] for r in recs), default=0)
        committed = (sb.status().get("lastCheckpoint") or {}).get("step") or 0
        return (len(recs) >= args.interval + args.past and step % args.interval >= args.past
                and committed > 0)  # fmt: skip

    sb.wait(f"{cost.mode}: attempt {attempt} training", ready, timeout=args.timeout)
    reached = max(r["step"] for r in _records(step_log))
    t0 = time.time()
    s3.outage(args.outage_seconds).join()
    back = time.time()

    def committed_after() -> int | None:  # a checkpoint of training past the outage's start
        last = sb.status().get("lastCheckpoint") or {}
        step, at = last.get("step") or 0, _parse_time(last.get("time"))
        return step if at is not None and at >= back and step > reached else None

    try:
        step = sb.wait("a checkpoint committed after the outage", committed_after,
                       timeout=args.timeout)  # fmt: skip
    except TimeoutError as err:
        cost.note = str(err)
        return cost
    end = time.time()
    every = _records(step_log)
    median = statistics.median(_step_times(every))
    window = [r for r in every if t0 <= r["time"] <= end]
    seen = {r["step"] for r in every if r["time"] < t0}
    recomputed = 0
    for r in window:  # steps trained again after a restart
        recomputed += r["step"] in seen
        seen.add(r["step"])
    gaps = [b["time"] - a["time"] for a, b in itertools.pairwise(every)
            if t0 <= b["time"] <= end and b["step"] == a["step"] + 1]  # fmt: skip
    stalls = [g - median for g in gaps if g > 2 * median]
    top = max((r["step"] for r in window), default=reached)
    last = max((r["time"] for r in window), default=t0)
    cost.recomputed = recomputed
    cost.lost_s = max(0.0, (last - t0) - (top - reached) * median)  # wall time without progress
    restarts = sb.status().get("restarts", 0) - before
    why = (
        ", ".join(
            h.get("reason", "?") for h in (sb.status().get("restartHistory") or [])[-restarts:]
        )
        if restarts
        else ""
    )
    cost.note = (f"{restarts} restarts{f' ({why})' if why else ''}; S3 down {back - t0:.1f} s "
                 f"from step {reached}; {top - reached} steps gained until the first commit after "
                 f"it (step {step}, {end - back:.1f} s after S3 was back); stalls "
                 f"{', '.join(f'{x:.1f}' for x in stalls) or 'none'} s beyond the median step "
                 f"{median:.2f} s")  # fmt: skip
    return cost


def _parse_time(text: str | None) -> float | None:
    import datetime as dt

    if not text:
        return None
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def run_suite(sb: Sandbox, args: argparse.Namespace) -> tuple[list[Cost], bool]:
    """The suite's faults one after another in one in-place job, which then trains to its end;
    the costs, and whether every step equals the uninterrupted run."""
    step_log = sb.cwd / "runs" / "suite" / "steps.jsonl"
    doc = _job("in-place", interval=args.interval, fast_interval=args.fast_interval,
               step_log="runs/suite/steps.jsonl", faults=SUITE, steps=args.steps)  # fmt: skip
    doc["spec"]["trainer"]["checkpoint"]["path"] = "runs/suite/ckpt"
    sb.request("POST", f"/apis/omni.megascale.io/v1alpha1/namespaces/{NS}/omnitrainingjobs", doc)
    costs: list[Cost] = []
    try:
        for i, fault in enumerate(SUITE, 1):
            cost = _measure(sb, Cost(fault, "in-place"), step_log, args)
            costs.append(cost)
            print(f"  fault {i}/{len(SUITE)} {fault}: first step after {_fmt(cost.first_step_s)},"
                  f" {cost.recomputed} recomputed; {cost.note}", flush=True)  # fmt: skip
        phase = sb.wait("the job's end", lambda: sb.status().get("phase") in ("Succeeded", "Failed")
                        and sb.status()["phase"], timeout=args.timeout * 3)  # fmt: skip
        print(f"job {phase}: {sb.status().get('restarts')} restarts", flush=True)
    finally:
        sb.request("DELETE", sb.job_path())
        sb.wait("the job gone", lambda: not sb.pods(), timeout=120)
    ref = dict(doc, spec={**doc["spec"], "trainer": {**doc["spec"]["trainer"]}})
    ref["spec"]["trainer"].pop("checkpoint")
    ref["spec"]["trainer"]["train"] = {**doc["spec"]["trainer"]["train"],
                                       "stepLog": "runs/ref/steps.jsonl"}  # fmt: skip
    (sb.cwd / "ref.yaml").write_text(yaml.safe_dump(ref, sort_keys=False))
    env = {**os.environ, "OMNI_NUM_THREADS": str(os.cpu_count() or 1)}  # a pod's threads
    subprocess.run([sys.executable, "-m", "omni_trainer.cli", "train", "ref.yaml", "--nproc", "2"],
                   cwd=sb.cwd, env=env, check=True, capture_output=True)  # fmt: skip
    ok = compare_with_uninterrupted(_records(step_log), _records(sb.cwd / "runs/ref/steps.jsonl"))
    return costs, ok


def compare_with_uninterrupted(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> bool:
    """Every step of the faulted run (each of its runs, recomputed ones included) against the
    uninterrupted run: the same samples and the same loss. Prints the verdict."""
    ref = {r["step"]: r for r in want}
    steps = sorted({r["step"] for r in got})
    runs_of = {s: [r for r in got if r["step"] == s] for s in steps}
    complete = steps == sorted(ref)
    wrong = [r["step"] for r in got if r["step"] not in ref
             or r["samples"] != ref[r["step"]]["samples"]]  # fmt: skip
    worst = max((abs(r["loss"] - ref[r["step"]]["loss"]) for r in got if r["step"] in ref),
                default=float("inf"))  # fmt: skip
    recomputed = sum(len(v) - 1 for v in runs_of.values())
    ok = complete and not wrong and worst <= 1e-6
    print(f"fingerprints: {len(steps)} steps ({recomputed} recomputed runs) vs an uninterrupted "
          f"run of {len(ref)}: every step present {complete}, samples differ at {len(wrong)} "
          f"{wrong[:5]}, max loss difference {worst:.2e}; equal: {ok}")  # fmt: skip
    return ok


def _step_times(records: list[dict[str, Any]]) -> list[float]:
    """Seconds between consecutive steps of one attempt (restarts excluded)."""
    out = []
    for a, b in itertools.pairwise(records):
        if a["attempt"] == b["attempt"] and b["step"] == a["step"] + 1:
            out.append(b["time"] - a["time"])
    return out or [0.0]


def _fmt(value: float | int | None, unit: str = "s") -> str:
    if value is None:
        return "-"
    return f"{value:.1f} {unit}" if isinstance(value, float) else f"{value}"


def print_table(costs: list[Cost], modes: list[str]) -> None:
    by = {(c.fault, c.mode): c for c in costs}
    cols = ["detect", "1st step", "recomp", "lost"]
    head = f"{'fault':<14}" + "".join(f"{m + ' ' + c:>22}" for m in modes for c in cols)
    print(head)
    for fault in dict.fromkeys(c.fault for c in costs):
        row = f"{fault:<14}"
        for m in modes:
            c = by.get((fault, m))
            vals = (c.detection_s, c.first_step_s, c.recomputed, c.lost_s) if c else (None,) * 4
            row += "".join(f"{_fmt(v):>22}" for v in vals)
        print(row)
    if len(modes) == 2:
        print(f"\n{'fault':<14}{'lost ' + modes[0]:>20}{'lost ' + modes[1]:>20}{'ratio':>10}")
        for fault in dict.fromkeys(c.fault for c in costs):
            a, b = by.get((fault, modes[0])), by.get((fault, modes[1]))
            la, lb = (a.lost_s if a else None), (b.lost_s if b else None)
            ratio = f"{lb / la:.1f}x" if la and lb else "-"
            print(f"{fault:<14}{_fmt(la):>20}{_fmt(lb):>20}{ratio:>10}")
    print("\nnotes:")
    for c in costs:
        print(f"  {c.mode:<9} {c.fault:<14} {c.note}")


def print_suite(costs: list[Cost]) -> None:
    """Per kind: how many faults, median first step after the fault, steps recomputed."""
    print(f"\nsuite: {len(costs)} faults of {len({c.fault for c in costs})} kinds")
    print(f"{'fault':<14}{'n':>4}{'1st step median':>18}{'recomputed':>12}")
    for fault in dict.fromkeys(c.fault for c in costs):
        mine = [c for c in costs if c.fault == fault]
        firsts = [c.first_step_s for c in mine if c.first_step_s is not None]
        first = _fmt(statistics.median(firsts)) if firsts else "-"
        recomputed = sum(c.recomputed or 0 for c in mine)
        print(f"{fault:<14}{len(mine):>4}{first:>18}{recomputed:>12}")


def main() -> None:
    args = _args()
    os.environ.setdefault("PYTHONPATH", f"{REPO / 'trainer'}:{REPO / 'operator'}")
    pulls = (
        f"{args.pull_seconds:g} s per node and image (assumed)"
        if args.pull_seconds
        else ("not modelled (--pull-seconds 0)")
    )
    print(f"image pulls: {pulls}", flush=True)
    first = args.crash_backoff_seconds
    print(f"kubelet crash back-off: {first:g} s first, doubling to {30 * first:g} s "
          "(a kubelet's: 10 s to 300 s)", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="omni-faults-") as tmp:
        root = args.dir.resolve() if args.dir else Path(tmp)
        if args.suite:
            root.mkdir(parents=True, exist_ok=True)
            sb = Sandbox(
                root, nodes=8, pull_s=args.pull_seconds, backoff_s=args.crash_backoff_seconds
            )  # it quarantines 4 nodes
            try:
                costs, ok = run_suite(sb, args)
            finally:
                sb.close()
            print_suite(costs)
            sys.exit(0 if ok else 1)
        costs: list[Cost] = []
        for mode in args.modes:
            # A sandbox of its own: no mode inherits the images another one's pods pulled.
            (root / mode).mkdir(parents=True, exist_ok=True)
            sb = Sandbox(root / mode, nodes=4, pull_s=args.pull_seconds,
                         backoff_s=args.crash_backoff_seconds)  # fmt: skip
            try:
                costs += run_mode(sb, mode, list(args.faults), args)
            finally:
                sb.close()
            print(f"{mode}: done ({len(costs)} faults so far)", flush=True)
    print_table(costs, args.modes)
    if args.smoke and any(c.lost_s is None for c in costs):
        sys.exit("a fault's cost was not measured (see the notes)")


if __name__ == "__main__":
    main()
