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
  crash: a restart that keeps the pods pulls nothing; one that recreates them cannot pull (the
  image is restored once the job trains again);
* suspend: ``spec.suspend`` set (the pods deleted with their grace), then unset (a new attempt);
* straggler: ``throttle-pod`` on node rank 1 (its trainer stopped half of the time) with
  ``restartPolicy.stragglers.action: replace`` set for this fault alone (the job only reports
  stragglers otherwise): found, then replaced after the next checkpoint.
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

``--suite`` is the fault suite: one in-place job of ``--steps`` steps takes :data:`SUITE` (26
faults of 12 kinds, one after another; ``--faults`` names another sequence), trains to the end,
and is compared with the same job run uninterrupted: every step's sample fingerprint and loss
must be equal (no sample lost, none trained twice), recomputed steps included. Its operator runs
in a process of its own (``omni sandbox up --no-operator`` beside ``omni operator --standalone
--server URL``, as the chart's Deployment runs it), its quarantine lasts
``--quarantine-seconds`` (default 180; ``quarantineReadySeconds`` 5), and it adds
four kinds of its own:

* operator killed during a restart: a ``crash-pod`` on node rank 1, the operator SIGKILLed as
  soon as the job's status shows the restart decided (restarts incremented or phase
  Restarting, polled every 0.05 s) and started again (a Deployment replacing its pod): the new
  operator must carry the restart through;
* checkpoint corrupted in place: once the current interval's checkpoint committed, 64 bytes in
  the middle of its largest data file flipped (same size: only the recorded checksums see it),
  then a ``crash-pod``: the resume must skip it for the previous committed step (checked);
* two faults on one node in a row: every node but the job's two cordoned, one of the two lost
  (one no earlier failure blames within ``quarantineSeconds``, else an earlier ``node-lost``
  there makes the first loss quarantine it; if both are blamed, once the older blame is out
  of the window); once the restart is decided it is Ready again and the job, with nowhere
  else to go, is placed on it again; as soon as it trains there, the node is lost again (the
  other nodes uncordoned): blamed twice within ``quarantineSeconds``, it must be quarantined
  (``quarantineAfterFailures`` 2; checked), and it stays lost;
* a node returning after quarantine: that node, Ready again once its quarantine is due, must
  leave ``status.quarantine``: the note says whether the running job lifted it within a few
  resyncs past ``quarantineReadySeconds``; then node rank 1's pod is deleted (a new attempt,
  which places) and the node must no longer be listed once the job trains again (checked).

