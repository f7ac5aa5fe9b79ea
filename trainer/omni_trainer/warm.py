"""Warm trainer starts: a process that imported the trainer once forks each trainer worker.

Every trainer process pays for its imports (torch, megatron-core, transformers; on GPUs also
TransformerEngine and the CUDA libraries) at each start: about 7 s of CPU per process on this
project's CPU machine, more on a GPU node. An in-place restart keeps the container, so the in-pod
supervisor keeps a *zygote* in it: ``python -m omni_trainer.warm --zygote SOCKET`` imports the
trainer before any attempt needs it and then serves fork requests on a Unix socket.

torchrun starts each worker as ``python -m omni_trainer.warm ARGS``, a small process that
imports no torch (``--entry=script FILE ARGS`` stands in for ``python FILE ARGS``). With
:data:`SOCKET_ENV` set (the supervisor sets it) it hands its arguments, environment, working
directory and standard streams to the zygote, which forks a child that runs ``omni_trainer.cli
ARGS`` with them. The small process stands in for the child under torchrun: it forwards
signals, and it ends as the child ended (its exit code, or the signal that killed it). Without a
zygote (none set, none running, or it declined) it runs the trainer itself, exactly as ``python
-m omni_trainer.cli ARGS`` would. The supervisor starts torchrun itself the same way
(``--entry=torchrun``, :func:`through_zygote`): its agent imports torch too. A local ``omni train
--nproc N`` starts a zygote of its own for the run (:func:`zygote_for_run`), which stops serving
when the run's process ends (``--owner``).

Forking is safe because the zygote only imported modules: before each fork it checks that it
runs no other Python thread and holds no CUDA context (otherwise it declines, and the workers
start cold). A child whose stand-in dies (torchrun killed it) kills itself at once, so no worker
outlives the process torchrun watches, and a child that ends skips the interpreter's teardown
(:func:`run_then_exit`), so its stand-in ends with it. Standard library only, outside the
zygote's imports.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import importlib
import json
import os
import runpy
import select
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

SOCKET_ENV = "OMNI_WARM_SOCKET"
"""The zygote's socket, in a trainer worker's environment (none: start cold)."""
SOCKET_NAME = "warm.sock"
WARM_IMPORTS = ("omni_trainer.cli", "omni_trainer.trainer", "torch.distributed.run")
"""What the zygote imports once: the command line, everything training imports, torchrun."""
LISTEN_S = 5.0
"""How long a new zygote may take to listen (it listens before it imports) before the workers
started meanwhile start cold."""
DECLINED = 3
"""The zygote's exit code when forking would be unsafe here: the supervisor starts no other."""
MODULES = {"cli": ("omni_trainer.cli", "app"), "torchrun": ("torch.distributed.run", "main")}
"""Module entries: module and function (what ``python -m`` of the module calls)."""
SCRIPT = "script"
"""The entry that runs a file as ``python FILE ARGS`` would (the file is the first argument)."""
ENTRIES = (*MODULES, SCRIPT)
"""What a stand-in can run."""
_HEADER = struct.Struct("!cq")  # a message: kind (P: child pid, X: wait status, D: declined)
_STDIO = (0, 1, 2)
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def connectable(path: Path) -> str:
    """``path`` as ``bind``/``connect`` take it: Unix socket paths are limited to 107 bytes, so
    a longer one is reached through its directory's descriptor (``/proc/self/fd/N/NAME``)."""
    if len(os.fsencode(path)) < 100:
        return str(path)
    fd = os.open(path.parent, os.O_PATH)  # held for the process's life: the alias needs it
    return f"/proc/self/fd/{fd}/{path.name}"


# -- the zygote ---------------------------------------------------------------------------------
def zygote_command(path: Path, *, owner: int | None = None, quiet: bool = False) -> list[str]:
    """The command line of a zygote serving on ``path`` (``owner``: until that pid ends)."""
    extra = ([f"--owner={owner}"] if owner is not None else []) + (["--quiet"] if quiet else [])
    return [sys.executable, "-m", "omni_trainer.warm", "--zygote", str(path), *extra]


def await_listening(zygote: subprocess.Popen[bytes], path: Path) -> bool:
    """Wait up to :data:`LISTEN_S` for a new zygote to listen (its stand-ins then wait for its
    imports); False: it ended or is slow to start, and the workers started now start cold."""
    deadline = time.monotonic() + LISTEN_S
    while not path.exists() and zygote.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return path.exists()


