"""The sandbox's Kueue emulation: gating at creation, quota, priority and preemption (pure)."""

from __future__ import annotations

import asyncio
from typing import Any

from omni_operator.kueue import GATE, gated
from omni_operator.sandbox.kueue import (
    fits,
    gate,
    nominal_quota,
    preemption_victims,
    workloads,
)

CQ = {"spec": {"resourceGroups": [{"coveredResources": ["nvidia.com/gpu"], "flavors": [
    {"name": "a", "resources": [{"name": "nvidia.com/gpu", "nominalQuota": 2}]},
    {"name": "b", "resources": [{"name": "nvidia.com/gpu", "nominalQuota": "1"}]}]}]}}  # fmt: skip


def _pod(name: str, group: str | None, *, gpus: int = 1, total: int = 2, cls: str = "",
         created: str = "t1", admitted: bool = False) -> dict[str, Any]:  # fmt: skip
    labels = {"kueue.x-k8s.io/queue-name": "team"}
    notes = {}
    if group:
        labels["kueue.x-k8s.io/pod-group-name"] = group
        notes["kueue.x-k8s.io/pod-group-total-count"] = str(total)
    spec: dict[str, Any] = {"priorityClassName": cls, "containers": [
        {"resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]}  # fmt: skip
    if not admitted:
        spec["schedulingGates"] = [{"name": GATE}]
    return {"kind": "Pod", "metadata": {"name": name, "namespace": "ml", "labels": labels,
            "annotations": notes, "creationTimestamp": created}, "spec": spec}  # fmt: skip


def test_the_webhook_gates_queued_pods_only() -> None:
    queued, plain = _pod("a", None, admitted=True), {"kind": "Pod", "metadata": {"name": "b"}}
    asyncio.run(gate(queued))
    asyncio.run(gate(plain))
    assert gated(queued) and not gated(plain)


def test_quota_groups_and_preemption_of_lower_priorities() -> None:
    assert nominal_quota(CQ) == {"nvidia.com/gpu": 3.0}
    pods = [_pod("j-0", "j", admitted=True), _pod("j-1", "j", admitted=True),
            _pod("k-0", "k", created="t2"), _pod("k-1", "k", created="t2"),
            _pod("u", None, gpus=2, cls="urgent", created="t3"),
            _pod("half-0", "half", total=2)]  # fmt: skip
    ws = {w.key[1]: w for w in workloads(pods, {"urgent": 100})}
    assert ws["j"].admitted and ws["j"].complete and not ws["half"].complete
    assert ws["u"].priority == 100 and ws["k"].priority == 0
    quota = nominal_quota(CQ)
    assert fits(quota, [], ws["k"]) and not fits(quota, [ws["j"]], ws["k"])
    assert preemption_victims(quota, [ws["j"]], ws["u"]) == [ws["j"]]
    assert preemption_victims(quota, [ws["j"]], ws["k"]) == []  # the same priority: never
