"""Grafana dashboards as code (grafana-foundation-sdk): the job view and the fleet view.

``python -m omni_operator.dashboards DIR`` (``make dashboards``) writes one JSON file per dashboard;
the chart ships them in a ConfigMap for Grafana's dashboard sidecar. The files are generated, never
edited: a test fails when they are stale, and another checks that every query uses only metric
names that :mod:`omni_trainer.components.metrics` and :mod:`omni_operator.metrics` export.

This module is a build-time tool: the operator never imports it at run time, so
grafana-foundation-sdk lives in the ``test`` extra, not in the operator image.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dash_b
from grafana_foundation_sdk.builders import prometheus as prom_b
from grafana_foundation_sdk.builders import stat as stat_b
from grafana_foundation_sdk.builders import timeseries as ts_b
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common, dashboard

DATASOURCE = dashboard.DataSourceRef(type_val="prometheus", uid="${datasource}")
JOB = 'training_job=~"$training_job"'
RATE = "$__rate_interval"
TAGS = ["megascale-omni"]


@dataclass(frozen=True)
class Query:
    """One PromQL target and its legend."""

    expr: str
    legend: str = ""


@dataclass(frozen=True)
class PanelSpec:
    """What a panel shows; :func:`_panel` turns it into a grafana-foundation-sdk builder."""

    title: str
    queries: list[Query]
    unit: str = "short"
    kind: str = "timeseries"  # or "stat"
    stacked: bool = False
    description: str = ""
    width: int = 12
    height: int = 8
    min: float | None = None
    max: float | None = None


@dataclass(frozen=True)
class DashboardSpec:
    uid: str
    title: str
    description: str
    rows: list[tuple[str, list[PanelSpec]]]
    variables: list[str] = field(default_factory=list)


def _target(q: Query, ref: str) -> prom_b.Dataquery:
    return prom_b.Dataquery().expr(q.expr).legend_format(q.legend or "__auto").ref_id(ref)


def _panel(p: PanelSpec, panel_id: int) -> Any:
    builder: Any
    if p.kind == "stat":
        builder = (
            stat_b.Panel()
            .graph_mode(common.BigValueGraphMode.AREA)
            .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]))
        )
    else:
        builder = ts_b.Panel().fill_opacity(60 if p.stacked else 10).line_width(1)
        builder = builder.legend(
            common_b.VizLegendOptions()
            .show_legend(True)
            .display_mode(common.LegendDisplayMode.TABLE)
            .placement(common.LegendPlacement.BOTTOM)
            .calcs(["lastNotNull", "mean"])
        )
        if p.stacked:
            builder = builder.stacking(common_b.StackingConfig().mode(common.StackingMode.NORMAL))
    builder = (
        builder.id(panel_id)
        .title(p.title)
        .description(p.description)
        .datasource(DATASOURCE)
        .unit(p.unit)
        .span(p.width)
        .height(p.height)
    )
    if p.min is not None:
        builder = builder.min(p.min)
    if p.max is not None:
        builder = builder.max(p.max)
    for i, q in enumerate(p.queries):
        builder = builder.with_target(_target(q, chr(ord("A") + i)))
    return builder


def _variables(spec: DashboardSpec) -> list[Any]:
    out: list[Any] = [
        dash_b.DatasourceVariable("datasource").label("Data source").type("prometheus")
    ]
    for expr in spec.variables:
        name, query = expr.split("=", 1)
        out.append(
            dash_b.QueryVariable(name)
            .label(name.replace("_", " "))
            .query(query)
            .datasource(DATASOURCE)
            .refresh(dashboard.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .include_all(True)
            .all_value(".*")
            .multi(True)
        )
    return out


def build(spec: DashboardSpec) -> dict[str, Any]:
    """The dashboard as Grafana's JSON model (a plain dict, keys sorted by the encoder)."""
    d = (
        dash_b.Dashboard(spec.title)
        .uid(spec.uid)
        .description(spec.description)
        .tags(TAGS)
        .editable()
        .refresh("30s")
        .time("now-6h", "now")
        .tooltip(dashboard.DashboardCursorSync.CROSSHAIR)
    )
    for var in _variables(spec):
        d = d.with_variable(var)
    ids = iter(range(1, 1000))
    for title, panels in spec.rows:
        d = d.with_row(dash_b.Row(title).id(next(ids)))
        for p in panels:
            d = d.with_panel(_panel(p, next(ids)))
    model: dict[str, Any] = json.loads(JSONEncoder(sort_keys=True).encode(d.build()))
    return model


def _mean(histogram: str, selector: str) -> str:
    """Mean of a histogram's observations over the rate window."""
    rate = f"[{RATE}]))"
    return f"sum(rate({histogram}_sum{selector}{rate} / sum(rate({histogram}_count{selector}{rate}"