@contextlib.contextmanager
def zygote_for_run() -> Iterator[dict[str, str]]:
    """The environment under which the stand-ins started inside fork from a zygote: nothing to
    add when :data:`SOCKET_ENV` names a listening one already, else a quiet zygote of this
    process's own (stopped on leaving; if this process dies first, it stops serving)."""
    given = os.environ.get(SOCKET_ENV)
    if given and _is_socket(Path(given)):
        yield {}
        return
    with tempfile.TemporaryDirectory(prefix="omni-warm-") as tmp:
        path = Path(tmp) / SOCKET_NAME
        zygote = subprocess.Popen(zygote_command(path, owner=os.getpid(), quiet=True))
        try:
            yield {SOCKET_ENV: str(path)} if await_listening(zygote, path) else {}
        finally:
            zygote.terminate()
            try:
                zygote.wait(timeout=10)
            except subprocess.TimeoutExpired:
                zygote.kill()
                zygote.wait()


def _is_socket(path: Path) -> bool:
    try:
        return stat.S_ISSOCK(path.stat().st_mode)
    except OSError:
        return False


def unsafe_to_fork() -> str | None:
    """Why a fork now would hand a child broken state (None: safe)."""
    if threading.active_count() > 1:
        return f"{threading.active_count()} Python threads run"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA was initialised by an import"
    return None


def serve(path: Path, owner: int | None = None, *, quiet: bool = False) -> int:
    """The zygote: listen, import, then fork a worker per request. Returns when forking is
    unsafe (:data:`DECLINED`), or once ``owner`` (a pid) ended and every child it forked did
    (0); a forked child runs its command and exits (:func:`_child`). ``quiet``: no line per
    fork."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # a socket of the container before (the directory outlives it)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(connectable(path))
    listener.listen(64)  # stand-ins queue here while the imports run
    for name in WARM_IMPORTS:
        importlib.import_module(name)
    why = unsafe_to_fork()
    if why is not None:
        print(f"omni warm: not forking trainer workers ({why}): they start cold", file=sys.stderr,
              flush=True)  # fmt: skip
        listener.close()
        path.unlink(missing_ok=True)
        return DECLINED
    gc.freeze()  # the imports' objects: a child's collections leave their pages shared
    children: dict[int, socket.socket] = {}
    ends: dict[int, int] = {}  # child pid -> its pidfd (readable once it ended)
    owner_end = _pidfd(owner) if owner is not None else None  # readable once it ended
    serving = True
    while serving or children:
        watched = [listener, *ends.values()] if serving else list(ends.values())
        if serving and owner_end is not None:
            watched.append(owner_end)
        ready = select.select(watched, [], [], 0.2)[0]
        if serving and listener in ready:
            conn, _ = listener.accept()
            pid = _fork(conn, listener, children, ends, quiet=quiet)
            if pid is not None:
                with contextlib.suppress(OSError):  # without pidfds, the timeout reaps
                    ends[pid] = os.pidfd_open(pid)
        _reap(children)
        for pid in [p for p in ends if p not in children]:
            os.close(ends.pop(pid))
        if serving and owner is not None and (owner_end in ready or not _alive(owner)):
            serving = False  # no new workers; the running ones' stand-ins still learn their end
            listener.close()
            path.unlink(missing_ok=True)
    return 0


def _fork(conn: socket.socket, listener: socket.socket, children: dict[int, socket.socket],
          ends: dict[int, int], *, quiet: bool) -> int | None:  # fmt: skip
    """Serve one request: the forked child's pid (None: none); the child never returns."""
    try:
        conn.settimeout(5.0)
        request, fds = _receive(conn)
        conn.settimeout(None)
    except (OSError, ValueError, KeyError) as err:
        print(f"omni warm: a bad request ({err})", file=sys.stderr, flush=True)
        conn.close()
        return None
    why = unsafe_to_fork() or _foreign(request)
    if why is not None:
        for fd in fds:
            os.close(fd)
        with contextlib.suppress(OSError):
            conn.sendall(_HEADER.pack(b"D", 0))
        conn.close()
        if not quiet:
            print(f"omni warm: process {request['pid']} starts cold ({why})", file=sys.stderr,
                  flush=True)  # fmt: skip
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        listener.close()
        for other in children.values():
            other.close()
        for fd in ends.values():
            os.close(fd)
        conn.close()
        return _child(request, fds)
    for fd in fds:
        os.close(fd)
    children[pid] = conn
    if not quiet:
        print(f"omni warm: forked {pid} for process {request['pid']}: {request['entry']} "
              f"{' '.join(request['args'])}", file=sys.stderr, flush=True)  # fmt: skip
    with contextlib.suppress(OSError):
        conn.sendall(_HEADER.pack(b"P", pid))
    return pid