The suite prints every fault's outcome: injected, survived (the job trained again), its kind's
check, detection, first step, and from the step log between its injection and the next fault's:
steps recomputed (a step trained again), lost (a step skipped) and duplicated (a step run whose
samples or loss differ from the uninterrupted run's: a batch skipped or trained twice); exit 1
unless every fault was survived, every check held and the curve is equal.

    make bench-faults
    make fault-suite
    python bench/faults.py --modes in-place --faults crash kill
    python bench/faults.py --modes recreate recreate+fast --faults node-lost --interval 20 --past 12
    python bench/faults.py --modes in-place+spare in-place --faults node-lost
    python bench/faults.py --modes in-place+spare in-place --faults node-lost --pull-seconds 60
    python bench/faults.py --faults crash crash crash crash --crash-backoff-seconds 10
    python bench/faults.py --suite --steps 400 --faults crash operator-kill corrupt-checkpoint
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from omni_operator.sandbox.control import inject_fault

REPO = Path(__file__).resolve().parents[1]
LABEL_ATTEMPT, LABEL_RANK = "omni.megascale.io/attempt", "omni.megascale.io/node-rank"
FAULTS = ("crash", "kill", "hang", "sigterm", "node-lost", "image-missing", "storage-outage",
          "suspend", "straggler")  # fmt: skip
SUITE_ONLY = ("operator-kill", "corrupt-checkpoint", "node-lost-twice", "quarantine-return")
"""Kinds only the suite injects (its job's operator runs in a process of its own, and its
quarantine lasts ``--quarantine-seconds``)."""
SUITE = (
    *("crash", "kill", "sigterm", "node-lost", "suspend") * 3,
    "operator-kill", "corrupt-checkpoint", "node-lost-twice", "operator-kill", "hang",
    "quarantine-return", "straggler", "crash", "kill", "hang", "image-missing",
)  # fmt: skip
"""The suite's faults in order: ``node-lost-twice`` leaves its node lost and quarantined, and
``quarantine-return`` brings it back once the quarantine is due (the faults between fill part
of the wait), and a missing image is a fault only at a restart that pulls, so it comes last."""
QUARANTINE_READY_S = 5
"""The suite job's ``restartPolicy.quarantineReadySeconds``."""
OPERATOR_RESYNC_S = 1
JOB = "tiny-cpu"
NS = "default"
MISSING_IMAGE = "ghcr.io/megascale-omni/trainer:0.0.0-missing"


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", nargs="+", default=["in-place", "recreate"])
    p.add_argument("--faults", nargs="+", choices=FAULTS + SUITE_ONLY,
                   help=f"default: {' '.join(FAULTS[:7])}; with --suite: its faults in this "
                   f"order instead of SUITE ({', '.join(SUITE_ONLY)}: only there)")  # fmt: skip
    p.add_argument("--suite", action="store_true", help="the fault suite (--modes unused)")
    p.add_argument("--steps", type=int, default=700,
                   help="the suite job's steps: past the step the last fault leaves (about 260 "
                   "on a loaded machine), so that no fault finds the job ended; each step "
                   "beyond costs twice (the job, then the uninterrupted run)")  # fmt: skip
    p.add_argument("--quarantine-seconds", type=int, default=180,
                   help="the suite job's restartPolicy.quarantineSeconds: also the window in "
                   "which node-lost-twice's two losses must fall, so it leaves room for a "
                   "loaded machine, where bringing the job back onto the node (new pods, a "
                   "cold start) took 35 to 75 s (60, the minimum, was too short)")  # fmt: skip
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
    if args.suite:
        args.faults = tuple(args.faults or SUITE)
    elif args.faults is None:
        args.faults = list(FAULTS[:7])
    elif only := set(args.faults) & set(SUITE_ONLY):
        p.error(f"{', '.join(sorted(only))}: only with --suite")
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
    injected_at: float | None = None
    """When the fault was injected (wall clock; None: it was not)."""
    check: bool | None = None
    """Whether what the fault kind must show held (a corrupted checkpoint skipped, a node
    quarantined, then lifted; None: nothing beyond surviving)."""
    check_note: str = ""
    facts: dict[str, Any] = field(default_factory=dict)
    """What a fault kind's injection noted for its check (a corrupted step, a returned node)."""


class Sandbox:
    """``omni sandbox up`` in a directory of its own, driven over its HTTP API."""

    def __init__(
        self,
        cwd: Path,
        *,
        nodes: int = 4,
        pull_s: float = 0.0,
        backoff_s: float = 1.0,
        own_operator: bool = False,
    ) -> None:
        self.cwd = cwd
        argv = [sys.executable, "-m", "omni_trainer.cli", "sandbox", "up", "--nodes", str(nodes),
                "--gpus-per-node", "0", "--resync", str(OPERATOR_RESYNC_S), "--dir", ".sandbox",
                "--pull-seconds", str(pull_s),
                "--crash-backoff-seconds", str(backoff_s)]  # fmt: skip
        if own_operator:
            argv.append("--no-operator")
        self.log = (cwd / "sandbox.log").open("w")
        self.proc = subprocess.Popen(argv, cwd=cwd, stdout=self.log, stderr=subprocess.STDOUT)
        state = cwd / ".sandbox" / "sandbox.json"
        self.wait("the sandbox", state.exists, timeout=120)
        self.url = json.loads(state.read_text())["server"]
        self.operator: subprocess.Popen[bytes] | None = None
        self.ckpt = cwd / "runs" / "suite" / "ckpt"
        self.held: list[str] = []
        """Nodes a fault left lost (and quarantined) for a later fault to bring back."""
        self.cordoned: list[str] = []
        if own_operator:
            self.start_operator()

    def start_operator(self) -> None:
        """The operator in a process of its own, as the chart's Deployment runs it."""
        argv = [sys.executable, "-m", "omni_trainer.cli", "operator", "--standalone",
                "--server", self.url]  # fmt: skip
        env = {**os.environ, "OMNI_RESYNC_SECONDS": str(OPERATOR_RESYNC_S)}
        with (self.cwd / "operator.log").open("a") as log:
            self.operator = subprocess.Popen(argv, cwd=self.cwd, env=env, stdout=log,
                                             stderr=subprocess.STDOUT)  # fmt: skip

    def kill_operator(self) -> None:
        """SIGKILL the operator and start a new one (a Deployment replacing its pod)."""
        assert self.operator is not None, "the sandbox runs its operator in-process"
        self.operator.kill()
        self.operator.wait()
        self.start_operator()

    def close(self) -> None:
        for proc in (self.operator, self.proc):  # the operator first: the sandbox stops pods
            if proc is None:
                continue
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()

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
        inject_fault(self.url, fault, target, namespace=NS)

    def node_names(self) -> list[str]:
        return [n["metadata"]["name"] for n in self.request("GET", "/api/v1/nodes")["items"]]

    def cordon(self, node: str, *, on: bool = True) -> None:
        """``kubectl cordon`` (``uncordon`` with ``on=False``): placement skips the node."""
        self.request("PATCH", f"/api/v1/nodes/{node}", {"spec": {"unschedulable": on}})

    def quarantined(self) -> dict[str, dict[str, Any]]:
        """``status.quarantine`` by node."""
        return {e["node"]: e for e in self.status().get("quarantine") or []}

    def wait(
        self, what: str, check: Callable[[], Any], *, timeout: float, poll: float = 0.2
    ) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = check()
            if value:
                return value
            time.sleep(poll)
        raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def _job(
    mode: str,
    *,
    interval: int,
    fast_interval: int,
    step_log: str,
    steps: int = 100000,
) -> dict[str, Any]:
    """The measured job. Stragglers are only reported: a false positive on a loaded machine
    would otherwise restart the job mid-measurement (and, once a fault left the spec unable to
    recreate pods, fail it); the straggler fault sets ``action: replace`` for itself."""
    doc = yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())
    spec = doc["spec"]
    spec["nodes"] = 2
    restart_mode, _, tier = mode.partition("+")
    spec["restartPolicy"] = {"mode": restart_mode, "nodeLostGraceSeconds": 5,
                             "hangTimeoutSeconds": 60, "backoffSeconds": {"base": 0, "max": 0},
                             "budget": 40, "stopGraceSeconds": 20,
                             "stragglers": {"action": "report", "persistSteps": 20}}  # fmt: skip
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