def job_dashboard() -> DashboardSpec:
    """One training job: throughput, MFU, where step time goes, loss, data mix, checkpoints."""
    j = "{" + JOB + "}"
    return DashboardSpec(
        uid="omni-job",
        title="MegaScale-Omni / Training job",
        description="Throughput, MFU, step-time breakdown, loss, data mix, checkpoints, restarts.",
        variables=["training_job=label_values(omni_trainer_step, training_job)"],
        rows=[
            (
                "Now",
                [
                    PanelSpec(
                        "Step",
                        [Query(f"max by (training_job) (omni_trainer_step{j})")],
                        kind="stat",
                        width=4,
                        height=4,
                    ),
                    PanelSpec(
                        "Tokens/s",
                        [Query(f"max by (training_job) (omni_trainer_tokens_per_second{j})")],
                        kind="stat",
                        width=5,
                        height=4,
                    ),
                    PanelSpec(
                        "MFU",
                        [Query(f"max by (training_job) (omni_trainer_mfu_ratio{j})")],
                        kind="stat",
                        unit="percentunit",
                        width=5,
                        height=4,
                    ),
                    PanelSpec(
                        "Loss",
                        [Query(f"max by (training_job) (omni_trainer_loss{j})")],
                        kind="stat",
                        unit="none",
                        width=5,
                        height=4,
                    ),
                    PanelSpec(
                        "Restart attempt",
                        [Query(f"max by (training_job) (omni_trainer_restart_attempt{j})")],
                        kind="stat",
                        unit="none",
                        width=5,
                        height=4,
                    ),
                ],
            ),
            (
                "Throughput",
                [
                    PanelSpec(
                        "Throughput (tokens/s)",
                        [
                            Query(
                                f"max by (training_job) (omni_trainer_tokens_per_second{j})",
                                "{{training_job}}",
                            )
                        ],
                    ),
                    PanelSpec(
                        "MFU (Megatron-LM count, encoder FLOPs included)",
                        [
                            Query(
                                f"max by (training_job) (omni_trainer_mfu_ratio{j})",
                                "{{training_job}}",
                            )
                        ],
                        unit="percentunit",
                        min=0,
                    ),
                    PanelSpec(
                        "Step-time breakdown (share of wall time, mean over ranks)",
                        [
                            Query(
                                "avg by (phase) "
                                f"(rate(omni_trainer_phase_seconds_total{j}[{RATE}]))",
                                "{{phase}}",
                            )
                        ],
                        unit="percentunit",
                        stacked=True,
                        min=0,
                        description="Counters of seconds per phase; the gap to 100% is time "
                        "outside any timed phase (optimizer bookkeeping, logging).",
                    ),
                    PanelSpec(
                        "Busy seconds per step, by node (stragglers stand out)",
                        [
                            Query(
                                f"max by (node_rank) (omni_trainer_node_busy_seconds{j})",
                                "node {{node_rank}}",
                            )
                        ],
                        unit="s",
                        min=0,
                        description="The step minus the waits for peers, median over recent "
                        "steps of each node's slowest rank; every rank's wall step time is the "
                        "same in a synchronous job, its busy time is not.",
                    ),
                    PanelSpec(
                        "Step time p50 / p95 (per rank)",
                        [
                            Query(
                                "histogram_quantile(0.5, sum by (le) (rate("
                                f"omni_trainer_step_duration_seconds_bucket{j}[{RATE}])))",
                                "p50",
                            ),
                            Query(
                                "histogram_quantile(0.95, sum by (le) (rate("
                                f"omni_trainer_step_duration_seconds_bucket{j}[{RATE}])))",
                                "p95",
                            ),
                        ],
                        unit="s",
                    ),
                ],
            ),
            (
                "Training",
                [
                    PanelSpec(
                        "Loss",
                        [
                            Query(
                                f"max by (training_job) (omni_trainer_loss{j})", "{{training_job}}"
                            )
                        ],
                        unit="none",
                    ),
                    PanelSpec(
                        "Learning rate",
                        [
                            Query(
                                f"max by (training_job) (omni_trainer_learning_rate{j})",
                                "{{training_job}}",
                            )
                        ],
                        unit="none",
                    ),
                    PanelSpec(
                        "Data mix: mixture share per modality",
                        [
                            Query(
                                f"max by (modality) (omni_trainer_mixture_share{j})", "{{modality}}"
                            )
                        ],
                        unit="percentunit",
                        stacked=True,
                        min=0,
                        max=1,
                    ),
                    PanelSpec(
                        "Samples/s per modality",
                        [
                            Query(
                                f"sum by (modality) (rate(omni_trainer_samples_total{j}[{RATE}]))",
                                "{{modality}}",
                            )
                        ],
                        unit="short",
                        stacked=True,
                    ),
                    PanelSpec(
                        "Encoder activation peak (per rank)",
                        [
                            Query(
                                f"max by (rank, stage) "
                                f"(omni_trainer_encoder_activation_peak_bytes{j})",
                                "rank {{rank}} stage {{stage}}",
                            )
                        ],
                        unit="bytes",
                    ),
                ],
            ),
            (
                "Checkpoints and restarts",
                [
                    PanelSpec(
                        "Checkpoint age",
                        [
                            Query(
                                f"time() - max by (training_job) "
                                f"(omni_trainer_checkpoint_last_complete_timestamp_seconds{j})",
                                "{{training_job}}",
                            )
                        ],
                        unit="s",
                        width=8,
                    ),
                    PanelSpec(
                        "Checkpoint duration and blocking (mean)",
                        [
                            Query(
                                _mean("omni_trainer_checkpoint_duration_seconds", j),
                                "total",
                            ),
                            Query(
                                _mean("omni_trainer_checkpoint_blocking_seconds", j),
                                "blocking",
                            ),
                        ],
                        unit="s",
                        width=8,
                    ),
                    PanelSpec(
                        "Restart attempt",
                        [
                            Query(
                                f"max by (training_job) (omni_trainer_restart_attempt{j})",
                                "{{training_job}}",
                            )
                        ],
                        unit="none",
                        width=8,
                    ),
                ],
            ),
        ],
    )


