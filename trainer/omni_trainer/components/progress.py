"""Training progress: a rich progress bar on a terminal, plain lines in pod logs, and an
optional JSON-lines step log for programs (loss curves across restarts)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Protocol

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class StepReporter(Protocol):
    def start(self, total_steps: int, description: str) -> None: ...
    def update(
        self, step: int, *, loss: float, tokens_per_s: float, mfu: float, fingerprint: str = ""
    ) -> None: ...
    def close(self) -> None: ...


class NullReporter:
    """For ranks other than 0."""

    def start(self, total_steps: int, description: str) -> None:
        pass

    def update(
        self, step: int, *, loss: float, tokens_per_s: float, mfu: float, fingerprint: str = ""
    ) -> None:
        pass

    def close(self) -> None:
        pass


class ConsoleReporter:
    """Rank 0: a live bar when stdout is a terminal, one log line per ``log_every`` steps if not."""

    def __init__(self, *, log_every: int = 10, console: Console | None = None) -> None:
        self.console = console or Console(file=sys.stdout)
        self.log_every = log_every
        self.progress: Progress | None = None
        self.task = None
        self.total = 0

    def start(self, total_steps: int, description: str) -> None:
        self.total = total_steps
        self.console.print(f"[bold]training[/bold] {description}")
        if self.console.is_terminal:
            self.progress = Progress(
                TextColumn("step"),
                MofNCompleteColumn(),
                BarColumn(),
                TextColumn("loss {task.fields[loss]:.4f}"),
                TextColumn("{task.fields[tps]:,.0f} tok/s"),
                TextColumn("MFU {task.fields[mfu]:.2%}"),
                TimeElapsedColumn(),
                console=self.console,
            )
            self.task = self.progress.add_task(
                "train", total=total_steps, loss=0.0, tps=0.0, mfu=0.0
            )
            self.progress.start()

    def update(
        self, step: int, *, loss: float, tokens_per_s: float, mfu: float, fingerprint: str = ""
    ) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=step, loss=loss, tps=tokens_per_s, mfu=mfu)
        elif step == 1 or step % self.log_every == 0 or step == self.total:
            self.console.print(
                f"step {step}/{self.total}  loss {loss:.4f}  {tokens_per_s:,.0f} tok/s  "
                f"MFU {mfu:.2%}"
            )

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


class StepLog:
    """Appends ``{"step", "loss", "tokens_per_s", "mfu", "attempt", "run", "time", "samples"}``
    per step (``samples``: the fingerprint of the samples the step consumed),
    flushed at once: a killed job keeps every step it finished. ``attempt`` is the operator's
    restart attempt; ``run`` counts the runs that appended to the file (0, 1, ...), so replayed
    steps stay apart even when the attempt repeats (a job deleted and applied again)."""

    def __init__(self, path: str | Path, *, attempt: int = 0) -> None:
        self.path = Path(path)
        self.attempt = attempt
        self.run = 0
        self._file = None

    def start(self, total_steps: int, description: str) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.run = _next_run(self.path)
        self._file = self.path.open("a", encoding="utf-8")

    def update(
        self, step: int, *, loss: float, tokens_per_s: float, mfu: float, fingerprint: str = ""
    ) -> None:
        assert self._file is not None, "StepLog.start() was not called"
        record = {"step": step, "loss": loss, "tokens_per_s": tokens_per_s, "mfu": mfu,
                  "attempt": self.attempt, "run": self.run, "time": time.time(),
                  "samples": fingerprint}  # fmt: skip
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _next_run(path: Path) -> int:
    """One more than the last run that wrote to the step log (0 for a new one)."""
    if not path.exists():
        return 0
    last = -1
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            last = max(last, int(json.loads(line).get("run", 0)))
    return last + 1


def read_step_log(path: str | Path) -> dict[int, float]:
    """Loss per step as it finally counted: a step re-run after a restart replaces the lost one."""
    losses: dict[int, float] = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            record = json.loads(line)
            losses[record["step"]] = record["loss"]
    return dict(sorted(losses.items()))


class Reporters:
    """Several reporters as one."""

    def __init__(self, *reporters: StepReporter) -> None:
        self.reporters = reporters

    def start(self, total_steps: int, description: str) -> None:
        for r in self.reporters:
            r.start(total_steps, description)

    def update(
        self, step: int, *, loss: float, tokens_per_s: float, mfu: float, fingerprint: str = ""
    ) -> None:
        for r in self.reporters:
            r.update(step, loss=loss, tokens_per_s=tokens_per_s, mfu=mfu, fingerprint=fingerprint)

    def close(self) -> None:
        for r in self.reporters:
            r.close()