def _inject(sb: Sandbox, cost: Cost) -> Callable[[], None]:
    """The action that injects ``cost.fault`` (resolved now, timed by the caller)."""
    fault = cost.fault
    if fault in ("crash", "image-missing"):
        pod = sb.pod_of_rank(1)["metadata"]["name"]
        return lambda: sb.fault("crash-pod", pod)
    if fault == "operator-kill":
        pod = sb.pod_of_rank(1)["metadata"]["name"]
        return lambda: _crash_then_kill_operator(sb, cost, pod)
    if fault == "corrupt-checkpoint":
        pod = sb.pod_of_rank(1)["metadata"]["name"]
        return lambda: _corrupt_then_crash(sb, cost, pod)
    if fault == "node-lost-twice":
        node = cost.facts["node"]
        return lambda: _lose_again(sb, node)
    if fault in ("sigterm", "quarantine-return"):  # the latter: a new attempt, which places
        pod = sb.pod_of_rank(1)["metadata"]["name"]
        return lambda: sb.request("DELETE", f"/api/v1/namespaces/{NS}/pods/{pod}")
    if fault == "kill":
        pod = sb.pod_of_rank(0)["metadata"]["name"]
        return lambda: sb.fault("kill-pod", pod)
    if fault == "hang":
        pod = sb.pod_of_rank(1)["metadata"]["name"]
        return lambda: sb.fault("hang-pod", pod)
    if fault == "straggler":
        pod = sb.pod_of_rank(1)["metadata"]["name"]
        return lambda: sb.fault("throttle-pod", pod)
    if fault == "suspend":
        return lambda: _suspend_and_resume(sb)
    node = sb.pod_of_rank(1)["spec"]["nodeName"]
    return lambda: sb.fault("node-lost", node)


