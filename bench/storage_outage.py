"""An S3 endpoint that can go down: a real S3 server (moto) behind a TCP proxy the benchmark
switches off and on. While down, the proxy closes every connection it holds and refuses new
ones, as a storage outage or a network partition to the object store looks to a client.

Used by ``bench/faults.py`` (the ``storage-outage`` fault) and runnable alone:

    python bench/storage_outage.py --seconds 60     # prints the endpoint, down every other 10 s
    python bench/storage_outage.py --smoke   # a client's requests before, during, after 1 s down
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
            with contextlib.suppress(OSError):  # wakes the accept() in flight (close does not)
                self._listener.shutdown(socket.SHUT_RDWR)
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
            if not self._up.is_set():  # accepted as the outage began: refused
                client.close()
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


def client_view(s3: FlakyS3, seconds: float) -> None:
    """What an S3 client sees: a write served, the endpoint refusing during an outage of
    ``seconds``, then serving again (how long after the outage's start)."""
    import boto3
    import botocore.config

    once = botocore.config.Config(retries={"total_max_attempts": 1}, connect_timeout=2)
    client = boto3.client("s3", endpoint_url=s3.endpoint, region_name="us-east-1",
                          aws_access_key_id="x", aws_secret_access_key="x",
                          config=once)  # fmt: skip
    client.create_bucket(Bucket="outage")
    client.put_object(Bucket="outage", Key="before", Body=b"1")
    t0 = time.time()
    back = s3.outage(seconds)
    try:
        client.put_object(Bucket="outage", Key="during", Body=b"1")
        during = "served (the proxy was not down)"
    except Exception as err:  # whatever botocore raises for a refused connection
        during = f"refused ({type(err).__name__})"
    back.join()
    while True:
        try:
            client.put_object(Bucket="outage", Key="after", Body=b"1")
            break
        except Exception:
            time.sleep(0.05)
    print(f"outage of {seconds:g} s: a write during it {during}; served again "
          f"{time.time() - t0:.2f} s after its start")  # fmt: skip
    if not during.startswith("refused"):
        raise SystemExit("the endpoint served a write during the outage")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--smoke", action="store_true", help="one outage of 1 s seen by a client")
    args = ap.parse_args()
    if args.smoke:
        with FlakyS3() as s3:
            client_view(s3, 1.0)
        return
    with FlakyS3() as s3:
        print(f"endpoint {s3.endpoint}", flush=True)
        end = time.time() + args.seconds
        while time.time() < end:
            time.sleep(10)
            s3.outage(10).join()


if __name__ == "__main__":
    main()
