"""The network preflight's attribution and threshold rules on hand-made figures."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from omni_trainer.distributed.netcheck_rules import (
    PreflightConfig,
    all_gather_bus_gbps,
    all_reduce_bus_gbps,
    failure_message,
    judge,
    node_leaders,
    parse_failure,
    ring_phases,
)
from omni_trainer.termination import LIMIT_BYTES

CFG = PreflightConfig()


def ring(values: dict[str, float | None]) -> dict[tuple[str, str], float | None]:
    """Ring links of nodes in order, each named by the pair: ``{"a-b": 10}``."""
    return {tuple(k.split("-")): v for k, v in values.items()}


def test_bus_bandwidth_as_nccl_tests():
    assert all_reduce_bus_gbps(1e9, 1.0, 4) == pytest.approx(1.5)  # 2(n-1)/n
    assert all_gather_bus_gbps(1e9, 1.0, 4) == pytest.approx(0.75)  # (n-1)/n
    assert all_reduce_bus_gbps(1e9, 2.0, 2) == pytest.approx(0.5)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_ring_phases_cover_every_link_once_with_no_node_twice_in_a_phase(n):
    phases = ring_phases(n)
    edges = [e for p in phases for e in p]
    expected = {(0, 1)} if n == 2 else {(i, (i + 1) % n) for i in range(n)}
    assert set(edges) == expected and len(edges) == len(expected)
    for phase in phases:
        ends = [x for e in phase for x in e]
        assert len(ends) == len(set(ends))


def test_leaders_are_each_nodes_lowest_rank_in_order():
    assert node_leaders(["b", "b", "a", "a", "c"]) == {"b": 0, "a": 2, "c": 4}


def test_one_slow_node_of_four_is_named_by_its_best_link():
    links = ring({"a-b": 10.0, "b-c": 1.0, "c-d": 1.2, "d-a": 11.0})
    result = judge(["a", "b", "c", "d"], links, CFG)
    assert result.failed == ["c"] and result.attributed
    assert result.nodes == {"a": 11.0, "b": 10.0, "c": 1.2, "d": 11.0}
    assert result.median_gbps == 10.5 and result.floor_gbps == pytest.approx(5.25)


def test_a_healthy_node_between_two_slow_ones_is_cleared_by_the_reference():
    # b and d slow; c's two links are both slow, so c is a suspect until retimed with a
    links = ring({"a-b": 1.0, "b-c": 1.0, "c-d": 1.1, "d-e": 1.0, "e-f": 10.0, "f-a": 10.0})
    first = judge(list("abcdef"), links, CFG)
    assert first.failed == ["b", "c", "d"]
    final = judge(list("abcdef"), links, CFG, retimed={"b": 1.0, "c": 9.5, "d": 0.9})
    assert final.failed == ["b", "d"]
    assert final.nodes["c"] == 9.5


def test_a_silent_node_fails_and_is_not_retimed_into_a_pass():
    links = ring({"a-b": 10.0, "b-c": None, "c-a": None})
    result = judge(["a", "b", "c"], links, CFG, retimed={})
    assert result.failed == ["c"] and result.nodes["c"] is None


def test_two_nodes_one_slow_link_cannot_be_attributed():
    cfg = PreflightConfig(min_bandwidth_gbps=5)
    result = judge(["a", "b"], ring({"a-b": 1.0}), cfg)
    assert result.failed == ["a", "b"] and not result.attributed
    assert result.median_gbps is None and result.floor_gbps == 5
    assert judge(["a", "b"], ring({"a-b": 6.0}), cfg).passed


def test_no_relative_floor_below_three_nodes_and_absolute_floor_always():
    assert judge(["a", "b"], ring({"a-b": 0.001}), CFG).passed  # nothing to compare with
    cfg = PreflightConfig(min_bandwidth_gbps=20)
    all_slow = judge(list("abc"), ring({"a-b": 10.0, "b-c": 10.0, "c-a": 10.0}), cfg)
    assert all_slow.failed == ["a", "b", "c"]  # the median cannot catch it, the floor does
    assert judge(list("abc"), ring({"a-b": 10.0, "b-c": 10.0, "c-a": 10.0}), CFG).passed


def test_defaults_on_for_more_than_one_node_and_validation_names_fields():
    assert not CFG.applies(1) and CFG.applies(2)
    assert PreflightConfig(enabled=False).applies(8) is False
    assert PreflightConfig(size_mb=1).nbytes == 2**20
    with pytest.raises(ValidationError, match="minFractionOfMedian"):
        PreflightConfig.model_validate({"minFractionOfMedian": 1.5})
    with pytest.raises(ValidationError, match="timeoutSeconds"):
        PreflightConfig.model_validate({"timeoutSeconds": 1})


def test_failure_message_round_trips():
    result = judge(list("abc"), ring({"a-b": 10.0, "b-c": 1.0, "c-a": 1.0}), CFG)
    doc = parse_failure(failure_message(result))
    assert doc["failed"] == ["c"] and doc["passed"] is False and doc["nodes"]["a"] == 10.0
    assert parse_failure("RuntimeError: boom") is None
    assert parse_failure("PreflightFailed: not json") is None


def test_a_large_gangs_failure_message_keeps_the_failed_nodes_within_the_limit():
    nodes = [f"node-{i:04d}" for i in range(400)]
    links = {(a, b): 10.0 for a, b in zip(nodes, nodes[1:] + nodes[:1], strict=True)}
    links[(nodes[6], nodes[7])] = links[(nodes[7], nodes[8])] = 1.0
    message = failure_message(judge(nodes, links, CFG))
    assert len(message.encode()) <= LIMIT_BYTES
    assert parse_failure(message)["nodes"] == {"node-0007": 1.0}