def _crash_then_kill_operator(sb: Sandbox, cost: Cost, pod: str) -> None:
    """A crash; the operator SIGKILLed as soon as the status shows its restart decision, and
    started again: the new operator must carry the restart through."""
    before = sb.status().get("restarts", 0)
    t0 = time.time()
    sb.fault("crash-pod", pod)

    def decided() -> dict[str, Any] | None:
        st = sb.status()
        return st if st.get("restarts", 0) > before or st.get("phase") == "Restarting" else None

    st = sb.wait("the restart decision", decided, timeout=120, poll=0.05)
    sb.kill_operator()
    cost.check_note = (f"operator SIGKILLed {time.time() - t0:.1f} s after the crash, in "
                       f"phase {st.get('phase')} (restarts {st.get('restarts', 0)}), and "
                       "started again")  # fmt: skip


def newest_committed(root: Path) -> int | None:
    """The newest step under a checkpoint root with a commit marker."""
    steps = [int(p.name.removeprefix("step-")) for p in root.glob("step-*")
             if (p / "COMMITTED").exists()]  # fmt: skip
    return max(steps, default=None)


def corrupt_checkpoint(root: Path, step: int) -> Path:
    """Flip 64 bytes in the middle of the step's largest data file, keeping its size (what a
    size check cannot see, a checksum can); the file."""
    data = max((root / f"step-{step:08d}").glob("model/*.distcp"), key=lambda p: p.stat().st_size)
    size = data.stat().st_size
    with data.open("r+b") as f:
        f.seek(size // 2)
        chunk = f.read(64)
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in chunk))
    return data


def _corrupt_then_crash(sb: Sandbox, cost: Cost, pod: str) -> None:
    """The newest committed checkpoint corrupted in place, then a crash: the resume must skip
    it for the one before (checked once the job trains again)."""
    step = newest_committed(sb.ckpt)
    if step is None:
        raise RuntimeError(f"no committed checkpoint under {sb.ckpt}")
    data = corrupt_checkpoint(sb.ckpt, step)
    sb.fault("crash-pod", pod)
    cost.check_note = f"corrupted step {step} ({data.name}, same size)"
    cost.facts["corrupted"] = step


def _unblamed_node(sb: Sandbox, window: float, timeout: float) -> tuple[str, str]:
    """Of the job's two nodes, (one no failure blames within the quarantine window, the other):
    node-lost-twice's two losses must be the only ones counted against its node, or the first
    alone quarantines it (an earlier node-lost fault on the same node) and the job cannot come
    back to it. When both are blamed, waits (the job trains) until the older blame ages out."""
    from omni_operator.failure_origin import blames_nodes

    nodes = [sb.pod_of_rank(r)["spec"]["nodeName"] for r in (1, 0)]
    last = dict.fromkeys(nodes, 0.0)
    for r in sb.status().get("restartHistory") or []:
        if blames_nodes(r.get("reason", "")):
            for n in set(r.get("nodes") or []) & set(nodes):
                last[n] = max(last[n], _parse_time(r.get("time")) or time.time())
    node = min(nodes, key=lambda n: last[n])  # rank 1's on a tie
    clear = last[node] + window + 1
    sb.wait(f"{node}'s last failure out of the quarantine window", lambda: time.time() > clear,
            timeout=timeout)  # fmt: skip
    return node, next(n for n in nodes if n != node)


