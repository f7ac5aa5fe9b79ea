"""The operator reads the trainer's progress from the same endpoint Prometheus scrapes."""

from __future__ import annotations

import asyncio

from omni_operator.progress import MetricsProgress, parse_progress
from omni_operator.reconcile import Progress
from omni_operator.render import LABEL_RANK
from omni_trainer.components.metrics import TrainerMetrics

STEP = dict(
    loss=2.5, lr=3e-4, tokens_per_s=12345.0, mfu=0.41, step_seconds=0.5,
    phases={"llm": 0.3}, samples={"image": 4}, mixture={"image": 1.0},
    encoder_activation_peak_bytes=1024, media_bytes_read=0,
)  # fmt: skip


def _pod(rank: str, ip: str, phase: str = "Running") -> dict:
    return {"metadata": {"labels": {LABEL_RANK: rank}}, "status": {"phase": phase, "podIP": ip}}


def test_progress_scraped_from_a_live_trainer_endpoint() -> None:
    metrics = TrainerMetrics(job="tiny", rank=0, stage=0, restart_attempt=3)
    port = metrics.serve(0, addr="127.0.0.1")
    try:
        metrics.record_step(step=7, **STEP)
        metrics.record_checkpoint(step=4, seconds=1.0, blocking_seconds=0.1)
        metrics.record_resume(2)
        source = MetricsProgress(port=port)
        pods = [_pod("1", "10.255.255.1"), _pod("0", "127.0.0.1")]
        got = asyncio.run(source(None, pods))
    finally:
        metrics.close()
    assert got == Progress(
        step=7, checkpoint_step=4, tokens_per_second=12345.0, mfu=0.41, resumed_from=2, attempt=3
    )


def test_no_running_rank0_or_no_answer_is_no_progress() -> None:
    source = MetricsProgress(port=1, timeout_s=0.5)  # nothing listens on port 1
    assert asyncio.run(source(None, [_pod("0", "127.0.0.1", phase="Pending")])) is None
    assert asyncio.run(source(None, [_pod("0", "127.0.0.1")])) is None


def test_parse_keeps_missing_figures_unknown() -> None:
    assert parse_progress("# nothing yet\n") == Progress()


def test_per_node_busy_times_are_parsed_by_node_rank() -> None:
    text = (
        "# TYPE omni_trainer_node_busy_seconds gauge\n"
        'omni_trainer_node_busy_seconds{training_job="t",node_rank="1"} 0.5\n'
        'omni_trainer_node_busy_seconds{training_job="t",node_rank="0"} 0.25\n'
        'omni_trainer_step{training_job="t"} 9\n'
    )
    assert parse_progress(text) == Progress(step=9, node_busy={0: 0.25, 1: 0.5})
