"""The dataflow table: megatron's op order, validation of the joint schedule, the planners."""

from __future__ import annotations

import itertools
import random
import sys

import pytest

from omni_trainer.multiplex.dataflow.auto import HEADROOM
from omni_trainer.multiplex.dataflow.display import format_dataflow
from omni_trainer.multiplex.dataflow.plan import POLICIES, plan_dataflow
from omni_trainer.multiplex.dataflow.schedule import DataflowError, LLMOp, stage_ops
from omni_trainer.multiplex.dataflow.simulate import simulate
from omni_trainer.multiplex.dataflow.table import (
    POST,
    PRE,
    DataflowTable,
    EncoderMicroBatch,
    Slot,
    from_paper_notation,
)
from omni_trainer.multiplex.dataflow.validate import validate_dataflow


def ops(text: str) -> list[LLMOp]:
    """``"F0 B0 F1.1"`` -> ops (``.c`` = model chunk)."""
    out = []
    for tok in text.split():
        m, _, c = tok[1:].partition(".")
        out.append(LLMOp(tok[0], int(m), int(c or 0)))  # type: ignore[arg-type]
    return out


def mbs_for(num_microbatches: int, modalities: tuple[str, ...] = ("image", "audio"), cost=1.0):
    """One encoder mb per modality per LLM micro-batch, ids in (micro-batch, modality) order."""
    return [
        EncoderMicroBatch(i, m, mod, cost)
        for i, (m, mod) in enumerate(itertools.product(range(num_microbatches), modalities))
    ]


# ------------------------------------------------------------------ stage_ops


@pytest.mark.parametrize(
    ("pp", "vpp", "m", "stage", "expected"),
    [
        (1, 1, 3, 0, "F0 B0 F1 B1 F2 B2"),
        (2, 1, 4, 0, "F0 F1 B0 F2 B1 F3 B2 B3"),
        (2, 1, 4, 1, "F0 B0 F1 B1 F2 B2 F3 B3"),
        (4, 1, 4, 0, "F0 F1 F2 F3 B0 B1 B2 B3"),
        (4, 1, 4, 1, "F0 F1 F2 B0 F3 B1 B2 B3"),
        (4, 1, 4, 3, "F0 B0 F1 B1 F2 B2 F3 B3"),
        (4, 1, 2, 0, "F0 F1 B0 B1"),  # fewer micro-batches than warmup
        (
            2,
            2,
            4,
            0,
            "F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0",
        ),
        (
            2,
            2,
            4,
            1,
            "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0",
        ),
    ],
)
def test_stage_ops_match_hand_written_megatron_order(pp, vpp, m, stage, expected) -> None:
    assert stage_ops(stage=stage, pp=pp, vpp=vpp, num_microbatches=m) == ops(expected)


@pytest.mark.parametrize(
    ("pp", "vpp", "m"), [(2, 1, 3), (4, 1, 8), (2, 2, 6), (4, 2, 8), (3, 3, 6)]
)
def test_every_op_once_and_forward_before_backward(pp, vpp, m) -> None:
    for stage in range(pp):
        seq = stage_ops(stage=stage, pp=pp, vpp=vpp, num_microbatches=m)
        assert sorted(seq, key=lambda o: (o.kind, o.microbatch, o.chunk)) == [
            LLMOp(k, i, c) for k in "BF" for i in range(m) for c in range(vpp)
        ]
        for i, c in itertools.product(range(m), range(vpp)):
            assert seq.index(LLMOp("F", i, c)) < seq.index(LLMOp("B", i, c))


@pytest.mark.parametrize(
    ("pp", "vpp", "m", "match"),
    [
        (2, 2, 3, "multiple of pp=2"),
        (4, 2, 2, "multiple of pp=4"),
        (1, 2, 4, "needs pp > 1"),
        (0, 1, 4, ">= 1"),
        (2, 1, 0, ">= 1"),
    ],
)
def test_stage_ops_rejects_layouts_megatron_refuses(pp, vpp, m, match) -> None:
    with pytest.raises(DataflowError, match=match):
        stage_ops(stage=0, pp=pp, vpp=vpp, num_microbatches=m)
    with pytest.raises(DataflowError, match="outside"):
        stage_ops(stage=2, pp=2, vpp=1, num_microbatches=4)