def _lose_first(sb: Sandbox, cost: Cost, step_log: Path, args: argparse.Namespace) -> None:
    """node-lost-twice, its first loss: every node but the job's two cordoned, one of them
    lost (:func:`_unblamed_node`); once the restart is decided it comes back Ready, and the job
    (with nowhere else to go) is placed on it again. Returns once the job trains there."""
    timeout = args.timeout
    node, other = _unblamed_node(sb, args.quarantine_seconds, timeout)
    cordoned = [n for n in sb.node_names() if n not in (node, other)]
    for n in cordoned:
        sb.cordon(n)
    sb.cordoned = cordoned  # uncordoned by the second loss
    cost.facts["node"] = node
    st = sb.status()
    before, attempt = st.get("restarts", 0), st.get("attempt", 0)
    t0 = cost.injected_at = time.time()
    sb.fault("node-lost", node)
    sb.wait("the first loss's restart", lambda: sb.status().get("restarts", 0) > before,
            timeout=timeout)  # fmt: skip
    decided = time.time() - t0
    sb.fault("node-ready", node)

    def back() -> bool:
        if not any(r["attempt"] > attempt for r in _records(step_log)):
            return False
        try:  # its node rank may differ now: ranks follow the node names
            return node in (sb.pod_of_rank(r)["spec"]["nodeName"] for r in (0, 1))
        except RuntimeError:  # between attempts
            return False

    sb.wait(f"the job training on {node} again", back, timeout=timeout)
    cost.check_note = (f"{node} lost (restart after {decided:.1f} s), Ready again, the job back "
                       f"on it {time.time() - t0:.1f} s after the loss; lost again")  # fmt: skip


def _lose_again(sb: Sandbox, node: str) -> None:
    """node-lost-twice, its second loss (the one measured); the other nodes uncordoned, so
    the restart has somewhere to go."""
    sb.fault("node-lost", node)
    for n in sb.cordoned:
        sb.cordon(n, on=False)
    sb.cordoned = []
    sb.held.append(node)


def _await_lift(sb: Sandbox, cost: Cost, timeout: float) -> None:
    """quarantine-return, before its measured fault: the node ``node-lost-twice`` left lost and
    quarantined comes back Ready once its quarantine is due; whether the running job lifts it
    within a few resyncs past ``quarantineReadySeconds``."""
    if not sb.held:
        raise RuntimeError("quarantine-return brings back the node node-lost-twice left lost")
    node = sb.held.pop(0)
    entry = sb.quarantined().get(node)
    due = _parse_time(entry.get("until")) if entry else None
    if due is not None:
        sb.wait(f"{node}'s quarantine due", lambda: time.time() >= due, timeout=timeout)
    sb.fault("node-ready", node)
    back = time.time()
    settle = QUARANTINE_READY_S + 5 * OPERATOR_RESYNC_S + 5
    with contextlib.suppress(TimeoutError):
        sb.wait(f"{node} lifted while the job runs", lambda: node not in sb.quarantined(),
                timeout=settle)  # fmt: skip
    listed = node in sb.quarantined()
    if entry:  # else there is no quarantine to end: the check fails (not exercised)
        cost.facts["returned"] = node
    cost.check_note = (
        f"{node} {'quarantined' if entry else 'NOT quarantined'} until "
        f"{entry.get('until') if entry else '-'}, Ready again after that; while the job ran "
        + (f"still listed {time.time() - back:.0f} s later (lifted only when an attempt starts)"
           if listed else f"lifted {time.time() - back:.1f} s later")
    )  # fmt: skip


