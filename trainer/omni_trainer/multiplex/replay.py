"""Replay of an executed dataflow table: each stage's busy and waiting seconds, from per-op
durations, by discrete-event simulation on a machine with a given number of cores.

Fidelity: the third rung of the simulators' ladder (see
:mod:`omni_trainer.multiplex.dataflow.simulate`), for a step measured on this machine. The
planners' :func:`~omni_trainer.multiplex.dataflow.simulate.simulate` compares tables in the unit
time model, and :mod:`omni_trainer.planner.simulate` predicts a job on a device profile from the
cost model (a device per stage; with no latency and the same op seconds its makespan equals this
replay's). This replays a table with op durations measured on the machine (per stage and op kind,
from the trainer's timers) and with the machine's cores: when more stages are runnable than there
are cores, the runnable ones share them (processor sharing: each progresses at ``cores / runnable``
of its solo speed). A stage waits while its next op's inputs are not there yet; so its waits come
from the schedule's dependency structure and the op costs, never from measured waits. Pure Python
(no torch).

Op order per stage is what the runtime executes: the encoder backwards then forwards of a slot
(:meth:`DataflowTable.at` order), the slot just before its LLM forward and after that forward's
cross-stage receive (megatron receives before calling ``forward_step_func``). Megatron's 1F1B
p2p calls are rendezvous (a send returns once its receive is posted, see :func:`_one_f_one_b`);
encoder outputs and gradients are buffered, one dependency per encoder micro-batch (the anchor
sends each asynchronously as soon as it is computed and waits for the sends at the step's end).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from omni_trainer.multiplex.dataflow.schedule import DataflowError
from omni_trainer.multiplex.dataflow.table import POST, PRE, DataflowTable

__all__ = ["OpTimes", "Replay", "StageReplay", "fit_op_times", "replay"]

_EPS = 1e-12
_KINDS = ("llm", "encoder", "data")  # the op kinds the fit scales, in OpTimes.scaled's order


@dataclass(frozen=True)
class OpTimes:
    """One stage's solo op durations (seconds on one core, nothing else running)."""

    llm_forward: float
    """Per LLM forward op (one micro-batch on one model chunk)."""
    llm_backward: float
    """Per LLM backward op."""
    encoder_forward: float = 0.0
    """Per unit of :attr:`EncoderMicroBatch.cost` (an encoder forward takes ``cost`` times it)."""
    encoder_backward: float = 0.0
    """Per unit of encoder cost, for the backward."""
    data: float = 0.0
    """The step's input preparation before the schedule (loading, collating, planning): CPU
    work that delays the stage's start."""
    spread: tuple[float, ...] = ()
    """Observed op durations over their mean (a loaded machine's time slicing, tails
    included): with a random generator the replay draws each op's factor from them."""

    def scaled(self, llm: float, encoder: float, data: float = 1.0) -> OpTimes:
        """The LLM durations times ``llm``, the encoder ones times ``encoder``, the data
        preparation times ``data``."""
        return dataclasses.replace(
            self,
            llm_forward=self.llm_forward * llm,
            llm_backward=self.llm_backward * llm,
            encoder_forward=self.encoder_forward * encoder,
            encoder_backward=self.encoder_backward * encoder,
            data=self.data * data,
        )

    def draw(self, rng: random.Random) -> float:
        """One op's duration over its mean: resampled from :attr:`spread` (1 without)."""
        return rng.choice(self.spread) if self.spread else 1.0


@dataclass(frozen=True)
class StageReplay:
    """Seconds of one stage from the step's start to its last op's end."""

    stage: int
    encoder: float
    """Wall seconds while an encoder op of the stage was running (slowed by core sharing)."""
    llm: float
    """Wall seconds while an LLM op of the stage was running."""
    waiting: float
    """Seconds blocked on another stage: pipeline neighbours, encoder outputs or gradients."""
    data: float = 0.0
    """Wall seconds preparing the step's input, before the schedule."""

    @property
    def finish(self) -> float:
        """When the stage's last op ends."""
        return self.data + self.encoder + self.llm + self.waiting


@dataclass(frozen=True)
class Replay:
    """Per stage seconds, and the step's makespan (the last stage to finish)."""

    stages: tuple[StageReplay, ...]

    @property
    def makespan(self) -> float:
        return max(s.finish for s in self.stages)


@dataclass(frozen=True)
class _Op:
    key: tuple
    kind: str  # "encoder" | "llm" | "p2p" (zero work: a receive, or megatron's p2p call)
    work: float
    needs: tuple[tuple, ...] = ()
    """Ops (keys) that must have ended, on this or another stage (buffered messages)."""
    meets: tuple[tuple, ...] = ()
    """Rendezvous ends ``(channel, side)``: the op ends once every partner end is posted."""


