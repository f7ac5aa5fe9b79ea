"""The in-pod supervisor (``omni supervise``): restarts the trainer inside its pod.

With ``restartPolicy.mode: in-place`` every trainer pod runs ``omni supervise -- torchrun ...``
as its container's first process. The operator says which restart attempt should run in each
pod's order annotation (a downwardAPI volume projects it as the file :data:`ATTEMPT_KEY`; the
kubelet rewrites it when the operator updates the pod); each pod's supervisor watches that
file and, when it names a newer attempt than the one it started, kills its trainer (hung or
still running beside a crashed peer) and starts the new attempt, which resumes from the latest
checkpoint. Every pod thus restarts together without a pod being deleted, scheduled, pulled or
its container recreated.

When its own trainer fails and no newer attempt is ordered yet, the supervisor reports it:
- with ``--report-port`` (pods of this operator version), over HTTP from the running container
  (:mod:`omni_trainer.failure_report`: the pod turns unready, the operator reads the failure), and
  waits for the operator's next attempt. The container, and what it holds, outlives the failure:
  no container restart, no crash back-off;
- without it, by exiting with the trainer's code: the container terminates (the operator sees
  it in the pod's status), the kubelet restarts the container under the pod's ``restartPolicy:
  OnFailure``, and the new supervisor waits for the next attempt (what it ran is kept in an
  emptyDir that outlives the container).
Either report's message starts with ``[attempt N]``, so the operator tells a failure of the
current attempt from a late echo of an older one. SIGTERM (the pod deleted) goes to the trainer,
which stops gracefully.

With ``--warm`` the supervisor keeps a pre-imported trainer beside it (:mod:`omni_trainer.warm`,
a zygote started with the container) and tells each attempt's workers to fork from it: an
in-place restart, whose container lives on, starts its workers without importing torch again.

A hot spare (``spec.spareNodes``) runs the supervisor with ``--standby``: it warms the node
(its zygote imports the trainer once; without ``--warm`` a throwaway process does, so the
image's files are in the page cache and known to import) and waits until the operator's order
names its pod (:data:`SPARES_KEY`) with the node rank it takes over; then it starts the
trainer with that rank's environment, and the survivors restart in
place with it. The spare's pod was scheduled, pulled and started long before: no scheduling
round trip when a node is lost.

The order's keys, the attempt's environment and the message tags are the operator<->pod protocol,
declared in :mod:`omni_trainer.pod_protocol`. The supervisor imports no torch: it is the
container's init and must stay small.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from omni_trainer import termination, warm
from omni_trainer.failure_report import FailureReport, failure
from omni_trainer.pod_protocol import (
    ATTEMPT_ENV,
    RANK_ENV,
    SAME_NODES_ENV,
    Target,
    rdzv_id,
    read_target,
    tag,
)

RAN_FILE = "ran-attempt"
TRAINER_MESSAGE = "trainer-termination-log"
WARM_IMPORTS = "import omni_trainer.trainer"
"""What a standby without a zygote imports once (torch, megatron-core, the trainer)."""
POLL_S = 0.2
RDZV_ERROR_FILE = "torchrun-error.json"
"""In the state directory: torchrun's own error (``TORCHELASTIC_ERROR_FILE``, written by its
``@record`` main when the agent, not a worker, fails)."""
RDZV_RETRIES = 5
RDZV_RETRY_PAUSE_S = 1.0

Action = Literal["start", "restart", "wait", "exit"]


def decide(*, target: int | None, ran: int | None, running: bool, exit_code: int | None) -> Action:
    """What the supervisor does next (pure).

    Args:
        target: the attempt the operator wants (None: the file is not there yet).
        ran: the attempt this pod last started (None: none, a fresh pod).
        running: a trainer runs in this container.
        exit_code: the exit code of this container's trainer when it ended (None: none ended).
    """
    newer = target is not None and (ran is None or target > ran)
    if running:
        return "restart" if newer and ran is not None else "wait"
    if exit_code == 0:
        return "exit"  # trained to the end
    if newer:
        return "start"
    return "exit" if exit_code is not None else "wait"


def for_target(command: Sequence[str], target: Target) -> list[str]:
    """``command`` for the ordered attempt: torchrun's ``--node-rank`` set to the rank a spare
    is given (unchanged without one) and its ``--rdzv-id`` to the attempt. A survivor's new
    torchrun can reach the rank-0 store of the attempt before (that pod's supervisor has not
    killed its torchrun yet); with the attempt's own key prefix it waits there for this
    attempt's peers, and fails when that store goes, instead of completing its rendezvous on
    the old attempt's keys and hanging in a worker group rank 0 never joins."""
    rank = target.env.get(RANK_ENV)
    out = []
    for w in command:
        if rank is not None and w.startswith("--node-rank="):
            w = f"--node-rank={rank}"
        elif w.startswith("--rdzv-id="):
            w = f"--rdzv-id={rdzv_id(target.attempt)}"
        out.append(w)
    return out


