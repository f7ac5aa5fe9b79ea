"""An S3 endpoint that can go down: a real S3 server (moto) behind a TCP proxy the benchmark
switches off and on. While down, the proxy closes every connection it holds and refuses new
ones, as a storage outage or a network partition to the object store looks to a client.

Used by ``bench/faults.py`` (the ``storage-outage`` fault) and runnable alone:

    python bench/storage_outage.py --seconds 60     # prints the endpoint, down every other 10 s
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import socket
import struct
import threading
import time
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class FlakyS3:
    """moto's S3 server on one port, a proxy to it on another (:attr:`endpoint`)."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self._moto_port = free_port()
        self._moto = ThreadedMotoServer(ip_address="127.0.0.1", port=self._moto_port)
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._up = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self.outages: list[tuple[float, float]] = []
        """(start, end) wall times of each outage."""

    def __enter__(self) -> FlakyS3:
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's access log
        self._moto.start()
        self.up()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.down(record=False)
        self._moto.stop()

    def up(self) -> None:
        """Serve again (a new listener on the same port)."""
        if self._up.is_set():
            return
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(128)
        self._listener = listener
        self._up.set()
        if self.outages and self.outages[-1][1] == 0.0:
            self.outages[-1] = (self.outages[-1][0], time.time())
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self, *, record: bool = True) -> None:
        """Refuse new connections and reset the open ones."""
        if not self._up.is_set():
            return
        self._up.clear()
        if record:
            self.outages.append((time.time(), 0.0))
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            conns, self._conns = self._conns, set()
        for c in conns:
            with contextlib.suppress(OSError):
                c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                c.close()  # linger 0: a reset, as a dropped path shows

    def outage(self, seconds: float) -> threading.Thread:
        """Go down now for ``seconds`` (in the background)."""
        self.down()

        def back() -> None:
            time.sleep(seconds)
            self.up()

        t = threading.Thread(target=back, daemon=True)
        t.start()
        return t

    def _accept(self, listener: socket.socket) -> None:
        while self._up.is_set():
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self._moto_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns.update((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
            with self._lock:
                self._conns.discard(src)
                self._conns.discard(dst)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    args = ap.parse_args()
    with FlakyS3() as s3:
        print(f"endpoint {s3.endpoint}", flush=True)
        end = time.time() + args.seconds
        while time.time() < end:
            time.sleep(10)
            s3.outage(10).join()


if __name__ == "__main__":
    main()