def _slot(table: DataflowTable, t: OpTimes, stage: int, index: int) -> list[_Op]:
    """The encoder backwards then forwards at one slot; a backward needs its gradient, sent
    (buffered) by stage 0's B(m, 0)."""
    ops = [
        _Op(("EB", i), "encoder", table.mb(i).cost * t.encoder_backward,
            (("B", 0, table.mb(i).microbatch, 0),))
        for i in table.at(stage, index, "backward")
    ]  # fmt: skip
    return ops + [
        _Op(("EF", i), "encoder", table.mb(i).cost * t.encoder_forward)
        for i in table.at(stage, index, "forward")
    ]


def _feeds(table: DataflowTable, stage: int, m: int, c: int) -> tuple[tuple, ...]:
    """What stage 0's F(m, 0) receives from the encoders; nothing elsewhere."""
    if stage or c:
        return ()
    return tuple(("EF", e.id) for e in table.encoder_mbs if e.microbatch == m)


def _one_f_one_b(table: DataflowTable, t: OpTimes, s: int) -> list[_Op]:
    """Stage ``s`` of megatron's 1F1B with its p2p calls as it makes them (``recv_forward``,
    ``send_forward``, ``send_forward_recv_backward``, ``send_backward_recv_forward``,
    ``recv_backward``, ``send_backward``): each call posts its sends and receives together and
    returns when every partner has posted (gloo and NCCL hand a message over only once its
    receive is posted). Channels: ``("A", s, m)`` stage s's activation of m to s+1, ``("G", s,
    m)`` its input gradient of m to s-1."""
    last, total = table.pp - 1, table.num_microbatches
    warmup = min(table.pp - s - 1, total)
    prog = _slot(table, t, s, PRE)
    calls = 0

    def call(sends: list[tuple], recvs: list[tuple]) -> None:
        nonlocal calls
        ends = tuple((c, "send") for c in sends) + tuple((c, "recv") for c in recvs)
        if ends:
            prog.append(_Op(("P", s, calls), "p2p", 0.0, meets=ends))
            calls += 1

    def act_in(m: int) -> list[tuple]:
        return [("A", s - 1, m)] if s > 0 else []

    def act_out(m: int) -> list[tuple]:
        return [("A", s, m)] if s < last else []

    def grad_in(m: int) -> list[tuple]:
        return [("G", s + 1, m)] if s < last else []

    def grad_out(m: int) -> list[tuple]:
        return [("G", s, m)] if s > 0 else []

    def forward(m: int) -> None:
        prog.extend(_slot(table, t, s, m))  # 1F1B runs forwards in micro-batch order
        prog.append(_Op(("F", s, m, 0), "llm", t.llm_forward, _feeds(table, s, m, 0)))

    for m in range(warmup):
        call([], act_in(m))
        forward(m)
        call(act_out(m), [])
    steady = total - warmup
    if steady:
        call([], act_in(warmup))
    for k in range(steady):
        forward(warmup + k)
        call(act_out(warmup + k), grad_in(k))
        prog.append(_Op(("B", s, k, 0), "llm", t.llm_backward))
        call(grad_out(k), act_in(warmup + k + 1) if k < steady - 1 else [])
    for m in range(steady, total):
        call([], grad_in(m))
        prog.append(_Op(("B", s, m, 0), "llm", t.llm_backward))
        call(grad_out(m), [])
    return prog + _slot(table, t, s, POST)


def _buffered(table: DataflowTable, t: OpTimes, s: int) -> list[_Op]:
    """Stage ``s`` with buffered LLM messages (an op needs its producer's end): one stage, and
    the interleaved schedule, whose p2p calls (receives posted ahead) are not modelled."""
    last, vpp = table.pp - 1, table.vpp
    prog, i = _slot(table, t, s, PRE), 0
    for op in table.ops(s):
        m, c = op.microbatch, op.chunk
        if op.kind == "F":
            src = ("F", s - 1, m, c) if s else ("F", last, m, c - 1) if c else None
            prog.append(_Op(("R", s, i), "p2p", 0.0, (src,) if src else ()))
            prog += _slot(table, t, s, i)
            prog.append(_Op(("F", s, m, c), "llm", t.llm_forward, _feeds(table, s, m, c)))
            i += 1
        else:
            src = ("B", s + 1, m, c) if s < last else ("B", 0, m, c + 1) if c < vpp - 1 else None
            prog.append(_Op(("B", s, m, c), "llm", t.llm_backward, (src,) if src else ()))
    return prog + _slot(table, t, s, POST)


def _programs(table: DataflowTable, times: Sequence[OpTimes]) -> list[list[_Op]]:
    """Each stage's ops in execution order, with their solo durations and dependencies."""
    build = _one_f_one_b if table.vpp == 1 and table.pp > 1 else _buffered
    return [
        [_Op(("D", s), "data", times[s].data)] * (times[s].data > 0) + build(table, times[s], s)
        for s in range(table.pp)
    ]