def _checked(sb: Sandbox, cost: Cost, resumed: int) -> None:
    """What the fault kind must show, once the job trains again."""
    if cost.fault == "corrupt-checkpoint":
        step = cost.facts.get("corrupted")
        cost.check = step is not None and resumed < step
        cost.check_note += f"; resumed from step {resumed}" + (
            " (skipped it)" if cost.check else " (NOT skipped)"
        )
    elif cost.fault == "node-lost-twice":
        node = sb.held[-1]
        entry = sb.quarantined().get(node)
        cost.check = entry is not None
        cost.check_note += (
            f"; {node} quarantined ({entry.get('reason')}, until {entry.get('until')})"
            if entry
            else f"; {node} NOT quarantined"
        )
    elif cost.fault == "quarantine-return":
        node = cost.facts.get("returned", "")
        cost.check = bool(node) and node not in sb.quarantined()
        cost.check_note += "; " + (
            "not listed after the next attempt started"
            if cost.check
            else "not exercised (no quarantine to end)"
            if not node
            else "STILL listed after the next attempt started"
        )
    elif cost.fault == "operator-kill":
        cost.check = sb.operator is not None and sb.operator.poll() is None


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
               step_log=f"runs/{mode}/steps.jsonl")  # fmt: skip
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
    if cost.fault == "node-lost-twice":  # the first loss; the second one is measured
        _lose_first(sb, cost, step_log, args)
    if cost.fault == "quarantine-return":  # the node back; the next attempt's start measured
        _await_lift(sb, cost, args.timeout)
    attempt = sb.status().get("attempt", 0)

    spares = 1 if cost.mode.endswith("+spare") else 0
    # The second loss of a node within the quarantine window: as soon as the job trains there.
    least = 1 if cost.fault == "node-lost-twice" else args.interval + args.past

    def ready() -> bool:
        recs = [r for r in _records(step_log) if r["attempt"] >= attempt]
        if len(recs) < least:
            if sb.status().get("phase") in ("Succeeded", "Failed"):
                raise RuntimeError(f"the job ended ({sb.status()['phase']}) before the fault")
            return False
        step = max(r["step"] for r in recs)
        if cost.fault == "corrupt-checkpoint":  # this interval's checkpoint committed (async)
            return step % args.interval >= args.past and (
                newest_committed(sb.ckpt) == step - step % args.interval
            )
        ready_spares = sum(x.get("ready", False) for x in sb.status().get("spares") or [])
        return ((least == 1 or step % args.interval >= args.past)
                and ready_spares >= spares)  # fmt: skip

    sb.wait(f"{cost.mode}: attempt {attempt} training", ready, timeout=args.timeout)
    undo = _set_up(sb, cost.fault)
    try:
        return _injected(sb, cost, step_log, args, attempt)
    finally:  # once the job trains again (or did not survive): later faults see the old spec
        if undo:
            sb.request("PATCH", sb.job_path(), {"spec": undo})


def _set_up(sb: Sandbox, fault: str) -> dict[str, Any]:
    """The job's spec as ``fault`` needs it; the merge patch that restores it.

    image-missing: an image the registry lacks, restored once the job trains again, so that
    no later restart that recreates pods (a node lost, a straggler replaced) has to pull it.
    straggler: ``stragglers.action: replace`` only for this fault; the job reports stragglers
    otherwise (see :func:`_job`).
    """
    if fault == "image-missing":
        image = sb.request("GET", sb.job_path())["spec"].get("image")  # None: the default
        sb.request("PATCH", sb.job_path(), {"spec": {"image": MISSING_IMAGE}})
        return {"image": image}
    if fault == "straggler":
        replace = {"restartPolicy": {"stragglers": {"action": "replace"}}}
        sb.request("PATCH", sb.job_path(), {"spec": replace})
        return {"restartPolicy": {"stragglers": {"action": "report"}}}
    return {}