def failed_in_rendezvous(error_file: Path) -> bool:
    """Whether torchrun's error file says its agent failed in its rendezvous, before any
    worker started: a peer's torchrun of the attempt before still served the store, and closed
    it (an in-place restart's new agent can reach it first). A worker's error, copied there by
    torchrun, never has the agent's ``_rendezvous`` frame."""
    try:
        doc = json.loads(error_file.read_text())
        stack = str(doc["message"]["extraInfo"]["py_callstack"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return "elastic/agent/server/api.py" in stack and "in _rendezvous" in stack


def read_int(path: Path) -> int | None:
    """An integer file (the state file); None when missing or partial."""
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _become_subreaper() -> None:
    """Orphaned trainer workers (their torchrun died) reparent to us, so a restart finds and
    kills them (PR_SET_CHILD_SUBREAPER; as a container's PID 1 we are their reaper anyway)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)


def _descendants() -> list[int]:
    """Every live process below this one (children of children included; a zombie is dead,
    its parent reaps it)."""
    import psutil

    out = []
    with contextlib.suppress(psutil.Error):
        for p in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p.pid)
    return out


def _reap(keep: Sequence[int]) -> None:
    """Collect exited orphans (zombies reparented to us), but never ``keep``: our own children's
    statuses belong to their Popens (reaped here, they would read as exit 0)."""
    import psutil

    with contextlib.suppress(psutil.Error):
        for child in psutil.Process().children():
            if child.pid not in keep:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(child.pid, os.WNOHANG)


@dataclass
class Supervisor:
    """Runs ``command`` for the attempt in ``attempt_file`` (see the module docstring)."""

    command: Sequence[str]
    attempt_file: Path
    state_dir: Path
    pods: int = 0
    """The attempt that created this pod (its ``OMNI_RESTART_ATTEMPT``)."""
    poll_s: float = POLL_S
    pod: str | None = None
    """This pod's name (a spare is addressed by it)."""
    standby: bool = False
    """A hot spare: warm the node, start nothing until an order names this pod."""
    report: FailureReport | None = None
    """Report a failed attempt over HTTP and keep the container (None: exit); started."""
    warm: bool = False
    """Keep a zygote (:mod:`omni_trainer.warm`) the trainer's workers fork from."""
    _zygote: subprocess.Popen[bytes] | None = None
    _rdzv_retries: int = 0
    _termed: subprocess.Popen[bytes] | None = None
    _proc: subprocess.Popen[bytes] | None = None
    _stopping: bool = False

    @property
    def _ran_file(self) -> Path:
        return self.state_dir / RAN_FILE

    @property
    def _message_file(self) -> Path:
        return self.state_dir / TRAINER_MESSAGE

    def run(self) -> int:
        """Supervise until the trainer succeeds, fails without a newer attempt, or is stopped;
        the exit code is the trainer's."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        _become_subreaper()
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        if self.warm:
            self._keep_warm()
        elif self.standby and read_int(self._ran_file) is None:
            print(f"omni supervise: standby {self.pod}: warming ({WARM_IMPORTS})", flush=True)
            subprocess.Popen([sys.executable, "-c", WARM_IMPORTS])  # reaped as an orphan
        try:
            return self._loop()
        finally:
            signal.signal(signal.SIGTERM, previous)
            if self._zygote is not None and self._zygote.poll() is None:
                self._zygote.kill()  # (a container's end kills it anyway)
                self._zygote.wait()
            if self.report is not None:
                self.report.stop()

    def _loop(self) -> int:
        exit_code: int | None = None
        while True:
            _reap(self._own())
            running = self._proc is not None and self._proc.poll() is None
            if self._proc is not None and not running:
                code = self._proc.returncode
                exit_code, self._proc = (128 - code if code < 0 else code), None  # as a runtime
                self._kill_all()  # workers that outlived their torchrun
                if exit_code and not self._stopping and self._retry_rendezvous():
                    exit_code = None
                    continue
            if self._stopping:  # SIGTERM went to the trainer: wait for it, start nothing
                if not running:
                    return self._finish(exit_code if exit_code is not None else 143)
                self._term(self._proc)  # one started while the signal came (in _start)
                time.sleep(self.poll_s)
                continue
            target = self._target()
            action = decide(
                target=target.attempt if target is not None else None,
                ran=read_int(self._ran_file),
                running=running,
                exit_code=exit_code,
            )
            if action == "exit":
                assert exit_code is not None
                if exit_code == 0 or self.report is None:
                    return self._finish(exit_code)
                self._report_failure(exit_code)
                exit_code = None  # reported: wait for the operator's next attempt
            if action in ("start", "restart"):
                if running:
                    self._kill_all()
                    self._wait_gone()
                exit_code = None
                assert target is not None
                self._rdzv_retries = 0
                self._start(target)
            time.sleep(self.poll_s)

    def _target(self) -> Target | None:
        return read_target(self.attempt_file, pods=self.pods, pod=self.pod, standby=self.standby)

    @property
    def _socket(self) -> Path:
        return self.state_dir / warm.SOCKET_NAME

    def _own(self) -> list[int]:
        """Our children with a Popen: the trainer's torchrun and the zygote."""
        return [p.pid for p in (self._proc, self._zygote) if p is not None]

    def _keep_warm(self) -> bool:
        """Keep a zygote running (another if it died: it imports while the attempt starts);
        False once one declined to fork here (the workers start cold)."""
        z = self._zygote
        if z is not None and z.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(z.pid, signal.SIGCONT)  # stopped with a hung trainer: serve again
            return True
        if z is not None and z.returncode == warm.DECLINED:
            return False
        if z is not None:
            print(f"omni supervise: the zygote ended (code {z.returncode}); starting another",
                  flush=True)  # fmt: skip
        self._socket.unlink(missing_ok=True)  # the container before's
        self._zygote = subprocess.Popen(warm.zygote_command(self._socket))
        warm.await_listening(self._zygote, self._socket)
        return True

    def _retry_rendezvous(self) -> bool:
        """Start the attempt again if its torchrun failed in the rendezvous (no worker ran, so
        nothing is lost) and it is still the one ordered: up to :data:`RDZV_RETRIES` times."""
        target = self._target()
        same = target is not None and target.attempt == read_int(self._ran_file)
        if not same or self._rdzv_retries >= RDZV_RETRIES:
            return False
        if not failed_in_rendezvous(self.state_dir / RDZV_ERROR_FILE):
            return False
        self._rdzv_retries += 1
        print(f"omni supervise: attempt {target.attempt}: torchrun failed in its rendezvous; "
              f"again ({self._rdzv_retries} of {RDZV_RETRIES})", flush=True)  # fmt: skip
        time.sleep(RDZV_RETRY_PAUSE_S)
        self._start(target)
        return True

    def _start(self, target: Target) -> None:
        attempt = target.attempt
        if self.report is not None:
            self.report.set(None)
        self._message_file.write_bytes(b"")
        env = {
            **os.environ,
            **target.env,
            ATTEMPT_ENV: str(attempt),
            SAME_NODES_ENV: "1" if attempt != self.pods and not target.fresh else "0",
            termination.ENV: str(self._message_file),
            "TORCHELASTIC_ERROR_FILE": str(self.state_dir / RDZV_ERROR_FILE),
        }
        (self.state_dir / RDZV_ERROR_FILE).unlink(missing_ok=True)
        command = for_target(self.command, target)
        env.pop(warm.SOCKET_ENV, None)  # a zygote outside this container: not the pod's to use
        if self.warm and self._keep_warm():
            env[warm.SOCKET_ENV] = str(self._socket)
            command = warm.through_zygote(command)
        self._ran_file.write_text(f"{attempt}\n")
        print(f"omni supervise: starting attempt {attempt}: {' '.join(command)}", flush=True)
        self._proc = subprocess.Popen(command, env=env)

    def _on_sigterm(self, signum: int, frame: object) -> None:
        """The pod is deleted: the trainer gets SIGTERM and stops gracefully."""
        self._stopping = True
        self._term(self._proc)

    def _term(self, proc: subprocess.Popen[bytes] | None) -> None:
        """SIGTERM to ``proc``, once (a trainer started as the signal came gets it here)."""
        if proc is not None and proc is not self._termed and proc.poll() is None:
            self._termed = proc
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)

    def _trainer_processes(self) -> list[int]:
        """Every process below us but the zygote (its forked workers included)."""
        zygote = self._zygote.pid if self._zygote is not None else None
        return [pid for pid in _descendants() if pid != zygote]

    def _kill_all(self) -> None:
        for pid in self._trainer_processes():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if self._zygote is not None:  # stopped with a hung trainer, it must reap its children
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._zygote.pid, signal.SIGCONT)

    def _wait_gone(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        keep = [self._zygote.pid] if self._zygote is not None else []
        while self._trainer_processes() and time.monotonic() < deadline:
            _reap(keep)  # the killed trainer's torchrun included
            time.sleep(0.05)
        self._proc = None

    def _message(self, code: int) -> str:
        """The trainer's termination message, tagged with its attempt when it failed."""
        message = ""
        with contextlib.suppress(OSError):
            message = self._message_file.read_text(errors="replace").strip()
        ran = read_int(self._ran_file)
        if code != 0 and ran is not None:
            message = tag(ran, message or f"the trainer exited with code {code}")
        return message

    def _report_failure(self, code: int) -> None:
        """The attempt failed: the pod turns unready and tells the operator why."""
        assert self.report is not None
        ran = read_int(self._ran_file)
        self.report.set(failure(ran if ran is not None else self.pods, code, self._message(code)))
        print(f"omni supervise: attempt {ran} failed (exit code {code}); reported, waiting for "
              "the operator's next attempt", flush=True)  # fmt: skip

    def _finish(self, code: int) -> int:
        """The container's termination message: the trainer's, tagged when it failed."""
        message = self._message(code)
        if message:
            termination.report(message)
        return code