def replay(
    table: DataflowTable,
    times: Sequence[OpTimes],
    *,
    cores: int | None = None,
    latency: float = 0.0,
    background: float = 0.0,
    rng: random.Random | None = None,
    trace: list[tuple[int, tuple, str, float, float]] | None = None,
) -> Replay:
    """Run the table's step on ``cores`` cores (None: a device per stage) with these op times.

    Args:
        table: the executed dataflow table.
        times: per stage, its solo op durations.
        cores: processors the stages share; with more runnable stages than cores each runnable
            stage progresses at ``cores / runnable`` of its solo speed.
        latency: seconds from an op's end to its output being usable on another stage (p2p
            transfer and the receiver's wake-up); zero on the same stage.
        background: the others' demand for the cores (mean runnable processes, or the cores
            they keep busy): with it each runnable stage progresses at ``cores / (runnable +
            background)`` (at most 1).
        rng: draws each op's duration around its mean from the stage's
            :attr:`OpTimes.spread` (one sample of a Monte Carlo estimate); None: the means.
        trace: where given, each op as it ends: ``(stage, key, kind, reached, ended)``, the
            seconds when its stage reached it (its wait starts) and when it ended; ``key``
            ``("F", stage, m, chunk)`` / ``("B", ...)`` for LLM ops, ``("P", stage, n)`` for the
            n-th p2p call of 1F1B (``("R", stage, i)`` a receive of the interleaved schedule),
            ``("EF", id)`` / ``("EB", id)`` for encoder work, ``("D", stage)`` for the input
            preparation.

    Returns:
        Per stage: wall seconds in encoder ops, in LLM ops, and blocked (waiting).
    """
    if len(times) != table.pp:
        raise ValueError(f"times has {len(times)} stages, the table {table.pp}")
    if cores is not None and cores < 1:
        raise ValueError(f"cores must be >= 1 (got {cores})")
    progs = _programs(table, times)
    if rng is not None:
        progs = [
            [dataclasses.replace(op, work=op.work * times[s].draw(rng)) if op.work else op
             for op in prog]
            for s, prog in enumerate(progs)
        ]  # fmt: skip
    run = _Run(progs, cores=cores, latency=latency, background=background, trace=trace)
    while run.step():
        pass
    return Replay(
        tuple(
            StageReplay(s, sp["encoder"], sp["llm"], sp["wait"], sp["data"])
            for s, sp in enumerate(run.spent)
        )
    )


class _Run:
    """The replay's state as it advances: per stage its position in its program and the solo
    work left of the op there, the ops done (end, stage), the rendezvous ends posted (when
    their stage reached them), the clock, and the wall seconds spent per kind."""

    def __init__(
        self,
        progs: list[list[_Op]],
        *,
        cores: int | None,
        latency: float,
        background: float,
        trace: list[tuple[int, tuple, str, float, float]] | None,
    ) -> None:
        self.progs, self.cores, self.latency = progs, cores, latency
        self.background, self.trace = background, trace
        self.pos = [0] * len(progs)
        self.left = [p[0].work if p else 0.0 for p in progs]
        self.done: dict[tuple, tuple[float, int]] = {}  # op key -> (end, stage)
        self.posted: dict[tuple, float] = {}  # rendezvous end -> when its stage reached it
        self.reached = [0.0] * len(progs)
        self.spent = [
            {"data": 0.0, "encoder": 0.0, "llm": 0.0, "p2p": 0.0, "wait": 0.0} for _ in progs
        ]
        self.t = 0.0
        for s in range(len(progs)):
            self._arrive(s)

    def _arrive(self, s: int) -> None:
        """Stage ``s`` reached its next op: post that op's rendezvous ends."""
        if self.pos[s] < len(self.progs[s]):
            self.posted.update((end, self.t) for end in self.progs[s][self.pos[s]].meets)

    def _ready_at(self, s: int) -> float:
        """When stage ``s``'s next op has its inputs (inf: not known yet)."""
        op = self.progs[s][self.pos[s]]
        done, posted, latency = self.done, self.posted, self.latency
        partners = [(c, "recv" if side == "send" else "send") for c, side in op.meets]
        if any(n not in done for n in op.needs) or any(e not in posted for e in partners):
            return math.inf
        ends = [done[n][0] + (latency if done[n][1] != s else 0.0) for n in op.needs]
        if op.meets:  # the last of both sides to arrive, then the message
            ends.append(max(posted[e] for e in (*op.meets, *partners)) + latency)
        return max(ends, default=self.t)

    def _complete_ready(self) -> None:
        """Complete every op with no work left whose inputs are there."""
        pos, left, t = self.pos, self.left, self.t
        moved = True
        while moved:
            moved = False
            for s, prog in enumerate(self.progs):
                while pos[s] < len(prog) and left[s] <= 0.0 and self._ready_at(s) <= t:
                    self.done[prog[pos[s]].key] = (t, s)
                    if self.trace is not None:
                        self.trace.append(
                            (s, prog[pos[s]].key, prog[pos[s]].kind, self.reached[s], t)
                        )
                    self.reached[s] = t
                    pos[s] += 1
                    left[s] = prog[pos[s]].work if pos[s] < len(prog) else 0.0
                    self._arrive(s)
                    moved = True

    def step(self) -> bool:
        """Complete what can complete, then run to the next event; False once every stage is
        through its program."""
        self._complete_ready()
        progs, pos, left, t = self.progs, self.pos, self.left, self.t
        live = [s for s in range(len(progs)) if pos[s] < len(progs[s])]
        if not live:
            return False
        when = {s: self._ready_at(s) for s in live}
        run = [s for s in live if when[s] <= t]
        pending = [w - t for s, w in when.items() if t < w < math.inf]
        if not run and not pending:
            stuck = ", ".join(str(progs[s][pos[s]].key) for s in live)
            raise DataflowError(f"replay deadlocked: every stage waits ({stuck})")
        cores = self.cores
        rate = 1.0 if cores is None else min(1.0, cores / (max(len(run), 1) + self.background))
        dt = min([left[s] / rate for s in run] + pending)
        for s in live:
            self.spent[s][progs[s][pos[s]].kind if s in run else "wait"] += dt
        self.t = t + dt
        for s in run:
            left[s] -= dt * rate
            if left[s] <= _EPS * max(1.0, dt):
                left[s] = 0.0
        return True