def fleet_dashboard() -> DashboardSpec:
    """The operator: jobs by phase, restarts by reason, recovery time, reconcile health."""
    return DashboardSpec(
        uid="omni-fleet",
        title="MegaScale-Omni / Fleet (operator)",
        description="Jobs by phase, restarts by reason, time to recover, reconcile latency.",
        rows=[
            (
                "Jobs",
                [
                    PanelSpec(
                        "Jobs by phase",
                        [Query("sum by (phase) (omni_operator_jobs)", "{{phase}}")],
                        stacked=True,
                    ),
                    PanelSpec(
                        "Quarantined and straggler nodes",
                        [
                            Query("max(omni_operator_quarantined_nodes)", "quarantined"),
                            Query("max(omni_operator_straggler_nodes)", "stragglers"),
                        ],
                        description="Stragglers: nodes persistently slower than the other "
                        "nodes of their job (restartPolicy.stragglers, condition Straggler).",
                    ),
                ],
            ),
            (
                "Recovery",
                [
                    PanelSpec(
                        "Restarts by reason (per hour)",
                        [
                            Query(
                                "sum by (reason) (increase(omni_operator_restarts_total[1h]))",
                                "{{reason}}",
                            )
                        ],
                        stacked=True,
                    ),
                    PanelSpec(
                        "Time to recover p50 / p95",
                        [
                            Query(
                                "histogram_quantile(0.5, sum by (le) (rate("
                                f"omni_operator_time_to_recover_seconds_bucket[{RATE}])))",
                                "p50",
                            ),
                            Query(
                                "histogram_quantile(0.95, sum by (le) (rate("
                                f"omni_operator_time_to_recover_seconds_bucket[{RATE}])))",
                                "p95",
                            ),
                        ],
                        unit="s",
                    ),
                ],
            ),
            (
                "Reconciliation",
                [
                    PanelSpec(
                        "Reconcile latency p95 by handler",
                        [
                            Query(
                                "histogram_quantile(0.95, sum by (le, handler) (rate("
                                f"omni_operator_reconcile_duration_seconds_bucket[{RATE}])))",
                                "{{handler}}",
                            )
                        ],
                        unit="s",
                    ),
                    PanelSpec(
                        "Reconcile errors/s by handler and type",
                        [
                            Query(
                                "sum by (handler, error) (rate("
                                f"omni_operator_reconcile_errors_total[{RATE}]))",
                                "{{handler}} {{error}}",
                            )
                        ],
                    ),
                ],
            ),
        ],
    )


DASHBOARDS = {"omni-job.json": job_dashboard, "omni-fleet.json": fleet_dashboard}


def render_all() -> dict[str, str]:
    """File name -> JSON text, exactly what ``write`` puts on disk (the staleness test compares)."""
    return {
        name: json.dumps(build(make()), indent=2, sort_keys=True) + "\n"
        for name, make in DASHBOARDS.items()
    }


def write(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for name, text in render_all().items():
        path = directory / name
        path.write_text(text)
        out.append(path)
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m omni_operator.dashboards DIR", file=sys.stderr)
        return 2
    for path in write(Path(argv[0])):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
