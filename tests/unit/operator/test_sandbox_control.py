"""``omni sandbox fault`` from another process: the state file and the annotation PATCH, against
a stand-in API server that records what it is sent."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from omni_operator.sandbox.control import FAULT, STATE_FILE, inject_fault, read_state


@pytest.fixture
def api() -> Iterator[tuple[str, list[tuple[str, str, dict]]]]:
    seen: list[tuple[str, str, dict]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_PATCH(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((self.path, self.headers["Content-Type"], body))
            code = 404 if "missing" in self.path else 200
            self.send_response(code)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", seen
    server.shutdown()


def test_a_fault_patches_the_annotation_the_kubelet_reads(api) -> None:
    url, seen = api
    assert inject_fault(url, "node-lost", "node-1") == f"node node-1: {FAULT}=lost"
    assert inject_fault(url, "crash-pod", "p", namespace="team") == f"pod p: {FAULT}=crash"
    assert inject_fault(url, "unthrottle-pod", "p") == f"pod p: {FAULT} removed"
    assert seen == [
        ("/api/v1/nodes/node-1", "application/merge-patch+json",
         {"metadata": {"annotations": {FAULT: "lost"}}}),
        ("/api/v1/namespaces/team/pods/p", "application/merge-patch+json",
         {"metadata": {"annotations": {FAULT: "crash"}}}),
        ("/api/v1/namespaces/default/pods/p", "application/merge-patch+json",
         {"metadata": {"annotations": {FAULT: None}}}),
    ]  # fmt: skip


def test_errors_say_what_is_missing(api, tmp_path: Path) -> None:
    url, _ = api
    with pytest.raises(RuntimeError, match="pod 'missing' not found in namespace default"):
        inject_fault(url, "kill-pod", "missing")
    with pytest.raises(RuntimeError, match=r"the sandbox at http://127\.0\.0\.1:1"):
        inject_fault("http://127.0.0.1:1", "kill-pod", "p", timeout=5)
    with pytest.raises(RuntimeError, match=r"no sandbox is running with --dir .*omni sandbox up"):
        read_state(tmp_path)
    (tmp_path / STATE_FILE).write_text(json.dumps({"server": url}))
    assert read_state(tmp_path) == {"server": url}


def test_the_fault_module_starts_light() -> None:
    """What `omni sandbox fault` imports to act: no kopf, no emulator, no aiohttp."""
    code = (
        "import sys, omni_operator.sandbox.control;"
        "print(sorted(m for m in ('kopf', 'aiohttp', 'kmock', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