def _mean_seconds(
    tables: Sequence[DataflowTable], times: Sequence[OpTimes], machine: Mapping[str, Any]
) -> list[dict[str, float]]:
    """Per stage, mean wall seconds per step in LLM, encoder and data ops over the tables."""
    runs = [replay(t, times, **machine).stages for t in tables]
    return [
        {k: sum(getattr(r[s], k) for r in runs) / len(runs) for k in _KINDS}
        for s in range(len(times))
    ]


def fit_op_times(
    tables: Sequence[DataflowTable],
    measured: Sequence[Mapping[str, float]],
    *,
    cores: int | None = None,
    latency: float = 0.0,
    background: float = 0.0,
    backward_ratio: float | Sequence[tuple[float, float]] = 2.0,
    iterations: int = 50,
) -> list[OpTimes]:
    """Solo op durations per stage whose replay reproduces the measured op seconds.

    The shape within a stage: an LLM backward ``backward_ratio`` times a forward; an encoder
    micro-batch ``cost`` units forward, ``backward_ratio x cost`` backward (one ratio, the cost
    model's 2 by default, or per stage ``(llm, encoder)`` ratios measured from an op log);
    the scale per stage and kind (LLM, encoder, data preparation) is fit so that the replayed
    wall seconds per step in those ops, on ``cores``, equal ``measured`` (per stage ``{"llm": s,
    "encoder": s}`` and optionally ``"data"``, mean per step over ``tables``' steps; ``cores``
    ``latency`` and ``background`` as in :func:`replay`). Only op timers go in, never waits:
    on shared cores an op's wall time exceeds its solo time by the sharing the replay itself
    predicts, hence the fixed-point iteration.
    """
    pp = tables[0].pp
    if len(measured) != pp:
        raise ValueError(f"measured has {len(measured)} stages, the tables {pp}")
    ratios = (
        [(backward_ratio, backward_ratio)] * pp
        if isinstance(backward_ratio, int | float)
        else list(backward_ratio)
    )
    times = []
    for s, (rl, re) in enumerate(ratios):
        llm_ops = sum(len(t.ops(s)) for t in tables) / len(tables) / 2  # F and B pairs
        enc = sum(t.stage_cost(s) for t in tables) / len(tables)
        f = measured[s]["llm"] / (llm_ops * (1 + rl)) if llm_ops else 0.0
        u = measured[s]["encoder"] / (enc * (1 + re)) if enc else 0.0
        times.append(OpTimes(f, f * rl, u, u * re, measured[s].get("data", 0.0)))
    for _ in range(iterations):
        got = _mean_seconds(
            tables, times, {"cores": cores, "latency": latency, "background": background}
        )
        factors = [[_ratio(measured[s].get(k, 0.0), got[s][k]) for k in _KINDS] for s in range(pp)]
        times = [t.scaled(*f) for t, f in zip(times, factors, strict=True)]
        if all(abs(x - 1) < 1e-9 for f in factors for x in f):
            break
    return times


def _ratio(want: float, got: float) -> float:
    return want / got if got > 0 and math.isfinite(want / got) else 1.0
