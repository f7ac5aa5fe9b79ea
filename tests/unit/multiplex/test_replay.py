"""The replay simulator: hand-computed pipelines, processor sharing, and the op-time fit."""

from __future__ import annotations

import itertools

import pytest

from omni_trainer.multiplex.dataflow.plan import plan_dataflow
from omni_trainer.multiplex.dataflow.schedule import DataflowError
from omni_trainer.multiplex.dataflow.simulate import simulate
from omni_trainer.multiplex.dataflow.table import POST, PRE, DataflowTable, EncoderMicroBatch, Slot
from omni_trainer.multiplex.replay import OpTimes, fit_op_times, replay

UNIT = OpTimes(llm_forward=1.0, llm_backward=2.0, encoder_forward=1.0, encoder_backward=2.0)


def table(pp: int = 2, *, encoders_on: int | None = None, num_microbatches: int = 2):
    """1F1B, one chunk; with ``encoders_on`` one cost-1 encoder mb per micro-batch on that
    stage, forwards at PRE, backwards at POST (front-loaded)."""
    mbs = () if encoders_on is None else tuple(
        EncoderMicroBatch(m, m, cost=1.0) for m in range(num_microbatches)
    )  # fmt: skip
    return DataflowTable(
        pp, 1, num_microbatches, mbs,
        forward={e.id: Slot(encoders_on, PRE) for e in mbs},
        backward={e.id: Slot(encoders_on, POST) for e in mbs},
    )  # fmt: skip


def seconds(r) -> list[tuple[float, float, float]]:
    return [(s.encoder, s.llm, s.waiting) for s in r.stages]


def test_two_stages_two_microbatches_a_device_each() -> None:
    # stage 0: F0 [0,1] F1 [1,2] | waits B0 of stage 1 | B0 [4,6] | waits | B1 [7,9]
    # stage 1: waits F0 | F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7]
    r = replay(table(), [UNIT, UNIT])
    assert seconds(r) == [(0.0, 6.0, 3.0), (0.0, 6.0, 1.0)]
    assert [s.finish for s in r.stages] == [9.0, 7.0] and r.makespan == 9.0


def test_the_trace_gives_each_ops_wait_and_end() -> None:
    """The same pipeline traced: stage 1 reaches its first p2p call (recv F0) at 0 and it ends
    at 1; its F0 runs [1,2]; stage 0 waits in its second call (send F1, receive B0's gradient)
    from 2 to 4, when stage 1 sends after its B0; every stage's ops follow each other and its
    waits add up to its waiting."""
    trace: list = []
    r = replay(table(), [UNIT, UNIT], trace=trace)
    ops = {(s, key): (reached, ended) for s, key, _, reached, ended in trace}
    assert ops[(1, ("P", 1, 0))] == (0.0, 1.0)
    assert ops[(1, ("F", 1, 0, 0))] == (1.0, 2.0)
    assert ops[(0, ("F", 0, 1, 0))] == (1.0, 2.0)
    assert ops[(0, ("P", 0, 1))] == (2.0, 4.0)
    for stage in (0, 1):
        mine = [(a, b, kind) for s, _, kind, a, b in trace if s == stage]
        assert all(x[1] == y[0] for x, y in itertools.pairwise(mine))
        waited = sum(b - a for a, b, kind in mine if kind == "p2p")
        assert waited == pytest.approx(r.stages[stage].waiting)


def test_two_stages_share_one_core() -> None:
    # t 1-3: stage 0's F1 and stage 1's F0 share the core (each at half speed); t 5-7 B0 (s0)
    # and F1 (s1); t 7-9 B0's last half and B1's first; the core never idles: 12 s of work
    r = replay(table(), [UNIT, UNIT], cores=1)
    assert seconds(r) == [(0.0, 9.0, 3.0), (0.0, 9.0, 1.0)]
    assert r.makespan == 12.0
    # two cores for two stages: as if each had its own device
    assert seconds(replay(table(), [UNIT, UNIT], cores=2)) == seconds(replay(table(), [UNIT] * 2))