# ------------------------------------------------------------------ planners

GRID = [(1, 1, 3), (2, 1, 1), (2, 1, 4), (2, 1, 5), (4, 1, 4), (4, 1, 8), (2, 2, 4), (4, 2, 8)]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize(("pp", "vpp", "m"), GRID)
def test_every_policy_validates(policy, pp, vpp, m) -> None:
    mbs = [
        EncoderMicroBatch(i, e.microbatch, e.modality, 0.3 + (i * 7919 % 13) / 5)
        for i, e in enumerate(mbs_for(m, ("image", "audio", "video")))
    ]
    table = plan_dataflow(policy, pp=pp, vpp=vpp, num_microbatches=m, encoder_mbs=mbs)
    validate_dataflow(table)
    for e in mbs:
        assert table.forward[e.id].stage == table.backward[e.id].stage
    assert simulate(table)["makespan"] > 0


def reference_makespan(table: DataflowTable) -> float:
    """The time model's makespan built here from megatron's op order and the table alone (F 1,
    B 2, encoder forward cost, backward 2 x cost), longest path by relaxing every edge until
    nothing changes: independent of the planners' incremental graph."""
    weight: dict[tuple, float] = {}
    edges: list[tuple[tuple, tuple]] = []
    slot_of: dict[tuple[int, int, int], tuple] = {}
    for s in range(table.pp):
        prev: tuple = ("slot", s, PRE)
        weight[prev] = 0.0
        i = 0
        for op in stage_ops(
            stage=s, pp=table.pp, vpp=table.vpp, num_microbatches=table.num_microbatches
        ):
            if op.kind == "F":
                slot_of[(s, op.microbatch, op.chunk)] = ("slot", s, i)
                weight[("slot", s, i)] = 0.0
                edges.append((prev, ("slot", s, i)))
                prev, i = ("slot", s, i), i + 1
            node = (op.kind, s, op.microbatch, op.chunk)
            weight[node] = 1.0 if op.kind == "F" else 2.0
            edges.append((prev, node))
            prev = node
        weight[("slot", s, POST)] = 0.0
        edges.append((prev, ("slot", s, POST)))
    last = table.pp - 1
    for m, c in itertools.product(range(table.num_microbatches), range(table.vpp)):
        for s in range(1, table.pp):
            edges += [
                (("F", s - 1, m, c), slot_of[(s, m, c)]),
                (("B", s, m, c), ("B", s - 1, m, c)),
            ]
        if c > 0:
            edges.append((("F", last, m, c - 1), slot_of[(0, m, c)]))
        if c < table.vpp - 1:
            edges.append((("B", 0, m, c + 1), ("B", last, m, c)))
    for e in table.encoder_mbs:
        fs, bs = table.forward[e.id], table.backward[e.id]
        weight[("slot", fs.stage, fs.index)] += e.cost
        weight[("slot", bs.stage, bs.index)] += 2.0 * e.cost
        edges += [(("slot", fs.stage, fs.index), ("F", 0, e.microbatch, 0))]
        edges += [(("B", 0, e.microbatch, 0), ("slot", bs.stage, bs.index))]
    start = dict.fromkeys(weight, 0.0)
    changed = True
    while changed:
        changed = False
        for a, b in edges:
            if start[a] + weight[a] > start[b]:
                start[b], changed = start[a] + weight[a], True
    return max(start[v] + weight[v] for v in weight)