def _injected(sb: Sandbox, cost: Cost, step_log: Path, args: argparse.Namespace,
              attempt: int) -> Cost:  # fmt: skip
    """Inject ``cost.fault`` into the training ``attempt``; what the recovery cost."""
    lost = sb.pod_of_rank(1)["spec"]["nodeName"] if cost.fault == "node-lost" else None
    inject = _inject(sb, cost)
    before = sb.status().get("restarts", 0)
    t0 = time.time()
    inject()
    cost.injected_at = cost.injected_at or t0  # node-lost-twice: its first loss
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
    _checked(sb, cost, rec["step"] - 1)
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
    the costs, and whether every step equals the uninterrupted run. A fault the job does not
    survive (or a wait that times out) ends the injections; the table shows what happened."""
    step_log = sb.cwd / "runs" / "suite" / "steps.jsonl"
    doc = _job("in-place", interval=args.interval, fast_interval=args.fast_interval,
               step_log="runs/suite/steps.jsonl", steps=args.steps)  # fmt: skip
    doc["spec"]["trainer"]["checkpoint"]["path"] = "runs/suite/ckpt"
    doc["spec"]["restartPolicy"].update(quarantineSeconds=args.quarantine_seconds,
                                        quarantineReadySeconds=QUARANTINE_READY_S)  # fmt: skip
    sb.request("POST", f"/apis/omni.megascale.io/v1alpha1/namespaces/{NS}/omnitrainingjobs", doc)
    costs: list[Cost] = []
    phase = None
    try:
        for i, fault in enumerate(args.faults, 1):
            cost = Cost(fault, "in-place")
            costs.append(cost)
            try:
                _measure(sb, cost, step_log, args)
            except (TimeoutError, RuntimeError, OSError) as err:
                cost.note = f"{type(err).__name__}: {err}"
            except KeyboardInterrupt:  # or SIGTERM (a time limit): the table of what was done
                cost.note = "interrupted"
            print(f"  fault {i}/{len(args.faults)} {fault}: first step after "
                  f"{_fmt(cost.first_step_s)}, {cost.recomputed} recomputed; {cost.note}"
                  + (f"; check {cost.check}: {cost.check_note}" if cost.check_note else ""),
                  flush=True)  # fmt: skip
            if cost.lost_s is None:  # not survived: the rest would measure a broken job
                print(f"  stopping the suite at fault {i}: {fault} not survived", flush=True)
                break
        else:
            with contextlib.suppress(TimeoutError, KeyboardInterrupt):
                phase = sb.wait("the job's end",
                                lambda: sb.status().get("phase") in ("Succeeded", "Failed")
                                and sb.status()["phase"], timeout=args.timeout * 3)  # fmt: skip
        print(f"job {phase or 'not finished'}: {sb.status().get('restarts')} restarts", flush=True)
    finally:
        sb.request("DELETE", sb.job_path())
        sb.wait("the job gone", lambda: not sb.pods(), timeout=120)
    if phase != "Succeeded":
        print_suite(costs, _records(step_log), {}, planned=len(args.faults))
        return costs, False
    ref = dict(doc, spec={**doc["spec"], "trainer": {**doc["spec"]["trainer"]}})
    ref["spec"]["trainer"].pop("checkpoint")
    ref["spec"]["trainer"]["train"] = {**doc["spec"]["trainer"]["train"],
                                       "stepLog": "runs/ref/steps.jsonl"}  # fmt: skip
    (sb.cwd / "ref.yaml").write_text(yaml.safe_dump(ref, sort_keys=False))
    env = {**os.environ, "OMNI_NUM_THREADS": str(os.cpu_count() or 1)}  # a pod's threads
    try:
        subprocess.run([sys.executable, "-m", "omni_trainer.cli", "train", "ref.yaml", "--nproc",
                        "2"], cwd=sb.cwd, env=env, check=True, capture_output=True)  # fmt: skip
    except KeyboardInterrupt:
        print("interrupted during the uninterrupted run", flush=True)
        print_suite(costs, _records(step_log), {}, planned=len(args.faults))
        return costs, False
    got, want = _records(step_log), _records(sb.cwd / "runs/ref/steps.jsonl")
    ok = compare_with_uninterrupted(got, want)
    print_suite(costs, got, {r["step"]: r for r in want}, planned=len(args.faults))
    return costs, ok


def compare_with_uninterrupted(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> bool:
    """Every step of the faulted run (each of its runs, recomputed ones included) against the
    uninterrupted run: the same samples and the same loss. Prints the verdict."""
    ref = {r["step"]: r for r in want}
    steps = sorted({r["step"] for r in got})
    runs_of = {s: [r for r in got if r["step"] == s] for s in steps}
    complete = steps == sorted(ref)
    wrong = [r["step"] for r in got if _differs(r, ref)]
    worst = max((abs(r["loss"] - ref[r["step"]]["loss"]) for r in got if r["step"] in ref),
                default=float("inf"))  # fmt: skip
    recomputed = sum(len(v) - 1 for v in runs_of.values())
    ok = complete and not wrong and worst <= 1e-6
    print(f"fingerprints: {len(steps)} steps ({recomputed} recomputed runs) vs an uninterrupted "
          f"run of {len(ref)}: every step present {complete}, samples or loss differ at "
          f"{len(wrong)} "
          f"{wrong[:5]}, max loss difference {worst:.2e}; equal: {ok}")  # fmt: skip
    return ok


def _differs(rec: dict[str, Any], ref: dict[int, dict[str, Any]]) -> bool:
    """A step run whose samples or loss are not the uninterrupted run's (a batch skipped or
    trained twice shows so)."""
    want = ref.get(rec["step"])
    return (
        want is None or rec["samples"] != want["samples"] or abs(rec["loss"] - want["loss"]) > 1e-6
    )


@dataclass
class Outcome:
    """A fault's share of the step log: the step runs from its injection to the next one's."""

    recomputed: int = 0
    """Runs of a step already trained (resumed from a checkpoint before the fault)."""
    lost: int = 0
    """Steps skipped: never trained before a later step was."""
    duplicated: int = 0
    """Runs whose samples or loss differ from the uninterrupted run (a batch skipped or trained
    twice)."""


def outcomes(costs: Sequence[Cost], got: list[dict[str, Any]],
             ref: dict[int, dict[str, Any]]) -> list[Outcome]:  # fmt: skip
    """Each fault's :class:`Outcome`, from its injection until the next fault's (the last
    one's: to the end of the log)."""
    starts = [c.injected_at for c in costs]
    out = [Outcome() for _ in costs]
    top = 0
    for rec in sorted(got, key=lambda r: r["time"]):
        i = max((k for k, t in enumerate(starts) if t is not None and t <= rec["time"]),
                default=None)  # fmt: skip
        if i is not None:
            o = out[i]
            o.recomputed += rec["step"] <= top
            o.lost += max(rec["step"] - top - 1, 0)
            o.duplicated += bool(ref) and _differs(rec, ref)
        top = max(top, rec["step"])
    return out


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


def print_suite(costs: list[Cost], got: list[dict[str, Any]],
                ref: dict[int, dict[str, Any]], *, planned: int) -> None:  # fmt: skip
    """Every fault's outcome (injected, survived, the check its kind must pass, steps
    recomputed, lost and duplicated in the step log until the next fault), then per kind."""
    done = [c for c in costs if c.injected_at is not None]
    kinds = {c.fault for c in done}
    print(f"\nsuite: {len(done)} faults of {len(kinds)} kinds injected ({planned} planned)")
    print(f"{'#':>3} {'fault':<19}{'injected':>9}{'survived':>9}{'check':>7}{'detect':>9}"
          f"{'1st step':>10}{'recomp':>8}{'lost':>6}{'dup':>6}")  # fmt: skip
    for i, (c, o) in enumerate(zip(costs, outcomes(costs, got, ref), strict=True), 1):
        check = "-" if c.check is None else ("ok" if c.check else "FAIL")
        dup = str(o.duplicated) if ref else "?"
        print(f"{i:>3} {c.fault:<19}{_yes(c.injected_at is not None):>9}"
              f"{_yes(c.lost_s is not None):>9}{check:>7}{_fmt(c.detection_s):>9}"
              f"{_fmt(c.first_step_s):>10}{o.recomputed:>8}{o.lost:>6}{dup:>6}")  # fmt: skip
    print(f"\n{'fault':<19}{'n':>4}{'1st step median':>18}{'recomputed':>12}")
    for fault in dict.fromkeys(c.fault for c in costs):
        mine = [c for c in costs if c.fault == fault]
        firsts = [c.first_step_s for c in mine if c.first_step_s is not None]
        first = _fmt(statistics.median(firsts)) if firsts else "-"
        recomputed = sum(c.recomputed or 0 for c in mine)
        print(f"{fault:<19}{len(mine):>4}{first:>18}{recomputed:>12}")
    print("\nchecks:")
    for i, c in enumerate(costs, 1):
        if c.check_note:
            print(f"  {i:>2} {c.fault:<19} {c.check_note}")


def _yes(value: bool) -> str:
    return "yes" if value else "no"


def main() -> None:
    args = _args()
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # cleaned up as on Ctrl-C
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
            sb = Sandbox(root, nodes=8, pull_s=args.pull_seconds,
                         backoff_s=args.crash_backoff_seconds, own_operator=True)  # fmt: skip
            try:
                costs, ok = run_suite(sb, args)
            finally:
                sb.close()
            failed = [c.fault for c in costs if c.lost_s is None or c.check is False]
            if failed or len(costs) < len(args.faults):
                print(f"not survived or failed their check: {', '.join(failed)}")
            sys.exit(0 if ok and not failed and len(costs) == len(args.faults) else 1)
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
