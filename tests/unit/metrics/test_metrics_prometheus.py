"""A real Prometheus (Debian's package) scrapes the trainer endpoint on loopback and answers
queries the dashboards use. Skipped where no ``prometheus`` binary is installed."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from omni_trainer.components.metrics import TrainerMetrics

PROMETHEUS = shutil.which("prometheus")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        PROMETHEUS is None, reason="no prometheus binary (apt-get install prometheus)"
    ),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _query(port: int, expr: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as rsp:
        return json.loads(rsp.read())["data"]["result"]


def test_prometheus_scrapes_the_trainer(tmp_path: Path) -> None:
    metrics = TrainerMetrics(job="tiny", rank=0, stage=0)
    target = metrics.serve(0, addr="127.0.0.1")
    metrics.record_step(
        step=5, loss=2.0, lr=1e-3, tokens_per_s=5000.0, mfu=0.33, step_seconds=0.5,
        phases={"llm": 0.3, "encoder": 0.1}, samples={"image": 3}, mixture={"image": 1.0},
        encoder_activation_peak_bytes=1024, media_bytes_read=0,
    )  # fmt: skip
    prom_port = _free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: trainer\n    static_configs: [{{targets: ['127.0.0.1:{target}']}}]\n"
    )
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        result: list[dict] = []
        while time.monotonic() < deadline:
            try:
                result = _query(prom_port, 'omni_trainer_mfu_ratio{training_job="tiny"}')
            except OSError:
                result = []
            if result:
                break
            time.sleep(0.5)
        assert result, "Prometheus never scraped the trainer"
        assert float(result[0]["value"][1]) == pytest.approx(0.33)
        assert result[0]["metric"]["job"] == "trainer"  # Prometheus' job, not ours
        tps = _query(prom_port, "max by (training_job) (omni_trainer_tokens_per_second)")
        assert float(tps[0]["value"][1]) == 5000.0
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        metrics.close()