def _foreign(request: dict[str, Any]) -> str | None:
    """Why the zygote's imports may not be the requester's (another interpreter, or another
    import path: a second source tree's command would run this tree's code); None: the same."""
    ours = (sys.executable, os.environ.get("PYTHONPATH", ""))
    theirs = (request.get("executable"), request["env"].get("PYTHONPATH", ""))
    if theirs != ours:
        return f"its Python and PYTHONPATH {theirs} are not the zygote's {ours}"
    return None


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """A request and its standard streams; a malformed one releases the streams it brought."""
    head, fds, _, _ = socket.recv_fds(conn, 8, len(_STDIO))
    try:
        return _validated(conn, head, fds), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _validated(conn: socket.socket, head: bytes, fds: list[int]) -> dict[str, Any]:
    head += _exactly(conn, 8 - len(head))
    (size,) = struct.unpack("!q", head)
    if len(fds) != len(_STDIO) or not 0 < size < 1 << 24:
        raise ValueError(f"{len(fds)} descriptors, {size} bytes")
    request = json.loads(_exactly(conn, size))
    if not isinstance(request, dict):
        raise ValueError(f"a request is a JSON object, not {type(request).__name__}")
    for key in ("entry", "args", "env", "cwd", "pid"):
        if key not in request:
            raise KeyError(key)
    if request["entry"] not in ENTRIES or (request["entry"] == SCRIPT and not request["args"]):
        raise ValueError(f"no entry {request['entry']!r} with arguments {request['args']!r}")
    return request


def _exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ValueError("the request ended early")
        data += chunk
    return data


def _reap(children: dict[int, socket.socket]) -> None:
    """Tell each ended child's stand-in how it ended (its raw wait status)."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall(_HEADER.pack(b"X", status))
            conn.close()


def _child(request: dict[str, Any], fds: list[int]) -> NoReturn:
    """In the forked child: become the stand-in's trainer process, then run the command line."""
    for target, fd in zip(_STDIO, fds, strict=True):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    _die_with(int(request["pid"]))
    _as_a_new_process()
    run_then_exit(_entry(request["entry"], request["args"], imported=True))


def _entry(entry: str, args: list[str], *, imported: bool) -> Callable[[], object]:
    """What ``python -m MODULE ARGS`` (``python FILE ARGS`` for :data:`SCRIPT`) runs, with
    ``sys.argv`` and ``sys.path[0]`` set as that interpreter would set them. ``imported``: call
    the module's function (the zygote imported it) rather than run the module as ``__main__``."""
    if entry == SCRIPT:
        file = os.path.abspath(args[0])
        sys.argv = list(args)
        sys.path[0] = os.path.dirname(file)
        return lambda: _run_file(file)
    module, function = MODULES[entry]
    sys.argv = [module, *args]
    sys.path[0] = os.getcwd()
    if imported:
        return getattr(importlib.import_module(module), function)
    return lambda: runpy.run_module(module, run_name="__main__", alter_sys=True)


def _run_file(file: str) -> None:
    """Execute ``file`` as the ``__main__`` module (the interpreter's own way, which
    ``runpy.run_path`` is not: it changes ``sys.argv[0]``)."""
    main = types.ModuleType("__main__")
    main.__file__ = file
    sys.modules["__main__"] = main
    with open(file, "rb") as source:
        code = compile(source.read(), file, "exec")
    exec(code, main.__dict__)