def test_the_time_model_is_the_longest_path_for_every_policy_and_layout() -> None:
    """Every policy's tables over the grid and valid tables with random slots, one after another
    (the planners copy one cached graph per layout and try placements on it in place, in a
    topological order kept from the last full sort): simulate's makespan is the reference
    longest path each time, and the same again for the first table at the end."""
    tables = []
    for (pp, vpp, m), policy in itertools.product(GRID, POLICIES):
        mbs = [
            EncoderMicroBatch(i, e.microbatch, e.modality, 0.2 + (i * 7919 % 11) / 4)
            for i, e in enumerate(mbs_for(m, ("image", "audio")))
        ]
        tables.append(plan_dataflow(policy, pp=pp, vpp=vpp, num_microbatches=m, encoder_mbs=mbs))
    rng = random.Random(0)
    while len(tables) < 300:  # and tables no planner would make: slots drawn at random
        pp, vpp, m = rng.choice(GRID)
        mbs = [
            EncoderMicroBatch(i, e.microbatch, e.modality, rng.uniform(0.1, 3))
            for i, e in enumerate(mbs_for(m))
        ]
        n = m * vpp
        stage = {e.id: rng.randrange(pp) for e in mbs}
        fwd = {e.id: Slot(stage[e.id], rng.choice([PRE, *range(n)])) for e in mbs}
        bwd = {e.id: Slot(stage[e.id], rng.choice([*range(n), POST])) for e in mbs}
        for slots in (fwd, bwd):  # ascending (micro-batch, id) order on every stage
            for k in range(pp):
                ids = [e.id for e in mbs if stage[e.id] == k]
                for i, index in zip(ids, sorted(slots[i].index for i in ids), strict=True):
                    slots[i] = Slot(k, index)
        table = DataflowTable(pp, vpp, m, tuple(mbs), fwd, bwd)
        try:
            validate_dataflow(table)
        except DataflowError:
            continue
        tables.append(table)
    for table in [*tables, tables[0]]:
        assert simulate(table)["makespan"] == pytest.approx(reference_makespan(table), abs=1e-9)


