"""Operator metrics: per-instance registry, phases bounded, reconcile timing and errors."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from omni_operator.metrics import PHASES, OperatorMetrics


def test_operator_metrics_over_http() -> None:
    m = OperatorMetrics()
    m.set_jobs_by_phase({"Running": 3, "Failed": 1})
    m.record_restart("node_lost")
    m.record_restart("node_lost")
    m.observe_recovery(42.0)
    m.set_quarantined_nodes(2)
    with m.reconcile("create"):
        pass
    with pytest.raises(KeyError), m.reconcile("create"):
        raise KeyError("boom")
    port = m.serve(0, addr="127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as rsp:
            text = rsp.read().decode()
    finally:
        m.close()
    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    assert got[("omni_operator_jobs", (("phase", "Running"),))] == 3
    assert got[("omni_operator_jobs", (("phase", "Pending"),))] == 0
    assert {k[1][0][1] for k in got if k[0] == "omni_operator_jobs"} == set(PHASES)
    assert got[("omni_operator_restarts_total", (("reason", "node_lost"),))] == 2
    assert got[("omni_operator_time_to_recover_seconds_sum", ())] == 42.0
    assert got[("omni_operator_quarantined_nodes", ())] == 2
    assert got[("omni_operator_reconcile_duration_seconds_count", (("handler", "create"),))] == 2
    key = ("omni_operator_reconcile_errors_total", (("error", "KeyError"), ("handler", "create")))
    assert got[key] == 1


def test_jobs_by_phase_replaces_and_rejects_unknown() -> None:
    m = OperatorMetrics()
    m.set_jobs_by_phase({"Running": 2})
    m.set_jobs_by_phase({"Succeeded": 2})
    assert m.registry.get_sample_value("omni_operator_jobs", {"phase": "Running"}) == 0
    with pytest.raises(ValueError, match="unknown phases"):
        m.set_jobs_by_phase({"Exploded": 1})
    assert OperatorMetrics().registry is not m.registry


def test_fleet_counts_phases_quarantine_and_recovery_time() -> None:
    from omni_operator.metrics import Fleet, OperatorMetrics

    fleet, m = Fleet(), OperatorMetrics()
    a, b = ("ns", "a"), ("ns", "b")
    assert fleet.observe(a, phase="Running", quarantined=0, now=0.0, stragglers=1) is None
    assert fleet.observe(b, phase="Restarting", quarantined=1, now=10.0) is None
    assert fleet.observe(b, phase="Restarting", quarantined=1, now=20.0) is None
    assert fleet.observe(b, phase="Running", quarantined=1, now=55.0) == 45.0  # since 10 s
    fleet.export(m)
    value = m.registry.get_sample_value
    assert value("omni_operator_jobs", {"phase": "Running"}) == 2
    assert value("omni_operator_quarantined_nodes") == 1
    assert value("omni_operator_straggler_nodes") == 1
    fleet.forget(b)
    fleet.export(m)
    assert value("omni_operator_jobs", {"phase": "Running"}) == 1
    assert value("omni_operator_quarantined_nodes") == 0
    fleet.forget(a)
    fleet.export(m)
    assert value("omni_operator_straggler_nodes") == 0
