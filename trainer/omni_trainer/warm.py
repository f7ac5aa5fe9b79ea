"""Warm trainer starts: a process that imported the trainer once forks each trainer worker.

Every trainer process pays for its imports (torch, megatron-core, transformers; on GPUs also
TransformerEngine and the CUDA libraries) at each start: about 7 s of CPU per process on this
project's CPU machine, more on a GPU node. An in-place restart keeps the container, so the in-pod
supervisor keeps a *zygote* in it: ``python -m omni_trainer.warm --zygote SOCKET`` imports the
trainer before any attempt needs it and then serves fork requests on a Unix socket.

torchrun starts each worker as ``python -m omni_trainer.warm ARGS``, a small process that
imports no torch. With :data:`SOCKET_ENV` set (the supervisor sets it) it hands its arguments,
environment, working directory and standard streams to the zygote, which forks a child that
runs ``omni_trainer.cli ARGS`` with them. The small process stands in for the child under
torchrun: it forwards signals, and it ends as the child ended (its exit code, or the signal that
killed it). Without a zygote (none set, none running, or it declined) it runs the trainer itself,
exactly as ``python -m omni_trainer.cli ARGS`` would. The supervisor starts torchrun itself the
same way (``--entry=torchrun``, :func:`through_zygote`): its agent imports torch too.

Forking is safe because the zygote only imported modules: before each fork it checks that it
runs no other Python thread and holds no CUDA context (otherwise it declines, and the workers
start cold). A child whose stand-in dies (torchrun killed it) kills itself at once, so no worker
outlives the process torchrun watches, and a child that ends skips the interpreter's teardown
(:func:`run_then_exit`), so its stand-in ends with it. Standard library only, outside the
zygote's imports.
"""

from __future__ import annotations

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
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

SOCKET_ENV = "OMNI_WARM_SOCKET"
"""The zygote's socket, in a trainer worker's environment (none: start cold)."""
SOCKET_NAME = "warm.sock"
WARM_IMPORTS = ("omni_trainer.cli", "omni_trainer.trainer", "torch.distributed.run")
"""What the zygote imports once: the command line, everything training imports, torchrun."""
DECLINED = 3
"""The zygote's exit code when forking would be unsafe here: the supervisor starts no other."""
ENTRIES = {"cli": ("omni_trainer.cli", "app"), "torchrun": ("torch.distributed.run", "main")}
"""What a stand-in can run: module and function (what ``python -m`` of the module calls)."""
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
def unsafe_to_fork() -> str | None:
    """Why a fork now would hand a child broken state (None: safe)."""
    if threading.active_count() > 1:
        return f"{threading.active_count()} Python threads run"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA was initialised by an import"
    return None


def serve(path: Path) -> int:
    """The zygote: listen, import, then fork a worker per request. Returns only when forking
    is unsafe (:data:`DECLINED`); a forked child runs its command and exits (:func:`_child`)."""
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
    while True:
        ready = select.select([listener, *ends.values()], [], [], 0.2)[0]
        if listener in ready:
            conn, _ = listener.accept()
            pid = _fork(conn, listener, children, ends)
            if pid is not None:
                with contextlib.suppress(OSError):  # without pidfds, the timeout reaps
                    ends[pid] = os.pidfd_open(pid)
        _reap(children)
        for pid in [p for p in ends if p not in children]:
            os.close(ends.pop(pid))


def _fork(conn: socket.socket, listener: socket.socket, children: dict[int, socket.socket],
          ends: dict[int, int]) -> int | None:  # fmt: skip
    """Serve one request: the forked child's pid (None: none); the child never returns."""
    try:
        conn.settimeout(5.0)
        request, fds = _receive(conn)
        conn.settimeout(None)
    except (OSError, ValueError, KeyError) as err:
        print(f"omni warm: a bad request ({err})", file=sys.stderr, flush=True)
        conn.close()
        return None
    why = unsafe_to_fork()
    if why is not None:
        for fd in fds:
            os.close(fd)
        with contextlib.suppress(OSError):
            conn.sendall(_HEADER.pack(b"D", 0))
        conn.close()
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
    print(f"omni warm: forked {pid} for process {request['pid']}: {request['entry']} "
          f"{' '.join(request['args'])}", file=sys.stderr, flush=True)  # fmt: skip
    with contextlib.suppress(OSError):
        conn.sendall(_HEADER.pack(b"P", pid))
    return pid


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    head, fds, _, _ = socket.recv_fds(conn, 8, len(_STDIO))
    head += _exactly(conn, 8 - len(head))
    (size,) = struct.unpack("!q", head)
    if len(fds) != len(_STDIO) or not 0 < size < 1 << 24:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"{len(fds)} descriptors, {size} bytes")
    request = json.loads(_exactly(conn, size))
    for key in ("entry", "args", "env", "cwd", "pid"):
        if key not in request:
            raise KeyError(key)
    if request["entry"] not in ENTRIES:
        raise ValueError(f"no entry {request['entry']!r}")
    return request, fds


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
    module, function = ENTRIES[request["entry"]]
    sys.argv = [module, *request["args"]]
    run_then_exit(getattr(importlib.import_module(module), function))  # imported already


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
    module, _ = ENTRIES[entry]
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


def _hand_over(path: Path, entry: str, args: list[str]) -> int | None:
    """Run ``args`` in a child of the zygote and end as it ended; None: no zygote took it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(connectable(path))
        request = json.dumps({"entry": entry, "args": args, "env": dict(os.environ),
                              "cwd": os.getcwd(), "pid": os.getpid()}).encode()  # fmt: skip
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
    if argv[:1] == ["--zygote"] and len(argv) == 2:
        return serve(Path(argv[1]))
    if argv[:1] and argv[0].startswith("--entry="):
        entry = argv[0].split("=", 1)[1]
        if entry not in ENTRIES:
            print(f"omni_trainer.warm: --entry must be one of {sorted(ENTRIES)}", file=sys.stderr)
            return 2
        return stand_in(argv[1:], entry)
    return stand_in(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
