"""Volcano as the gang scheduler (``scheduling.volcanoGang``): the job's PodGroup spec (pure).

All node pods form one PodGroup (``minMember`` = nodes), admitted together or not at all, in
``scheduling.volcanoQueue`` with the job's priority. With ``scheduling.topologyAware`` the
PodGroup also carries the layout's network constraints for Volcano's network-topology-aware
scheduling ("Network Topology Aware Scheduling", HyperNode CRDs):

* HyperNode tiers count from the leaf switches up: tier 1 is the finest level of
  ``topology.networkDomainLabels``, tier ``k`` its ``k``-th label from the end, as Volcano's
  label-based HyperNode discovery builds them when given the same labels.
* A reorder group (``topology.reorderGroupSize`` consecutive node ranks) must share a tier-1
  HyperNode: when one group is the whole job, the PodGroup's ``networkTopology`` is ``hard``
  at tier 1; else each group is a ``subGroupPolicy`` sub-group (its pods share the
  :data:`REORDER_GROUP_LABEL` value) held hard at tier 1, and the whole job asks ``soft``, as
  placement keeps it compact without requiring one domain.
"""

from __future__ import annotations

from typing import Any

from omni_operator.spec import GROUP, OmniTrainingJobSpec

Obj = dict[str, Any]
REORDER_GROUP_LABEL = f"{GROUP}/reorder-group"
"""On a gang pod with network constraints: its reorder group, which Volcano's sub-groups key on."""
LEAF_TIER = 1
SUB_GROUP = "reorder-group"


def pod_group_spec(spec: OmniTrainingJobSpec) -> Obj:
    """The PodGroup's ``spec``: gang size, queue, priority and, with
    ``scheduling.topologyAware``, the network constraints (see the module docstring)."""
    sched = spec.scheduling
    out: Obj = {"minMember": spec.nodes}
    if sched.volcano_queue:
        out["queue"] = sched.volcano_queue
    if sched.priority_class_name:
        out["priorityClassName"] = sched.priority_class_name
    if sched.topology_aware:
        out.update(network_topology(spec))
    return out


def network_topology(spec: OmniTrainingJobSpec) -> Obj:
    """``networkTopology`` and, with several reorder groups, ``subGroupPolicy``.

    Args:
        spec: a validated spec with ``topology.networkDomainLabels`` set.

    Returns:
        The PodGroup spec fields that hold the layout's network constraints.
    """
    hard = {"mode": "hard", "highestTierAllowed": LEAF_TIER}
    if spec.group_size == spec.nodes:
        return {"networkTopology": hard}
    return {
        "networkTopology": {"mode": "soft"},
        "subGroupPolicy": [
            {
                "name": SUB_GROUP,
                "subGroupSize": spec.group_size,
                "labelSelector": {
                    "matchExpressions": [{"key": REORDER_GROUP_LABEL, "operator": "Exists"}]
                },
                "matchLabelKeys": [REORDER_GROUP_LABEL],
                "networkTopology": hard,
            }
        ],
    }