def test_a_latency_delays_every_cross_stage_input() -> None:
    """0.5 s from the later side of a p2p call (megatron's: a rendezvous) to both sides going
    on; 0.5 s from an encoder output's end to its (buffered) receipt."""
    # stage 0: F0 [0,1], send to 1.5; F1 [1.5,2.5]; its send meets stage 1's after B0 (4.5):
    # 5; B0 [5,7]; the gradient of B1 (stage 1 sends at 8) at 8.5; B1 [8.5,10.5]
    r = replay(table(), [UNIT, UNIT], latency=0.5)
    assert seconds(r) == [(0.0, 6.0, 4.5), (0.0, 6.0, 2.5)]
    assert r.makespan == 10.5
    # stage 1 encodes (0-2): stage 0's F0 waits for E0 until 1.5, its send to 3, F1 [3,4];
    # its send meets stage 1's after B0 (6) at 6.5; B1's gradient (sent at 9.5) at 10; stage
    # 1 waits 1 s for F0's input and 0.5 s at each of its two sends; E1' waits 0.5 s for B1
    r = replay(table(encoders_on=1), [UNIT, UNIT], latency=0.5)
    assert seconds(r) == [(0.0, 6.0, 6.0), (6.0, 6.0, 2.5)]
    assert r.makespan == 14.5


def test_megatron_sends_wait_for_their_receive_to_be_posted() -> None:
    """Stage 1 encodes micro-batch 2 (3 s) before it posts its first receive: stage 0's send of
    F0 returns only at 3 (a buffered send would let it run F1 at 1); then 1F1B as usual, and E0'
    waits for stage 0's B2 (ends at 14)."""
    t = DataflowTable(
        2, 1, 3, (EncoderMicroBatch(0, 2, cost=3.0),),
        forward={0: Slot(1, PRE)}, backward={0: Slot(1, POST)},
    )  # fmt: skip
    r = replay(t, [UNIT, UNIT])
    assert seconds(r) == [(0.0, 9.0, 5.0), (9.0, 9.0, 2.0)]
    assert r.makespan == 20.0


def test_a_stage_that_prepares_its_input_longer_starts_later() -> None:
    """Stage 1 spends 2 s on its data before the schedule: stage 0's first send waits 1 s for
    its receive, the rest shifts by 1 s; data is neither compute nor waiting."""
    r = replay(table(), [UNIT, OpTimes(1.0, 2.0, data=2.0)])
    assert [(s.data, s.llm, s.waiting) for s in r.stages] == [(0.0, 6.0, 4.0), (2.0, 6.0, 0.0)]
    assert [s.finish for s in r.stages] == [10.0, 8.0]


def test_others_runnable_processes_share_the_cores_too() -> None:
    """2 cores, 2 processes of others always runnable: one stage alone runs at 2/3, two at 1/2
    (stage 0: F0 [0,1.5], F1 with stage 1's F0 [1.5,3.5], waits for B0 (3 s alone) to 6.5...)."""
    r = replay(table(), [UNIT, UNIT], cores=2, background=2.0)
    assert seconds(r) == [(0.0, 10.5, 4.5), (0.0, 10.5, 1.5)]
    assert r.makespan == 15.0


def test_encoder_outputs_and_gradients_are_waited_for() -> None:
    # stage 1 encodes both micro-batches first (0-2), so stage 0's F0 waits 1 s for E0; the
    # encoder backwards run after the schedule, E1' waits for stage 0's B1 (ends at 10)
    r = replay(table(encoders_on=1), [UNIT, UNIT])
    assert seconds(r) == [(0.0, 6.0, 4.0), (6.0, 6.0, 0.0)]
    assert [s.finish for s in r.stages] == [10.0, 12.0]


@pytest.mark.parametrize("pp,vpp,m", [(2, 1, 4), (4, 1, 8), (2, 2, 4), (4, 2, 8)])
def test_without_encoders_it_agrees_with_the_planners_simulation(pp, vpp, m) -> None:
    """An independent implementation: the happens-before graph's longest paths."""
    t = plan_dataflow("uniform", pp=pp, vpp=vpp, num_microbatches=m, encoder_mbs=())
    sim, r = simulate(t), replay(t, [UNIT] * pp)
    assert r.makespan == pytest.approx(sim["makespan"])
    for s, ours in zip(sim["stages"], r.stages, strict=True):
        assert ours.llm == pytest.approx(s["llm"])
        assert ours.waiting + r.makespan - ours.finish == pytest.approx(s["idle"])


