"""Grafana dashboards: generated files are fresh, and every query uses exported metric names."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from omni_operator.dashboards import DASHBOARDS, render_all
from omni_operator.metrics import OperatorMetrics
from omni_trainer.components.metrics import TrainerMetrics

CHART_DASHBOARDS = Path(__file__).resolve().parents[3] / "charts/megascale-omni/dashboards"
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
}


def exported_names(registry: CollectorRegistry) -> set[str]:
    """Every sample name a registry can expose, from its metric families (no sample needed:
    labelled series appear only once used, but their family is described up front)."""
    return {fam.name + sfx for fam in registry.collect() for sfx in _SUFFIXES[fam.type]}


def queries(model: dict) -> list[tuple[str, str]]:
    out = []
    for panel in model["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"]))
    for var in model.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            query = var["query"]
            out.append((f"${var['name']}", query if isinstance(query, str) else query["query"]))
    return out


@pytest.fixture(scope="module")
def exported() -> set[str]:
    return exported_names(TrainerMetrics(job="t").registry) | exported_names(
        OperatorMetrics().registry
    )


def test_generated_dashboards_are_fresh() -> None:
    rendered = render_all()
    on_disk = {p.name: p.read_text() for p in CHART_DASHBOARDS.glob("*.json")}
    assert set(on_disk) == set(rendered), "run `make dashboards`"
    for name, text in rendered.items():
        assert on_disk[name] == text, f"{name} is stale: run `make dashboards`"


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_every_query_uses_exported_metrics(name: str, exported: set[str]) -> None:
    import json

    model = json.loads(render_all()[name])
    found = queries(model)
    assert found
    for title, expr in found:
        names = set(re.findall(r"\bomni_[a-z0-9_]+", expr))
        assert names, f"{title!r}: query uses no MegaScale-Omni metric: {expr}"
        missing = names - exported
        assert not missing, f"{title!r}: {sorted(missing)} are not exported by the metrics modules"


def test_dashboards_have_unique_panel_ids_and_prometheus_datasource() -> None:
    import json

    for name, text in render_all().items():
        model = json.loads(text)
        ids = [p["id"] for p in model["panels"]]
        assert len(ids) == len(set(ids)), name
        assert model["uid"] and len(model["uid"]) <= 40
        for p in model["panels"]:
            if p["type"] != "row":
                assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}


def test_job_dashboard_covers_the_issue() -> None:
    """Throughput, MFU, stacked breakdown, loss, data mix, checkpoints, restarts."""
    import json

    model = json.loads(render_all()["omni-job.json"])
    exprs = " ".join(e for _, e in queries(model))
    for metric in (
        "omni_trainer_tokens_per_second",
        "omni_trainer_mfu_ratio",
        "omni_trainer_phase_seconds_total",
        "omni_trainer_loss",
        "omni_trainer_mixture_share",
        "omni_trainer_checkpoint_last_complete_timestamp_seconds",
        "omni_trainer_restart_attempt",
    ):
        assert metric in exprs
    stacked = [p for p in model["panels"] if "breakdown" in p["title"]]
    assert stacked[0]["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
