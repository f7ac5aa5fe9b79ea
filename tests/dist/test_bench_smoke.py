"""Every script in bench/ runs its whole path in its smoke mode (``--smoke``: seconds, the smallest
sizes) and prints its figures' lines, so a benchmark cannot break unnoticed. The figures of a
smoke run mean nothing; that the script ran through and printed them does.

The runs are started together (a few at a time, longest first) when the first test asks for one.
A script in bench/ with neither an entry in :data:`SMOKE` nor in :data:`COVERED_ELSEWHERE` fails
:func:`test_every_bench_script_has_a_smoke_run`.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"

SMOKE: dict[str, str] = {
    # script: a line its smoke run prints (a regular expression, searched in stdout)
    "faults.py": r"crash\s+\S+ s",
    "interop.py": r"export \(one process, fp32 params -> [\d.]+ GiB safetensors\)",
    "multiplex.py": r"median step-time ratio \d",
    "calibrate.py": r"# (PASS|FAIL): predictions within",
    "data.py": r"data time without / with prefetch: [\d.]+x; same loss curve: True",
    "core.py": r"pp2: before [\d,]+ tok/s .* after / before = \d",
    "preflight.py": r"0.1\s+n1 late\s+[\d.]+",
    "operator_scale.py": r"\s+4\s+8 crash\s+[\d.]+\s+\d+",
    "attention.py": r"sdpa per sample\s+[\d.]+ ms",
    "freeze.py": r"projector-only step is [\d.]+x faster",
    "storage_outage.py": r"outage of 1 s: a write during it refused",
    "checkpoint.py": r"later saves, cache off / on: [\d.]+x",
    "shared_cluster.py": r"backfill \| [\d.]+ min \|(.|\n)*scheduler \| [\d.]+ min \|",
    "paper.py": r"#   A: LLaMA-7B",
    "balance.py": r"13:74:13\s+4 \| [\d.]+",
}
"""Ordered longest first: the slow runs start at once, the short ones fill in beside them."""
COVERED_ELSEWHERE: dict[str, str] = {
    "gpu_check.py": "tests/dist/test_gpu_check.py",  # --cpu-smoke, its JSON checked part by part
    "fake_layouts.py": "tests/dist/test_gpu_check.py",  # gpu_check's ``layouts`` part
}
STAND_IN = [sys.executable, "-m", "omni_trainer.warm", "--entry=script"]
"""How a script starts: as ``python SCRIPT`` would, forked from the session's zygote (the
imports of torch and the trainer, most of a smoke run's CPU, paid once)."""
RUN_MARKER = "OMNI_BENCH_SMOKE"
"""In the environment of a run's stand-in and of every process its script starts."""
AT_ONCE = 3
"""Runs side by side: most wait on their own subprocesses or sleeps part of the time."""
TIMEOUT_S = 420


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest) -> Iterator[dict[str, Future[tuple[int, str, float]]]]:
    """The smoke runs of the selected tests, started in the background; each future gives
    (exit code, output, seconds)."""
    selected = {
        item.callspec.params["script"]
        for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec")
    }

    def run(script: str) -> tuple[int, str, float]:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            [*STAND_IN, str(BENCH / script), "--smoke"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            env={**os.environ, "OMNI_NUM_THREADS": "1", RUN_MARKER: script},
        )
        try:
            out, _ = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _kill_the_run_of(script)
            out = proc.communicate()[0] + f"\n(killed after {TIMEOUT_S} s)"
        return proc.returncode, out, time.perf_counter() - t0

    pool = ThreadPoolExecutor(AT_ONCE)
    futures = {script: pool.submit(run, script) for script in SMOKE if script in selected}
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


def _kill_the_run_of(script: str) -> None:
    """SIGKILL every process of ``script``'s run, found by the marker in the environment it
    started with: the stand-in (the forked script dies with it) and whatever the script started
    (a forked process is not in its stand-in's tree)."""
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.environ().get(RUN_MARKER) == script:
                proc.kill()


def test_every_bench_script_has_a_smoke_run() -> None:
    scripts = {p.name for p in BENCH.glob("*.py")}
    missing = sorted(scripts - SMOKE.keys() - COVERED_ELSEWHERE.keys())
    assert not missing, (
        f"bench/{', bench/'.join(missing)}: no smoke run; give the script a --smoke mode (seconds, "
        "the smallest sizes, its whole path) and add it with a line it prints to SMOKE here"
    )
    for script, test in COVERED_ELSEWHERE.items():
        assert script in (ROOT / test).read_text(), f"{test} does not run bench/{script}"


@pytest.mark.parametrize("script", SMOKE)
def test_smoke_run_prints_its_figures(
    script: str, runs: dict[str, Future[tuple[int, str, float]]]
) -> None:
    code, out, seconds = runs[script].result()
    print(f"bench/{script} --smoke: {seconds:.1f} s")  # pytest -rA shows each run's time
    assert code == 0, f"bench/{script} --smoke exited {code} after {seconds:.0f} s:\n{out[-4000:]}"
    assert re.search(SMOKE[script], out), (
        f"bench/{script} --smoke printed no line like {SMOKE[script]!r}:\n{out[-4000:]}"
    )