@pytest.mark.parametrize("policy", ["uniform", "front_loaded", "stage0", "auto"])
def test_per_mb_dependencies_never_end_later_than_whole_slots(policy) -> None:
    """The planner's graph makes F(m,0) wait for a whole slot; the runtime sends each encoder
    output as soon as it is computed, so the replay finishes no later, and runs on every
    policy's table (vpp 2) without deadlock."""
    mbs = [
        EncoderMicroBatch(i, i // 2, "image" if i % 2 else "audio", 0.5 + i % 3) for i in range(8)
    ]
    t = plan_dataflow(policy, pp=2, vpp=2, num_microbatches=4, encoder_mbs=mbs)
    r = replay(t, [UNIT, UNIT])
    assert r.makespan <= simulate(t)["makespan"] + 1e-9
    assert sum(s.encoder for s in r.stages) == pytest.approx(3 * sum(e.cost for e in mbs))


def test_more_runnable_stages_than_cores_slow_down_but_keep_the_work() -> None:
    t = plan_dataflow("uniform", pp=4, vpp=1, num_microbatches=8, encoder_mbs=())
    alone, shared = replay(t, [UNIT] * 4), replay(t, [UNIT] * 4, cores=2)
    assert shared.makespan > alone.makespan
    assert shared.makespan >= 4 * 8 * 3 / 2  # 96 s of work on 2 cores
    for a, b in zip(alone.stages, shared.stages, strict=True):
        assert b.llm >= a.llm


def test_the_fit_recovers_solo_times_from_wall_seconds_on_shared_cores() -> None:
    """Wall seconds of LLM and encoder ops on one core (stretched by the sharing) fit back to
    the solo durations that produced them; no waits go in, the waits come out the same."""
    t = table(encoders_on=1)
    solo = [UNIT, OpTimes(0.5, 0.5, 2.0, 3.0, data=1.0)]  # backward/forward 1 and 1.5
    measured = [
        {"llm": s.llm, "encoder": s.encoder, "data": s.data}
        for s in replay(t, solo, cores=1).stages
    ]
    fit = fit_op_times([t], measured, cores=1, backward_ratio=[(2.0, 2.0), (1.0, 1.5)])
    for got, want in zip(fit, [OpTimes(1.0, 2.0, 0.0, 0.0), solo[1]], strict=True):
        assert got.llm_forward == pytest.approx(want.llm_forward, rel=1e-6)
        assert got.llm_backward == pytest.approx(want.llm_backward, rel=1e-6)
        assert got.encoder_forward == pytest.approx(want.encoder_forward, rel=1e-6)
        assert got.encoder_backward == pytest.approx(want.encoder_backward, rel=1e-6)
        assert got.data == pytest.approx(want.data, rel=1e-6)
    again, want = replay(t, fit, cores=1), replay(t, solo, cores=1)
    assert [s.waiting for s in again.stages] == pytest.approx([s.waiting for s in want.stages])


def test_bad_inputs_are_named() -> None:
    with pytest.raises(ValueError, match="times has 1 stages, the table 2"):
        replay(table(), [UNIT])
    with pytest.raises(ValueError, match="cores must be >= 1"):
        replay(table(), [UNIT, UNIT], cores=0)
    cyclic = DataflowTable(
        2, 1, 2, (EncoderMicroBatch(0, 0),), forward={0: Slot(1, 1)}, backward={0: Slot(1, POST)}
    )  # stage 1 encodes micro-batch 0 after its F1, which needs stage 0's F0, which needs E0
    with pytest.raises(DataflowError, match="replay deadlocked"):
        replay(cyclic, [UNIT, UNIT])


def test_jittered_ops_make_balanced_stages_wait() -> None:
    """Random op durations around the same means: the stages' rendezvous wait for the later
    side, so the mean wait grows with the jitter (a max of random times exceeds the max of
    their means); the same generator seed gives the same replay; the means keep the work."""
    import random
    from dataclasses import replace

    t = plan_dataflow("uniform", pp=2, vpp=1, num_microbatches=8, encoder_mbs=())
    calm = sum(s.waiting for s in replay(t, [UNIT, UNIT]).stages)

    def mean_wait(spread: tuple[float, ...]) -> float:
        times = [replace(UNIT, spread=spread)] * 2
        rng = random.Random(7)
        return sum(sum(s.waiting for s in replay(t, times, rng=rng).stages) for _ in range(200))

    assert mean_wait(()) / 200 == mean_wait((1.0,)) / 200 == calm
    assert calm < mean_wait((0.7, 1.3)) / 200 < mean_wait((0.4, 1.6)) / 200
    times = [replace(UNIT, spread=(0.5, 1.5))] * 2
    one, two = (replay(t, times, rng=random.Random(3)) for _ in range(2))
    assert one == two
    busy = [sum(s.llm for s in replay(t, times, rng=random.Random(i)).stages) for i in range(400)]
    assert sum(busy) / len(busy) == pytest.approx(2 * 8 * 3, rel=0.05)
    assert OpTimes(1.0, 2.0).draw(random.Random(0)) == 1.0
    assert OpTimes(1.0, 2.0, spread=(0.5, 1.5)).draw(random.Random(0)) in (0.5, 1.5)
