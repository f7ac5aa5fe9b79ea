"""Warm trainer starts (omni_trainer.warm): a real zygote imports the trainer once and forks
each worker; the stand-in torchrun watches passes its arguments, environment, working directory
and streams, forwards signals, and ends as its worker ended; neither outlives the other."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from omni_trainer.launch import warm_torchrun_argv
from omni_trainer.warm import SOCKET_ENV, through_zygote, unsafe_to_fork, zygote_for_run

ROOT = Path(__file__).resolve().parents[3]
STAND_IN = [sys.executable, "-m", "omni_trainer.warm"]


class Zygote:
    def __init__(self, tmp: Path) -> None:
        self.socket = tmp / "warm.sock"
        self.log = tmp / "zygote.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen([*STAND_IN, "--zygote", str(self.socket)],
                                         stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
        _wait("the zygote listening", self.socket.exists, timeout=30)  # before its imports

    def forks(self) -> list[str]:
        return [x for x in self.log.read_text().splitlines() if "omni warm: forked" in x]

    def workers(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children()


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Zygote]:
    z = Zygote(tmp_path_factory.mktemp("zygote"))
    yield z
    z.proc.kill()
    z.proc.wait()


def _job(tmp: Path, steps: int) -> Path:
    """The tiny job in ``tmp`` as job.yaml, ``steps`` long (a relative path the worker finds
    only in the stand-in's working directory)."""
    text = (ROOT / "examples/tiny-cpu.yaml").read_text()
    assert "steps: 150" in text
    (tmp / "job.yaml").write_text(text.replace("steps: 150", f"steps: {steps}"))
    return tmp / "job.yaml"


def _stand_in(args: list[str], cwd: Path, zygote: Zygote | None, **kw) -> subprocess.Popen[str]:
    env = {**os.environ, "OMNI_WARM_TEST": "passed"}
    env.pop(SOCKET_ENV, None)
    if zygote is not None:
        env[SOCKET_ENV] = str(zygote.socket)
    return subprocess.Popen([*STAND_IN, *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)  # fmt: skip


def test_a_forked_worker_runs_the_command_line_as_the_stand_in_would(
    zygote: Zygote, tmp_path: Path
) -> None:
    """Exit code, streams and working directory are the stand-in's, the work the zygote's."""
    _job(tmp_path, steps=3)
    bad = _stand_in(["validate", "missing.yaml"], tmp_path, zygote)
    out, err = bad.communicate(timeout=120)  # the first request waits for the imports
    assert bad.returncode == 2 and "missing.yaml: no such file" in err, (out, err)
    ok = _stand_in(["validate", "job.yaml"], tmp_path, zygote)
    out, err = ok.communicate(timeout=60)
    assert ok.returncode == 0 and "valid OmniTrainingJob 'tiny-cpu'" in out, (out, err)
    assert (
        len(zygote.forks()) == 2
        and f"for process {ok.pid}: cli validate job.yaml" in (zygote.forks()[-1])
    )
    assert not zygote.workers()  # each ended and was reaped


def test_without_a_zygote_the_stand_in_runs_the_trainer_itself(tmp_path: Path) -> None:
    _job(tmp_path, steps=3)
    for env in ({}, {SOCKET_ENV: str(tmp_path / "none.sock")}):  # unset, or nobody listens
        cold = subprocess.run([*STAND_IN, "validate", "job.yaml"], cwd=tmp_path, text=True,
                              capture_output=True, env={**os.environ, **env},
                              timeout=60)  # fmt: skip
        assert cold.returncode == 0 and "valid OmniTrainingJob" in cold.stdout, cold.stderr


SCRIPT = """
import json, os, sys
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "name": __name__, "file": __file__,
                  "cwd": os.getcwd(), "parent": os.getppid()}))
"""


def test_a_script_entry_runs_the_file_as_python_would(zygote: Zygote, tmp_path: Path) -> None:
    """``--entry=script FILE ARGS``, forked or cold, sees what ``python FILE ARGS`` sees."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub/show.py").write_text(SCRIPT)
    runs = {}
    script = [*STAND_IN, "--entry=script", "sub/show.py", "a", "b"]
    python = [sys.executable, "sub/show.py", "a", "b"]
    for how, cmd, z in (
        ("python", python, None),
        ("cold", script, None),
        ("forked", script, zygote),
    ):
        env = {**os.environ}
        env.pop(SOCKET_ENV, None)
        if z is not None:
            env[SOCKET_ENV] = str(z.socket)
        done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stderr
        runs[how] = json.loads(done.stdout)
    assert runs["forked"].pop("parent") == zygote.proc.pid
    assert runs["cold"].pop("parent") == runs["python"].pop("parent") == os.getpid()
    assert runs["forked"] == runs["cold"] == runs["python"], runs
    assert runs["python"]["argv"] == ["sub/show.py", "a", "b"]
    # another import path (a second source tree): the zygote's code is not its code, so cold
    path = f"{os.environ.get('PYTHONPATH', '')}{os.pathsep}{tmp_path}"
    other = {**os.environ, SOCKET_ENV: str(zygote.socket), "PYTHONPATH": path}
    done = subprocess.run(script, cwd=tmp_path, env=other, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert json.loads(done.stdout)["parent"] == os.getpid(), done.stderr
    assert "starts cold (its Python and PYTHONPATH" in zygote.log.read_text()
    missing = subprocess.run([*STAND_IN, "--entry=script"], capture_output=True, text=True)
    assert missing.returncode == 2 and "needs the file to run" in missing.stderr


def test_an_owned_zygote_stops_serving_when_its_owner_ends(tmp_path: Path) -> None:
    """``--owner PID``: once the owner ended the socket is gone (a stand-in started later runs
    cold), the worker forked before runs to its end, its stand-in learns its exit code, and
    then the zygote exits."""
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    sock = tmp_path / "warm.sock"
    log = tmp_path / "zygote.log"
    with log.open("wb") as err:
        z = subprocess.Popen([*STAND_IN, "--zygote", str(sock), f"--owner={owner.pid}", "--quiet"],
                             stderr=err)  # fmt: skip
    started = [owner, z]
    try:
        _wait("the zygote listening", sock.exists, timeout=30)  # before its imports
        flag = tmp_path / "go"
        script = tmp_path / "slow.py"
        script.write_text(f"import os, pathlib, sys, time\n"
                          f"while not pathlib.Path({str(flag)!r}).exists(): time.sleep(0.05)\n"
                          f"print(os.getppid()); sys.exit(5)\n")  # fmt: skip
        env = {**os.environ, SOCKET_ENV: str(sock)}
        run = subprocess.Popen([*STAND_IN, "--entry=script", str(script)], env=env,
                               stdout=subprocess.PIPE, text=True)  # fmt: skip
        started.append(run)
        _wait("the worker forked", lambda: psutil.Process(z.pid).children(), timeout=120)
        owner.kill()
        owner.wait()
        _wait("the socket gone", lambda: not sock.exists(), timeout=10)
        assert z.poll() is None  # its worker still runs
        flag.write_text("")
        out, _ = run.communicate(timeout=30)
        assert run.returncode == 5 and int(out) == z.pid
        assert z.wait(timeout=10) == 0
        assert "forked" not in log.read_text()  # --quiet
    finally:
        for proc in started:
            proc.kill()
            proc.wait()


def test_a_run_zygote_is_the_given_one_or_its_own(
    zygote: Zygote, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``zygote_for_run``: a listening zygote named in the environment serves as it is; else one
    of this process's own serves the run (torchrun and its workers fork from it) and is gone,
    with its socket's directory, after the run."""
    monkeypatch.setenv(SOCKET_ENV, str(zygote.socket))
    with zygote_for_run() as env:
        assert env == {}
    monkeypatch.setenv(SOCKET_ENV, str(tmp_path / "stale.sock"))  # nobody listens there
    (tmp_path / "show.py").write_text(
        SCRIPT.replace("print(", f"open({str(tmp_path)!r} + '/' + os.environ['RANK'], 'w').write(")
    )
    with zygote_for_run() as env:
        assert list(env) == [SOCKET_ENV] and env[SOCKET_ENV] != os.environ[SOCKET_ENV]
        (own,) = [p for p in psutil.Process().children() if env[SOCKET_ENV] in p.cmdline()]
        assert f"--owner={os.getpid()}" in own.cmdline()
        cmd = warm_torchrun_argv(2, "--entry=script", str(tmp_path / "show.py"))
        done = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True,
                              timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
    assert not own.is_running() and not Path(env[SOCKET_ENV]).parent.exists()
    for rank in ("0", "1"):
        shown = json.loads((tmp_path / rank).read_text())
        assert shown["parent"] == own.pid and shown["name"] == "__main__", shown


ENDINGS = {
    "returns": ("pass", 0, ""),
    "exits": ("sys.exit(7)", 7, ""),
    "exits with a message": ("sys.exit('no data')", 1, "no data"),
    "raises": ("raise ValueError('boom')", 1, "ValueError: boom"),
    "is interrupted": ("raise KeyboardInterrupt", -signal.SIGINT, "KeyboardInterrupt"),
}


@pytest.mark.parametrize("ending", sorted(ENDINGS))
def test_a_forked_worker_ends_as_an_interpreter_would(ending: str, tmp_path: Path) -> None:
    """The child skips the interpreter's teardown (a copy of the zygote's pages) but not what
    an exit does: its exit status, a traceback, non-daemon threads finished (an executor's idle
    worker told to end first), atexit handlers run, buffered output written."""
    body, code, err = ENDINGS[ending]
    script = f"""
import atexit, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from omni_trainer.warm import run_then_exit

def late():
    time.sleep(0.5)
    Path({str(tmp_path / "thread")!r}).write_text("done")

POOL = ThreadPoolExecutor(1)  # kept, with an idle worker, as a checkpoint writer keeps one

def main():
    threading.Thread(target=late).start()
    POOL.submit(print, end="")
    atexit.register(lambda: print("atexit ran"))
    print("buffered", end="")
    {body}

run_then_exit(main)
print("never")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == code, done.stderr
    assert done.stdout == "bufferedatexit ran\n" and err in done.stderr, done
    assert (tmp_path / "thread").read_text() == "done"


def _wait(what: str, check, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_signals_pass_and_neither_outlives_the_other(zygote: Zygote, tmp_path: Path) -> None:
    """SIGTERM reaches the trainer, which stops gracefully (exit 143); a SIGKILLed stand-in
    takes its worker with it; a SIGKILLed worker ends its stand-in by the same signal."""
    _job(tmp_path, steps=100000)
    train = ["train", "job.yaml"]

    run = _stand_in(train, tmp_path, zygote)
    _wait("a worker", lambda: zygote.workers())
    (worker,) = zygote.workers()
    assert worker.environ().get("OMNI_WARM_TEST") != "passed"  # /proc shows the zygote's start
    time.sleep(3)  # into training
    run.send_signal(signal.SIGTERM)
    _, err = run.communicate(timeout=120)
    assert run.returncode == 143, err[-2000:]

    run = _stand_in(train, tmp_path, zygote)
    _wait("a worker", lambda: zygote.workers())
    (worker,) = zygote.workers()
    run.kill()
    run.wait()
    _wait("the worker gone", lambda: not zygote.workers(), timeout=10)

    run = _stand_in(train, tmp_path, zygote)
    _wait("a worker", lambda: zygote.workers())
    zygote.workers()[0].kill()
    run.communicate(timeout=30)
    assert run.returncode == -signal.SIGKILL  # as torchrun would see its own worker killed


@pytest.mark.parametrize("request_", [{"args": []}, {"entry": "nothing", "args": [], "env": {},
                                      "cwd": "/", "pid": 1}, "not json", 5])  # fmt: skip
def test_a_malformed_request_is_refused_and_its_streams_released(
    zygote: Zygote, tmp_path: Path, request_: object
) -> None:
    """A request missing a key, naming no entry, not JSON or not an object: the zygote says so,
    keeps none of the three descriptors that came with it, and serves the next request."""
    served = _stand_in(["validate", "nothing.yaml"], tmp_path, zygote)
    served.communicate(timeout=120)  # the imports are done: descriptors now are the zygote's own
    held = len(os.listdir(f"/proc/{zygote.proc.pid}/fd"))
    refusals = zygote.log.read_text().count("omni warm: a bad request")  # earlier cases' too
    body = (request_ if isinstance(request_, str) else json.dumps(request_)).encode()
    streams = [os.open(os.devnull, os.O_RDWR) for _ in range(3)]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(zygote.socket))
        socket.send_fds(sock, [struct.pack("!q", len(body))], streams)
        for fd in streams:
            os.close(fd)
        sock.sendall(body)
        assert sock.recv(16) == b""  # closed without an answer
    _wait("the refusal", lambda: zygote.log.read_text().count("omni warm: a bad request")
          > refusals, 30)  # fmt: skip
    assert len(os.listdir(f"/proc/{zygote.proc.pid}/fd")) == held
    again = _stand_in(["validate", "nothing.yaml"], tmp_path, zygote)
    _, err = again.communicate(timeout=60)
    assert again.returncode == 2 and "nothing.yaml: no such file" in err, err


def test_forking_is_declined_beside_another_thread() -> None:
    fresh = "from omni_trainer.warm import unsafe_to_fork; print(unsafe_to_fork())"
    alone = subprocess.run([sys.executable, "-c", fresh], capture_output=True, text=True,
                           check=True)  # fmt: skip
    assert alone.stdout.strip() == "None"  # a new process (this one runs other tests' threads)
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    before = threading.active_count()
    t.start()
    try:
        assert f"{before + 1} Python threads run" in (unsafe_to_fork() or "")
    finally:
        stop.set()
        t.join()


def test_torchrun_is_started_as_a_stand_in_and_other_commands_as_they_are() -> None:
    args = ["--nnodes=2", "-m", "omni_trainer.warm", "train", "job.yaml"]
    warm = [*STAND_IN, "--entry=torchrun", *args]
    assert through_zygote(["torchrun", *args]) == warm
    assert through_zygote(["/usr/bin/torchrun", *args]) == warm
    assert through_zygote([sys.executable, "-m", "torch.distributed.run", *args]) == warm
    assert through_zygote(["python", "train.py"]) == ["python", "train.py"]


def test_torchrun_and_its_workers_fork_from_the_zygote(zygote: Zygote, tmp_path: Path) -> None:
    """The whole tree a supervisor starts: torchrun (a stand-in) and its workers (stand-ins),
    both forked; the job trains to the end and exits 0."""
    _job(tmp_path, steps=2)
    before = len(zygote.forks())
    cmd = through_zygote(["torchrun", "--standalone", "--nproc-per-node=2", "-m",
                          "omni_trainer.warm", "train", "job.yaml"])  # fmt: skip
    run = _stand_in(cmd[3:], tmp_path, zygote)
    _, err = run.communicate(timeout=300)
    assert run.returncode == 0, err[-3000:]
    forks = zygote.forks()[before:]
    assert [f.split(": ", 2)[-1].split()[0] for f in forks] == ["torchrun", "cli", "cli"], forks


def test_a_trainer_stopped_with_its_zygote_restarts_without_waiting(tmp_path: Path) -> None:
    """A hang as the sandbox makes one (every process but the supervisor SIGSTOPped, the zygote
    included): the next attempt kills the trainer, continues the zygote so it reaps its dead
    children, and starts forked again within seconds (it used to wait out 30 s for zombies)."""
    from omni_trainer.failure_report import FailureReport
    from omni_trainer.pod_protocol import order
    from omni_trainer.supervisor import Supervisor, read_int

    _job(tmp_path, steps=100000)
    (tmp_path / "attempt").write_text(order(0, pods=0))
    state = tmp_path / "state"
    sup = Supervisor([*STAND_IN, "train", str(tmp_path / "job.yaml")], state_dir=state,
                     attempt_file=tmp_path / "attempt", poll_s=0.05, warm=True,
                     report=FailureReport(0, "127.0.0.1").start())  # fmt: skip
    seen: dict[str, float] = {}

    def workers() -> list[psutil.Process]:
        out = []
        for p in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if p.parent() and "--zygote" in p.parent().cmdline():
                    out.append(p)
        return out

    def operator() -> None:
        _wait("a forked worker", workers)
        old = {p.pid for p in workers()}
        time.sleep(2)
        for p in psutil.Process().children(recursive=True):  # the hang, of this pod only
            with contextlib.suppress(psutil.Error):
                if str(tmp_path) in " ".join(p.cmdline()):
                    p.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        (tmp_path / "attempt").write_text(order(1, pods=0))

        def new_worker() -> bool:
            with contextlib.suppress(psutil.Error):
                return read_int(state / "ran-attempt") == 1 and any(
                    p.pid not in old and p.status() != psutil.STATUS_ZOMBIE for p in workers()
                )
            return False

        try:
            _wait("attempt 1 forked", new_worker)
        finally:
            seen["restart_s"] = time.monotonic() - t0
            os.kill(os.getpid(), signal.SIGTERM)  # the pod deleted: the trainer stops

    thread = threading.Thread(target=operator)
    thread.start()
    code = sup.run()
    thread.join()
    assert code == 143 and seen["restart_s"] < 10, seen