def run_then_exit(main: Callable[[], object]) -> NoReturn:
    """Run ``main`` and end the process as an interpreter's exit would (the exit code of its
    ``SystemExit`` or 1 with the traceback; non-daemon threads joined, atexit handlers run,
    streams flushed), but without the interpreter's teardown: in a forked child that frees
    every object the zygote imported, writing a private copy of each of their pages (about
    a second before the stand-in, and torchrun, learn that a failed worker ended)."""
    code, interrupted = 0, False
    try:
        main()
    except SystemExit as stop:
        code = _exit_code(stop.code)
    except BaseException as err:
        sys.excepthook(type(err), err, err.__traceback__)
        code, interrupted = 1, isinstance(err, KeyboardInterrupt)
    # What the interpreter's own exit runs first: threading's exit hooks (they tell executors'
    # idle workers to end), then it joins the non-daemon threads (joining first would wait on
    # such a worker forever).
    threading._shutdown()  # type: ignore[attr-defined]
    with contextlib.suppress(Exception):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if interrupted:  # as Python ends on an uncaught KeyboardInterrupt: killed by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def _exit_code(code: object) -> int:
    """The exit status ``sys.exit(code)`` gives (a non-integer is printed, status 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _as_a_new_process() -> None:
    """What a fresh interpreter would have differently from the zygote's copy: its own random
    seeds (Python's ``random`` reseeds itself at a fork; numpy's and torch's do not) and the
    thread count torchrun asks for (the OpenMP runtime read it when torch loaded)."""
    torch, numpy = sys.modules.get("torch"), sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    if torch is not None:
        torch.seed()
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:
            torch.set_num_threads(int(threads))


def _die_with(pid: int) -> None:
    """Kill this process when ``pid`` (the stand-in torchrun watches) ends."""

    def watch() -> None:
        try:
            fd = os.pidfd_open(pid)
            select.select([fd], [], [])
        except OSError:  # gone already, or no pidfd on this kernel: poll
            while _alive(pid):
                time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="omni-warm-stand-in", daemon=True).start()


def _pidfd(pid: int) -> int | None:
    """A descriptor readable once ``pid`` ended (None: gone already, or no pidfds here)."""
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- the stand-in -------------------------------------------------------------------------------
def through_zygote(command: Sequence[str]) -> list[str]:
    """``command`` with its torchrun started as a stand-in (``torchrun ARGS``, or this
    Python's ``-m torch.distributed.run ARGS``); any other command as it is."""
    if command and Path(command[0]).name == "torchrun":
        rest = command[1:]
    elif len(command) >= 3 and list(command[1:3]) == ["-m", "torch.distributed.run"]:
        rest = command[3:]
    else:
        return list(command)
    return [sys.executable, "-m", "omni_trainer.warm", "--entry=torchrun", *rest]


def stand_in(args: list[str], entry: str = "cli") -> int:
    """The zygote's child runs ``entry`` with ``args``, else this process does."""
    path = os.environ.get(SOCKET_ENV)
    if path:
        code = _hand_over(Path(path), entry, args)
        if code is not None:
            return code
    _entry(entry, args, imported=False)()
    return 0


def _hand_over(path: Path, entry: str, args: list[str]) -> int | None:
    """Run ``args`` in a child of the zygote and end as it ended; None: no zygote took it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(connectable(path))
        request = json.dumps({"entry": entry, "args": args, "env": dict(os.environ),
                              "cwd": os.getcwd(), "pid": os.getpid(),
                              "executable": sys.executable}).encode()  # fmt: skip
        socket.send_fds(sock, [struct.pack("!q", len(request))], _stdio())
        sock.sendall(request)
        kind, pid = _message(sock)  # waits while the zygote still imports
    except OSError:
        sock.close()
        return None
    if kind != b"P":
        sock.close()
        return None  # declined (or died while importing): start cold
    for sig in _FORWARDED:
        signal.signal(sig, lambda signum, _frame: _forward(pid, signum))
    try:
        kind, status = _message(sock)
    except OSError:
        kind = None
    if kind != b"X":  # the zygote died: the child runs on, unwatched by it
        while _alive(pid):
            time.sleep(0.2)
        print("omni warm: lost the trainer's exit status (its zygote died)", file=sys.stderr)
        return 1
    code = os.waitstatus_to_exitcode(status)
    if code < 0:  # killed by a signal: end the same way, so torchrun reports the same
        with contextlib.suppress(OSError, ValueError):  # SIGKILL has no handler to reset
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        time.sleep(1.0)
        return 128 - code
    return code


def _stdio() -> list[int]:
    """This process's standard streams to hand over (/dev/null for a closed one)."""
    out = []
    for fd in _STDIO:
        try:
            os.fstat(fd)
            out.append(fd)
        except OSError:
            out.append(os.open(os.devnull, os.O_RDWR))
    return out


def _message(sock: socket.socket) -> tuple[bytes | None, int]:
    """The zygote's next message; (None, 0) when it closed the connection first."""
    try:
        kind, value = _HEADER.unpack(_exactly(sock, _HEADER.size))
    except ValueError:
        return None, 0
    return kind, value


def _forward(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--zygote"]:
        parser = argparse.ArgumentParser(prog="python -m omni_trainer.warm")
        parser.add_argument("--zygote", type=Path, required=True, metavar="SOCKET")
        parser.add_argument("--owner", type=int, help="serve until this process ends")
        parser.add_argument("--quiet", action="store_true", help="no line per forked worker")
        opts = parser.parse_args(argv)
        return serve(opts.zygote, opts.owner, quiet=opts.quiet)
    if argv[:1] and argv[0].startswith("--entry="):
        entry = argv[0].split("=", 1)[1]
        if entry not in ENTRIES:
            print(f"omni_trainer.warm: --entry must be one of {sorted(ENTRIES)}", file=sys.stderr)
            return 2
        if entry == SCRIPT and len(argv) < 2:
            print("omni_trainer.warm: --entry=script needs the file to run", file=sys.stderr)
            return 2
        return stand_in(argv[1:], entry)
    return stand_in(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
