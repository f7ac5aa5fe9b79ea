"""``omni plan --tune``: the planner's search over parallel configurations, shown as a ranked
table beside the manifest's own layout, with the fields to write and a proxy to validate on.

Read top-down: :func:`run_tune` resolves the device, :func:`_search` simulates (with a progress
bar), then the ranking, the verdict on the manifest's layout and the proxy are printed."""

from __future__ import annotations

import json
import time

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from omni_trainer.cli.common import err_console, fail
from omni_trainer.costs.devices import DeviceProfile
from omni_trainer.planner.manifest import (
    device_for,
    manifest_fields,
    own_layout,
    tie_ranks,
    trainer_problems,
)
from omni_trainer.planner.simulate import Prediction, predict
from omni_trainer.planner.tune import Candidate, layouts, propose_proxy, tune
from omni_trainer.planner.workloads import Workload, workload_from_config


def run_tune(
    cfg,
    *,
    name: str,
    gpus: int,
    proxy_gpus: int | None = None,
    device_name: str | None = None,
    cluster: dict | None = None,
) -> None:
    """Predict the job on ``gpus`` GPUs for many configurations; print the best few beside the
    manifest's own layout (ties share a rank), and a proxy configuration of the best to
    validate it on a small cluster."""
    try:
        device, source = device_for(device_name, cluster)
    except ValueError as err:
        raise fail(str(err)) from None
    started = time.perf_counter()
    workload = workload_from_config(cfg, world_size=gpus, name=name)
    best, mine, why = _search(cfg, workload, device=device, gpus=gpus)
    if not best:
        raise fail(f"no configuration of {name} fits in {device.name} memory on {gpus} GPUs")
    searched = time.perf_counter() - started
    console = Console()
    console.print(f"device: {device.name} ({source})", highlight=False)
    title = f"{name} on {gpus} x {device.name} (predicted; searched in {searched:.1f} s)"
    ranks = tie_ranks([c.prediction.tokens_per_s for c in best])
    console.print(_ranking(title, ranks, best, mine))
    for rank, c in zip(ranks, best, strict=True):
        console.print(f"{rank}. {c.reason}", highlight=False)
    top = best[0].prediction
    fields = manifest_fields(top.layout, policy=top.policy)
    console.print(f"#1 as spec.trainer fields: {json.dumps(fields)}", highlight=False)
    console.print(_own_verdict(mine, why, top=top, device=device), highlight=False)
    if workload.note:
        console.print(f"data: {workload.note}", highlight=False)
    try:
        proxy = propose_proxy(workload, top, device=device, max_gpus=proxy_gpus)
    except ValueError as err:
        raise fail(str(err)) from None
    console.print(proxy.reason, highlight=False)


def _search(
    cfg, workload: Workload, *, device: DeviceProfile, gpus: int
) -> tuple[list[Candidate], Prediction | None, str]:
    """The best configurations ``omni train`` accepts with this manifest, the prediction of the
    manifest's own layout (None when it is not scored) and why it is not."""
    with Progress(console=err_console, transient=True) as bar:
        task = bar.add_task("simulating configurations", total=None)

        def progress(done: int, total: int, what: str) -> None:
            bar.update(task, completed=done, total=total, description=what[:60])

        runnable = [  # only what ``omni train`` accepts with this manifest
            lay for lay in layouts(workload, device=device) if not trainer_problems(cfg, lay)
        ]
        best = [
            c
            for c in tune(workload, device=device, candidates=runnable, progress=progress)
            if not trainer_problems(cfg, c.layout, policy=c.prediction.policy)
        ]
        own, why = own_layout(cfg, gpus)
        mine = None
        if own is not None:
            policy = cfg.parallelism.encoder.policy
            mine = predict(workload, own, policy=policy, device=device)
    return best, mine, why


def _ranking(title: str, ranks: list[str], best: list[Candidate], mine: Prediction | None) -> Table:
    """The ranked predictions, the manifest's own layout last (``own``)."""
    table = Table(title=title)
    for col in ("#", "layout", "policy", "tokens/s", "MFU", "step s", "stage-0 GiB"):
        table.add_column(col)
    rows = [(rank, c.prediction) for rank, c in zip(ranks, best, strict=True)]
    if mine is not None:
        rows.append(("own", mine))
    for rank, pr in rows:
        oom = " (OOM)" if pr.oom else ""
        table.add_row(
            rank,
            pr.layout.describe() + oom,
            pr.policy,
            f"{pr.tokens_per_s:,.0f}",
            f"{pr.mfu:.1%}",
            f"{pr.step_time:.2f}",
            f"{pr.stage0_gib:.1f}",
        )
    return table


def _own_verdict(
    mine: Prediction | None, why: str, *, top: Prediction, device: DeviceProfile
) -> str:
    """One line on the manifest's own layout: not scored, out of memory, or #1's gain over it."""
    if mine is None:
        return f"own: the manifest's layout is not scored ({why})"
    if mine.oom:
        return (
            f"own: the manifest's layout ({mine.layout.describe()}) does not fit in "
            f"{device.name} memory; #1 does"
        )
    return (
        f"own: the manifest's layout ({mine.layout.describe()}, {mine.policy}): "
        f"{mine.tokens_per_s:,.0f} tokens/s; switching to #1 gains "
        f"{top.tokens_per_s / mine.tokens_per_s:.2f}x"
    )
