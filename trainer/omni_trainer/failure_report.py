"""The in-pod supervisor's report of a failed attempt, served over HTTP from its pod.

Reporting a failure by exiting the container costs a container restart, the kubelet's crash
back-off from the second failure on (10 s, doubling to 5 min), and everything the container
held: a pre-imported trainer (:mod:`omni_trainer.warm`) dies with it. With a report port the
container outlives its trainer's failure instead:

- ``/healthz`` is the pod's readinessProbe: 200 while no failure is pending, 503 once the
  attempt the supervisor ran failed and no newer one is ordered. The kubelet turns the
  container unready, and that update of the pod reaches the operator at once.
- ``/failure`` is what the operator then reads: the failed attempt's end as a kubelet reports a
  container's (``exitCode``, ``reason``, ``message`` tagged ``[attempt N]``, ``finishedAt``).

Standard library only: the supervisor imports no torch.
"""

from __future__ import annotations

import datetime as dt
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

REPORT_PORT = 9465
"""The supervisor's port (the trainer's metrics are on 9464)."""
HEALTH_PATH = "/healthz"
FAILURE_PATH = "/failure"


def failure(attempt: int, exit_code: int, message: str) -> dict[str, Any]:
    """The report of ``attempt`` ending with ``exit_code``; ``message`` is already tagged."""
    return {
        "attempt": attempt,
        "exitCode": exit_code,
        "reason": "Error",
        "message": message,
        "finishedAt": dt.datetime.now(tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


class FailureReport:
    """The pending failure (None: healthy) and the HTTP server that tells it."""

    def __init__(self, port: int = REPORT_PORT, addr: str = "0.0.0.0") -> None:
        self._failure: dict[str, Any] | None = None
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer((addr, port), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> FailureReport:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def set(self, doc: dict[str, Any] | None) -> None:
        """Report ``doc`` (:func:`failure`), or clear the report (None)."""
        with self._lock:
            self._failure = doc

    def get(self) -> dict[str, Any] | None:
        with self._lock:
            return self._failure

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        report = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                doc = report.get()
                if self.path == HEALTH_PATH:
                    code, body = (200, b"ok\n") if doc is None else (503, b"attempt failed\n")
                elif self.path == FAILURE_PATH:
                    code, body = (404, b"{}") if doc is None else (200, json.dumps(doc).encode())
                else:
                    code, body = 404, b"not found\n"
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # probed every second: no access log

        return Handler