def test_stage0_puts_everything_on_stage_0_just_in_time() -> None:
    table = plan_dataflow("stage0", pp=2, vpp=1, num_microbatches=4, encoder_mbs=mbs_for(4))
    assert {s.stage for s in [*table.forward.values(), *table.backward.values()]} == {0}
    # stage 0 runs F0 F1 B0 F2 B1 F3 B2 B3: forward slot i is just before F(i)
    assert [table.forward[i].index for i in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    # backward: first forward slot after B(m): B0 -> F2 (slot 2), B1 -> F3, B2 and B3 -> POST
    assert [table.backward[i].index for i in range(8)] == [2, 2, 3, 3, POST, POST, POST, POST]


def test_front_loaded_is_pre_and_post_balanced() -> None:
    table = plan_dataflow("front_loaded", pp=4, vpp=1, num_microbatches=8, encoder_mbs=mbs_for(8))
    assert {s.index for s in table.forward.values()} == {PRE}
    assert {s.index for s in table.backward.values()} == {POST}
    assert [table.stage_cost(k) for k in range(4)] == [4.0] * 4


@pytest.mark.parametrize(("pp", "vpp", "m"), [(2, 1, 4), (4, 1, 8), (4, 2, 8)])
def test_uniform_balances_and_inserts_on_demand(pp, vpp, m) -> None:
    mbs = mbs_for(m)
    table = plan_dataflow("uniform", pp=pp, vpp=vpp, num_microbatches=m, encoder_mbs=mbs)
    loads = [table.stage_cost(k) for k in range(pp)]
    assert max(loads) - sum(loads) / pp <= 1.0  # equal costs: LPT within one mb of the mean
    assert any(s.index not in (PRE, POST) for s in table.forward.values())
    assert any(s.index not in (PRE, POST) for s in table.backward.values())
    # stage 0 never front-loads: micro-batch 0 just before F(0, 0); later ones before F(m, 0) or
    # earlier where the time model finds idle time to fill (stage 0 waiting for a backward)
    assert table.forward[0] == Slot(0, 0)
    assert all(s.index != PRE for s in table.forward.values() if s.stage == 0)
    # and it keeps no more encoder activation memory alive than front-loading
    front = plan_dataflow("front_loaded", pp=pp, vpp=vpp, num_microbatches=m, encoder_mbs=mbs)
    peak = [s["peak_encoder_activations"] for s in simulate(table)["stages"]]
    peak_front = [s["peak_encoder_activations"] for s in simulate(front)["stages"]]
    assert max(peak) <= max(peak_front)
    if vpp == 1:  # interleaved: chunk-0 backwards come last, so encoder backwards wait anyway
        assert max(peak) < max(peak_front)


def test_uniform_balances_unequal_costs_by_lpt() -> None:
    costs = [5.0, 4.0, 3.0, 3.0, 2.0, 2.0, 1.0, 1.0]
    mbs = [EncoderMicroBatch(i, i // 2, "image", c) for i, c in enumerate(costs)]
    table = plan_dataflow("uniform", pp=2, vpp=1, num_microbatches=4, encoder_mbs=mbs)
    assert sorted(table.stage_cost(k) for k in range(2)) == [10.0, 11.0]


# auto. pp2 with 2 micro-batches in the time model (F 1, B 2, encoder forward = cost, backward =
# 2 x cost), LLM alone: stage 0 F0 [0,1] F1 [1,2] B0 [4,6] B1 [7,9]; stage 1 F0 [1,2] B0 [2,4]
# F1 [4,5] B1 [5,7]. Stage 1 idles in [0,1) (warm-up) and [7,9) (cool-down).


def test_auto_fills_the_warm_up_bubble() -> None:
    """Micro-batch 1's images (cost 1), needed by stage 0's F1 at t=1: stage 1's PRE runs them
    in its warm-up idle [0,1) and delays no LLM op; stage 0 would delay F1 by 1. The backward
    cannot hide: the gradient leaves stage 0's B1 at 9, so the step ends at 9 + 2."""
    table = plan_dataflow(
        "auto", pp=2, vpp=1, num_microbatches=2, encoder_mbs=[EncoderMicroBatch(0, 1)]
    )
    assert table.forward[0] == Slot(1, PRE)
    assert table.backward[0] == Slot(1, POST)
    assert simulate(table)["makespan"] == 11.0


def test_auto_puts_backwards_in_the_cool_down_bubble() -> None:
    """Micro-batch 0's images must precede F0 anywhere (everything shifts by 1: B(0) on stage 0
    ends at 7). Their backward (2) then runs on stage 1 after its B1 ends at 8, in parallel with
    stage 0's B1 [8,10]: step 10. On stage 0 (uniform's choice) it runs after B1: step 12."""
    mbs = [EncoderMicroBatch(0, 0)]
    table = plan_dataflow("auto", pp=2, vpp=1, num_microbatches=2, encoder_mbs=mbs)
    assert (table.forward[0].stage, table.backward[0]) == (1, Slot(1, POST))
    assert simulate(table)["makespan"] == 10.0
    uniform = plan_dataflow("uniform", pp=2, vpp=1, num_microbatches=2, encoder_mbs=mbs)
    assert simulate(uniform)["makespan"] == 12.0


def _peak_and_makespan(table: DataflowTable) -> tuple[float, float]:
    sim = simulate(table)
    return max(s["peak_encoder_activations"] for s in sim["stages"]), sim["makespan"]


def test_auto_front_loads_only_as_far_as_the_budget_allows() -> None:
    """pp2, 8 micro-batches of cost-1 images: front-loading (39) holds 4 mbs' activations per
    stage, uniform holds 2 (41). auto's default budget is uniform's peak x 1.1 (2.2: no third mb
    fits), an explicit one overrides it. With room for 4, auto front-loads 3 on stage 0 and runs
    the 4th after F(0), while stage 0 waits for B(0)'s gradient anyway: stage 0's F(0) ends at 4
    (front-loading: 5), stage 1's B(0) at 7 (8), and the step at 38."""
    kw = {"pp": 2, "vpp": 1, "num_microbatches": 8, "encoder_mbs": mbs_for(8, ("image",))}
    assert _peak_and_makespan(plan_dataflow("front_loaded", **kw)) == (4.0, 39.0)
    assert _peak_and_makespan(plan_dataflow("uniform", **kw)) == (2.0, 41.0)
    assert _peak_and_makespan(plan_dataflow("auto", **kw)) == (2.0, 40.0)
    assert _peak_and_makespan(plan_dataflow("auto", **kw, budget=[4.0, 4.0])) == (4.0, 38.0)
    # budget 3: front-loading 3 of stage 0's 4 mbs is not a choice; auto fits and gains
    assert _peak_and_makespan(plan_dataflow("auto", **kw, budget=3.0))[0] <= 3.0
    # budgets the greedy cannot meet (1: each stage alternates mbs; 0.5: below one mb): still a
    # valid table (plan_dataflow validates), no larger than uniform's, and no slower
    for budget in (1.0, 0.5):
        assert _peak_and_makespan(plan_dataflow("auto", **kw, budget=budget)) <= (2.0, 41.0)
    with pytest.raises(DataflowError, match="budget names 3 stages, the pipeline has 2"):
        plan_dataflow("auto", **kw, budget=[1.0, 1.0, 1.0])


def test_auto_on_shared_cores_front_loads_where_that_fits_and_plans_where_not() -> None:
    """The same pipeline on stages that share cores: with room for front-loading (4 mbs) auto
    takes front_loaded's table itself (39, not the 38 that counts stage 0's wait as free);
    within the default budget (2.2, where front-loading does not fit) it plans as on dedicated
    devices (2.0 and 40)."""
    kw = {"pp": 2, "vpp": 1, "num_microbatches": 8, "encoder_mbs": mbs_for(8, ("image",))}
    front = plan_dataflow("front_loaded", **kw)
    shared = plan_dataflow("auto", **kw, budget=4.0, shared_cores=True)
    assert (shared.forward, shared.backward) == (front.forward, front.backward)
    assert shared.policy == "auto" and _peak_and_makespan(shared) == (4.0, 39.0)
    tight = plan_dataflow("auto", **kw, shared_cores=True)
    dedicated = plan_dataflow("auto", **kw)
    assert (tight.forward, tight.backward) == (dedicated.forward, dedicated.backward)
    assert _peak_and_makespan(tight) == (2.0, 40.0)


def test_auto_default_budget_is_uniforms_peak_with_headroom_within_the_device() -> None:
    """The same pipeline (uniform 2 mbs per stage, front-loading 4). The device's room never
    loosens the default (a large one still gives 2.0 and 40); a small one tightens it (room for
    1.5 mbs on stage 0: auto keeps the table whose stage 0 exceeds least, at most uniform's); an
    explicit budget overrides both."""
    kw = {"pp": 2, "vpp": 1, "num_microbatches": 8, "encoder_mbs": mbs_for(8, ("image",))}
    assert HEADROOM == 1.1
    assert _peak_and_makespan(plan_dataflow("auto", **kw, device_budget=1e9)) == (2.0, 40.0)
    tight = plan_dataflow("auto", **kw, device_budget=[1.5, 1e9])
    assert simulate(tight)["stages"][0]["peak_encoder_activations"] <= 2.0
    both = plan_dataflow("auto", **kw, budget=4.0, device_budget=1.0)
    assert _peak_and_makespan(both) == (4.0, 38.0)  # as in the test above


def test_auto_within_the_headroom_or_uniforms_peak_beats_both_fixed_policies() -> None:
    """pp2, 4 micro-batches of image + audio, costs and bytes differing by up to 30% and 10%:
    front_loaded 30.6 (peaks 4.2 and 4.15), uniform 32 (3.15 and 4.15). Within uniform's peak x
    1.1 (4.565) auto front-loads 3 of stage 0's 4 mbs and runs the 4th after F(0), in stage 0's
    wait for B(0)'s gradient: 30.3. Held to uniform's peak (4.15) it front-loads nothing on
    stage 0 and fills its waits instead: 30.2, with uniform's peaks."""
    mbs = [
        EncoderMicroBatch(e.id, e.microbatch, e.modality, 1 + 0.3 * (e.id % 3), 1 + e.id % 3 / 20)
        for e in mbs_for(4, ("image", "audio"))
    ]
    kw = {"pp": 2, "vpp": 1, "num_microbatches": 4, "encoder_mbs": mbs}
    uniform = _peak_and_makespan(plan_dataflow("uniform", **kw))
    assert uniform == pytest.approx((4.15, 32.0))
    assert _peak_and_makespan(plan_dataflow("front_loaded", **kw)) == pytest.approx((4.2, 30.6))
    default = plan_dataflow("auto", **kw)
    assert _peak_and_makespan(default) == pytest.approx((4.2, 30.3))
    assert [default.forward[i].index for i in (1, 2, 6, 7)] == [PRE, PRE, PRE, 1]
    held = plan_dataflow("auto", **kw, budget=uniform[0])
    assert _peak_and_makespan(held) == pytest.approx((4.15, 30.2))
    assert simulate(held)["stages"][0]["peak_encoder_activations"] == pytest.approx(3.15)


@pytest.mark.parametrize(("pp", "vpp", "m"), GRID)
@pytest.mark.parametrize("cost", [0.5, 1.5, 3.0])
def test_auto_is_never_worse_than_a_fixed_policy_within_its_budget(pp, vpp, m, cost) -> None:
    """Time model: auto's makespan <= that of every fixed policy whose peak fits the budget
    (uniform's peak x HEADROOM by default), and its own peak stays within it."""
    kw = {"pp": pp, "vpp": vpp, "num_microbatches": m, "encoder_mbs": mbs_for(m, cost=cost)}
    auto_peak, auto_time = _peak_and_makespan(plan_dataflow("auto", **kw))
    budget = HEADROOM * _peak_and_makespan(plan_dataflow("uniform", **kw))[0]
    assert auto_peak <= budget + 1e-9
    for policy in ("uniform", "front_loaded", "stage0"):
        peak, makespan = _peak_and_makespan(plan_dataflow(policy, **kw))
        if peak <= budget + 1e-9:
            assert auto_time <= makespan + 1e-9, policy


@pytest.mark.parametrize(("pp", "vpp", "m"), [(2, 1, 4), (2, 1, 5), (2, 1, 8), (4, 1, 8)])
def test_auto_in_bytes_front_loads_where_that_fits_and_stays_within_where_not(pp, vpp, m) -> None:
    """Activations in bytes (as the trainer's mbs carry them), costs differing from them: with
    front_loaded's own peak as the budget auto is at least as fast; with a budget front_loaded
    exceeds (uniform's peak), auto keeps within it."""
    mbs = [
        EncoderMicroBatch(e.id, e.microbatch, e.modality, 0.5 + e.id % 3, 1e6 * (1 + e.id % 2))
        for e in mbs_for(m)
    ]
    kw = {"pp": pp, "vpp": vpp, "num_microbatches": m, "encoder_mbs": mbs}
    front_peak, front_time = _peak_and_makespan(plan_dataflow("front_loaded", **kw))
    uniform_peak, _ = _peak_and_makespan(plan_dataflow("uniform", **kw))
    peak, makespan = _peak_and_makespan(plan_dataflow("auto", **kw, budget=front_peak))
    assert peak <= front_peak and makespan <= front_time + 1e-9
    assert front_peak > uniform_peak  # front_loaded does not fit the tighter budget
    peak, _ = _peak_and_makespan(plan_dataflow("auto", **kw, budget=uniform_peak))
    assert peak <= uniform_peak


def test_planner_rejects_bad_input() -> None:
    with pytest.raises(DataflowError, match="appears twice"):
        plan_dataflow(
            "uniform", pp=2, vpp=1, num_microbatches=2, encoder_mbs=[EncoderMicroBatch(0, 0)] * 2
        )
    with pytest.raises(DataflowError, match="micro-batch outside"):
        plan_dataflow(
            "uniform", pp=2, vpp=1, num_microbatches=2, encoder_mbs=[EncoderMicroBatch(0, 5)]
        )
    with pytest.raises(DataflowError, match="unknown policy"):
        plan_dataflow("greedy", pp=2, vpp=1, num_microbatches=2, encoder_mbs=[])  # type: ignore[arg-type]


# ------------------------------------------------------------------ validation


def table_with(forward: dict[int, Slot], backward: dict[int, Slot], mbs) -> DataflowTable:
    return DataflowTable(2, 1, 4, tuple(mbs), forward, backward)


def test_validator_names_the_deadlocking_encoder_mb() -> None:
    mbs = [EncoderMicroBatch(3, 1, "image")]
    # stage 1 runs F0 B0 F1 B1 F2 ...: slot 2 is before F(2), which needs stage 0's F(2), after F(1)
    table = table_with({3: Slot(1, 2)}, {3: Slot(1, POST)}, mbs)
    with pytest.raises(DataflowError) as err:
        validate_dataflow(table)
    msg = str(err.value)
    assert "encoder mb 3 (image of micro-batch 1) runs on stage 1 before F(2)" in msg
    assert "stage 0 needs it at F(1), which stage 1's F(2) depends on" in msg
    assert msg.endswith("deadlock")
    validate_dataflow(table_with({3: Slot(1, PRE)}, {3: Slot(1, POST)}, mbs))


def test_validator_rejects_backward_before_its_gradient() -> None:
    mbs = [EncoderMicroBatch(0, 0, "audio")]
    with pytest.raises(
        DataflowError,
        match=r"encoder mb 0 \(audio of micro-batch 0\) runs its "
        r"backward on stage 1 before F\(0\).*B\(0\).*deadlock",
    ):
        validate_dataflow(table_with({0: Slot(1, PRE)}, {0: Slot(1, 0)}, mbs))
    # slot 1 on stage 1 comes after its B(0), so stage 0's B(0) does not wait on it: valid
    validate_dataflow(table_with({0: Slot(1, PRE)}, {0: Slot(1, 1)}, mbs))


def test_validator_rejects_descending_order() -> None:
    mbs = [EncoderMicroBatch(0, 0), EncoderMicroBatch(1, 1), EncoderMicroBatch(2, 2)]
    fwd = {0: Slot(1, PRE), 1: Slot(1, 0), 2: Slot(1, PRE)}
    bwd = dict.fromkeys(range(3), Slot(1, POST))
    with pytest.raises(
        DataflowError,
        match=r"encoder mb 1 \(image of micro-batch 1\) runs its "
        r"forward on stage 1 before F\(0\), after encoder mb 2.*ascending",
    ):
        validate_dataflow(table_with(fwd, bwd, mbs))


@pytest.mark.parametrize(
    ("fwd", "bwd", "match"),
    [
        (Slot(0, PRE), Slot(1, POST), "forward on stage 0 but backward on stage 1"),
        (Slot(2, PRE), Slot(2, POST), "does not exist"),
        (Slot(0, 4), Slot(0, POST), "does not exist"),
        (Slot(0, POST), Slot(0, POST), "deadlock"),
    ],
)
def test_validator_rejects_bad_slots(fwd, bwd, match) -> None:
    with pytest.raises(DataflowError, match=match):
        validate_dataflow(table_with({0: fwd}, {0: bwd}, [EncoderMicroBatch(0, 0)]))
    with pytest.raises(DataflowError, match="exactly one backward"):
        validate_dataflow(table_with({0: Slot(0, PRE)}, {}, [EncoderMicroBatch(0, 0)]))


# ------------------------------------------------------------------ notation and display


def test_paper_notation_conventions_and_round_trip() -> None:
    table = plan_dataflow("stage0", pp=2, vpp=1, num_microbatches=4, encoder_mbs=mbs_for(4))
    notation = table.paper_notation()
    # stage 0: F0 F1 B0 F2 B1 F3 B2 B3
    assert notation[0] == (0, [None, 1])  # before F(0), the stage's first op
    assert notation[4] == (0, [-1, 3])  # micro-batch 2: after B(0), before F(2)
    assert notation[-1] == (0, [-1, 3])  # backward of mb 0 right after B(0)
    assert notation[-(6 + 1)] == (0, [None, None])  # backward at POST
    for policy in POLICIES:
        for pp, vpp, m in [(2, 1, 4), (4, 1, 8)]:
            t = plan_dataflow(policy, pp=pp, vpp=vpp, num_microbatches=m, encoder_mbs=mbs_for(m))
            back = from_paper_notation(
                t.paper_notation(), pp=pp, vpp=vpp, num_microbatches=m, encoder_mbs=t.encoder_mbs
            )
            assert back == t
            assert DataflowTable.from_dict(t.to_dict()) == t


def test_format_lists_ops_with_encoder_work() -> None:
    table = plan_dataflow("stage0", pp=2, vpp=1, num_microbatches=2, encoder_mbs=mbs_for(2))
    text = format_dataflow(table)
    assert "stage 0 (encoder cost 4): | | E0 E1 F(0) E2 E3 F(1) B(0) B(1) | E0' E1' E2' E3' |" in (
        text
    )
    assert "stage 1 (encoder cost 0): | | F(0) B(0) F(1) B(1) | |" in text
    assert "-1: (0, [None, None])" in text


def test_dataflow_does_not_import_torch() -> None:
    import subprocess

    modules = ("plan", "simulate", "display")  # the top of the package: it imports the rest
    code = (
        f"import sys, importlib; [importlib.import_module('omni_trainer.multiplex.dataflow.' + m) "
        f"for m in {modules!r}]; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
