"""Discrete-event simulation of one training step, executing the trainer's own schedule objects.

Each pipeline stage is an in-order executor of the program the runtime runs: megatron's op order
(:func:`~omni_trainer.multiplex.dataflow.schedule.stage_ops`) with the encoder work the
:class:`~omni_trainer.multiplex.dataflow.table.DataflowTable` puts at each slot (backwards before
forwards within a slot, ascending micro-batch order). A task starts when its stage is free and
its inputs have arrived: the previous stage's activation (after a p2p transfer), the encoder
outputs stage 0 needs at ``F(m, 0)``, the gradient an encoder backward waits for. Sends are
non-blocking, as in the dataflow module, so transfers are latencies on edges, not busy time.
Memory is tracked by events (activations held from a forward's start to its backward's end,
working buffers while an op runs, encoder outputs buffered on stage 0 from arrival to
``F(m, 0)``).

Pure Python; :func:`predict` goes from a workload and a layout to step time, throughput, MFU,
bubble share and peak memory per stage, and :func:`predict_disaggregated` prices the baseline
that puts the encoders on their own GPUs.

Fidelity: the second rung of the simulators' ladder (see
:mod:`omni_trainer.multiplex.dataflow.simulate`): a job on a device profile, for ``omni plan``
and the tuner. Below it, the planners' unit time model works at slot granularity; above it,
:mod:`omni_trainer.multiplex.replay` explains a step measured on this machine. With a device
per stage, no latency and the same op seconds, the replay's makespan equals
:func:`run_schedule`'s (both run every op as its own event); they differ in what they add.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from omni_trainer.balance.reorder import ItemMeta, plan_reorder
from omni_trainer.costs.devices import DeviceProfile
from omni_trainer.costs.flops import mfu
from omni_trainer.costs.model_flops import step_flops
from omni_trainer.costs.step_costs import (
    EncoderMBCost,
    Layout,
    LLMOpCost,
    dp_sync_time,
    encoder_mb_cost,
    llm_op_costs,
    static_memory,
)
from omni_trainer.data.packing import PackedSequence, split_micro_batches
from omni_trainer.multiplex.dataflow.plan import plan_dataflow
from omni_trainer.multiplex.dataflow.schedule import DataflowError, stage_ops
from omni_trainer.multiplex.dataflow.table import POST, PRE, DataflowTable, EncoderMicroBatch
from omni_trainer.multiplex.workload import encoder_micro_batches
from omni_trainer.planner.workloads import Workload, sample_sequences

__all__ = [
    "Prediction",
    "ReplicaWork",
    "ScheduleResult",
    "encoder_budget",
    "predict",
    "predict_disaggregated",
    "run_schedule",
]

Policy = Literal["auto", "uniform", "front_loaded", "stage0"]


@dataclass(frozen=True, kw_only=True)
class ReplicaWork:
    """Everything one data-parallel replica does in a step, in seconds and bytes per rank."""

    llm: Sequence[Sequence[LLMOpCost]]
    """``llm[m][v]``: micro-batch ``m`` on virtual stage ``v = chunk * pp + stage``."""
    encoder: Mapping[int, EncoderMBCost] = field(default_factory=dict)
    """By encoder micro-batch id (the table's ids)."""
    static_bytes: Sequence[float] = ()
    """Per stage: weights, grads, optimizer state, framework reserve."""
    tail: Sequence[float] = ()
    """Per stage: exposed time after its last op (gradient sync)."""
    p2p_bandwidth_s_per_byte: float = 0.0
    p2p_alpha_s: float = 0.0


@dataclass(frozen=True)
class ScheduleResult:
    """What :func:`run_schedule` measured on one replica."""

    step_time: float
    makespan: float
    """End of the last op on any stage (before gradient sync)."""
    busy: tuple[float, ...]
    encoder_busy: tuple[float, ...]
    peak_bytes: tuple[float, ...]
    """Per stage: static + peak of activations and buffers, per rank."""

    @property
    def bubble(self) -> float:
        """Idle share of the stages' time up to the makespan."""
        if self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)


@dataclass
class _Task:
    label: str
    duration: float
    deps: list[tuple[tuple, float]]  # (task key, latency)
    key: tuple
    alloc: float = 0.0  # bytes allocated at start
    free: float = 0.0  # bytes freed at end
    encoder: bool = False
    working: float = 0.0  # bytes held from start to end only


def _programs(table: DataflowTable, work: ReplicaWork) -> list[list[_Task]]:
    """Per stage, the tasks in the order the runtime issues them."""
    pp, vpp = table.pp, table.vpp

    def lat(nbytes: float) -> float:
        if nbytes <= 0:
            return 0.0
        return work.p2p_alpha_s + nbytes * work.p2p_bandwidth_s_per_byte

    def enc_tasks(stage: int, index: int) -> list[_Task]:
        out = []
        for i in table.at(stage, index, "backward"):
            e, c = table.mb(i), work.encoder[i]
            d = 0.0 if stage == 0 else lat(c.output_bytes)
            out.append(
                _Task(f"E{i}'", c.backward, [(("B", e.microbatch, 0, 0), d)], ("EB", i), 0.0,
                      c.activation_bytes, True)
            )  # fmt: skip
        for i in table.at(stage, index, "forward"):
            c = work.encoder[i]
            out.append(_Task(f"E{i}", c.forward, [], ("EF", i), c.activation_bytes, 0.0, True))
        return out

    by_mb: dict[int, list[int]] = {}
    for e in table.encoder_mbs:
        by_mb.setdefault(e.microbatch, []).append(e.id)
    programs = []
    for s in range(pp):
        prog = enc_tasks(s, PRE)
        i = 0
        for op in stage_ops(stage=s, pp=pp, vpp=vpp, num_microbatches=table.num_microbatches):
            m, c = op.microbatch, op.chunk
            v = c * pp + s
            cost = work.llm[m][v]
            if op.kind == "F":
                deps: list[tuple[tuple, float]] = []
                if s > 0:
                    deps.append((("F", m, c, s - 1), lat(work.llm[m][v - 1].send_bytes)))
                elif c > 0:
                    deps.append((("F", m, c - 1, pp - 1), lat(work.llm[m][v - 1].send_bytes)))
                prog.append(_Task(f"R({m},{c})", 0.0, deps, ("R", m, c, s)))  # receive gate
                prog += enc_tasks(s, i)
                i += 1
                deps = []
                if s == 0 and c == 0:
                    for eid in by_mb.get(m, []):
                        stage = table.forward[eid].stage
                        d = 0.0 if stage == 0 else lat(work.encoder[eid].output_bytes)
                        deps.append((("EF", eid), d))
                prog.append(_Task(f"F({m},{c})", cost.forward, deps, ("F", m, c, s),
                                  cost.activation_bytes, working=cost.working_bytes))  # fmt: skip
            else:
                deps = []
                if s < pp - 1:
                    deps.append((("B", m, c, s + 1), lat(cost.send_bytes)))
                elif c < vpp - 1:
                    deps.append((("B", m, c + 1, 0), lat(cost.send_bytes)))
                prog.append(_Task(f"B({m},{c})", cost.backward, deps, ("B", m, c, s), 0.0,
                                  cost.activation_bytes, working=cost.working_bytes))  # fmt: skip
        prog += enc_tasks(s, POST)
        programs.append(prog)
    return programs


def run_schedule(table: DataflowTable, work: ReplicaWork) -> ScheduleResult:
    """Execute the joint schedule of one replica event by event.

    Raises:
        DataflowError: the programs deadlock (a task waits for one that can never run).
    """
    pp = table.pp
    programs = _programs(table, work)
    done: dict[tuple, float] = {}
    clock = [0.0] * pp
    pos = [0] * pp
    busy = [0.0] * pp
    enc_busy = [0.0] * pp
    events: list[list[tuple[float, float]]] = [[] for _ in range(pp)]
    arrivals: dict[int, float] = {}  # encoder mb id -> arrival time of its output at stage 0
    remaining = sum(len(p) for p in programs)
    while remaining:
        progressed = False
        for s in range(pp):
            prog = programs[s]
            while pos[s] < len(prog):
                t = prog[pos[s]]
                if any(k not in done for k, _ in t.deps):
                    break
                start = max([clock[s], *(done[k] + d for k, d in t.deps)])
                end = start + t.duration
                done[t.key] = end
                clock[s] = end
                busy[s] += t.duration
                if t.encoder:
                    enc_busy[s] += t.duration
                if t.alloc:
                    events[s].append((start, t.alloc))
                if t.free:
                    events[s].append((end, -t.free))
                if t.working:
                    events[s].append((start, t.working))
                    events[s].append((end, -t.working))
                if t.key[0] == "F" and t.key[3] == 0 and t.key[2] == 0:
                    for (kind, *rest), d in t.deps:  # encoder outputs buffered until now
                        if kind == "EF":
                            eid = rest[0]
                            arrivals[eid] = done[("EF", eid)] + d
                            nbytes = work.encoder[eid].output_bytes
                            events[0].append((arrivals[eid], nbytes))
                            events[0].append((start, -nbytes))
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [programs[s][pos[s]].label for s in range(pp) if pos[s] < len(programs[s])]
            raise DataflowError(f"simulated schedule deadlocks; stages wait at {stuck}")
    makespan = max(clock)
    tail = list(work.tail) or [0.0] * pp
    static = list(work.static_bytes) or [0.0] * pp
    peaks = []
    for s in range(pp):
        live = peak = 0.0
        for _, delta in sorted(events[s], key=lambda e: (e[0], e[1])):
            live += delta
            peak = max(peak, live)
        peaks.append(static[s] + peak)
    return ScheduleResult(
        step_time=max(clock[s] + tail[s] for s in range(pp)),
        makespan=makespan,
        busy=tuple(busy),
        encoder_busy=tuple(enc_busy),
        peak_bytes=tuple(peaks),
    )


# --------------------------------------------------------------------------------------------
# From a workload and a layout to a prediction


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """Predicted figures of one configuration."""

    workload: str
    policy: str
    layout: Layout
    step_time: float
    tokens_per_s: float
    mfu: float
    bubble: float
    peak_bytes: tuple[float, ...]
    """Per pipeline stage, per rank."""
    hbm_bytes: float
    notes: tuple[str, ...] = ()

    @property
    def oom(self) -> bool:
        """Some stage needs more memory than the device has."""
        return max(self.peak_bytes) > self.hbm_bytes

    @property
    def stage0_gib(self) -> float:
        return self.peak_bytes[0] / 2**30


def _replica_sequences(
    workload: Workload, layout: Layout, micro_batches: int, *, seed: int, replicas: int = 8
) -> tuple[list[PackedSequence], list[PackedSequence]]:
    """The sequences of the heaviest sampled replica after grouped reordering, and all sampled
    sequences (for throughput and FLOPs).

    ``min(dp, replicas)`` replicas are drawn; groups of ``reorder_group`` of them are balanced by
    the trainer's planner (balanced Karmarkar-Karp on forward FLOPs); the step waits for the
    heaviest replica, which is the one simulated.
    """
    model = workload.model
    r = min(layout.dp, replicas)
    per = micro_batches * layout.micro_batch_size
    seqs = sample_sequences(workload, r * per, seed=seed)
    cost = [_flops(model, s) for s in seqs]
    owned = [list(range(i * per, (i + 1) * per)) for i in range(r)]
    g = min(layout.reorder_group, r)
    if g > 1:
        regrouped: list[list[int]] = []
        for start in range(0, r - r % g, g):
            group = owned[start : start + g]
            items = [[ItemMeta(str(i), seqs[i].used, "seq") for i in rank] for rank in group]
            plan = plan_reorder(
                items, cost=lambda it: cost[int(it.sample_id)], equal_cardinality=True
            )
            regrouped += [[group[src][idx] for src, idx in dst] for dst in plan.assignments]
        owned = regrouped + owned[len(regrouped) :]
    heaviest = max(owned, key=lambda idx: sum(cost[i] for i in idx))
    return [seqs[i] for i in heaviest], seqs


def _flops(model, seq: PackedSequence) -> float:
    f = step_flops(model, [seq])
    return f.forward


def _crosses_nodes(layout: Layout, device: DeviceProfile) -> bool:
    """Megatron orders ranks tp, dp, pp: pipeline neighbours share a node only if a stage's
    tp x dp ranks fit in less than a node."""
    return layout.tp * layout.dp >= device.gpus_per_node


def _work(
    workload: Workload,
    layout: Layout,
    device: DeviceProfile,
    sequences: Sequence[PackedSequence],
    *,
    with_encoders: bool = True,
) -> tuple[ReplicaWork, list[EncoderMicroBatch]]:
    model = workload.model
    micro = split_micro_batches(list(sequences), layout.micro_batch_size)
    llm = [llm_op_costs(model.llm, mb, layout, device) for mb in micro]
    mbs: list[EncoderMicroBatch] = []
    enc: dict[int, EncoderMBCost] = {}
    if with_encoders:
        raw, lengths = encoder_micro_batches(model, micro, stages=layout.pp * layout.vpp)
        unit = sum(c.forward for row in llm for c in row) / max(len(llm) * len(llm[0]), 1)
        for e in raw:
            config = getattr(model.encoders, e.modality)
            enc[e.id] = encoder_mb_cost(
                config, lengths[e.id], llm_hidden=model.llm.hidden_size, layout=layout,
                device=device,
            )  # fmt: skip
            mbs.append(
                replace(e, cost=enc[e.id].forward / unit, activations=enc[e.id].activation_bytes)
            )
    link = device.inter if _crosses_nodes(layout, device) else device.intra
    static, tail = [], []
    for s in range(layout.pp):
        # The grads are final during the last micro-batch's backward on each of the stage's
        # chunks: the bucketed reduce-scatter hides behind it. A mean micro-batch stands for
        # the last one, so shortened runs (see predict) extrapolate without its noise.
        v = [c * layout.pp + s for c in range(layout.vpp)]
        last_backward = sum(row[i].backward for row in llm for i in v) / len(llm)
        tail.append(dp_sync_time(model, layout, s, device, backward=last_backward))
        mem = static_memory(model, layout, s)
        if not with_encoders:
            mem = {k: v for k, v in mem.items() if not k.startswith("encoder")}
        static.append(sum(mem.values()) + device.reserved_bytes)
    work = ReplicaWork(
        llm=llm,
        encoder=enc,
        static_bytes=static,
        tail=tail,
        p2p_bandwidth_s_per_byte=1.0 / link.bandwidth,
        p2p_alpha_s=link.alpha_s,
    )
    return work, mbs


def encoder_budget(
    work: ReplicaWork, *, pp: int, vpp: int, num_microbatches: int, hbm_bytes: float
) -> list[float]:
    """Per stage, the bytes encoder activations may hold under ``auto``: the device memory minus
    the LLM's needs (static bytes and the peak of its own activations in the same schedule
    without encoders). Encoder working buffers are not counted (they live for one op)."""
    bare = plan_dataflow("uniform", pp=pp, vpp=vpp, num_microbatches=num_microbatches,
                         encoder_mbs=[])  # fmt: skip
    return [max(0.0, hbm_bytes - peak) for peak in run_schedule(bare, work).peak_bytes]


def _simulate_replica(
    workload: Workload,
    layout: Layout,
    policy: str,
    device: DeviceProfile,
    replica: Sequence[PackedSequence],
    *,
    with_encoders: bool = True,
) -> ScheduleResult:
    work, mbs = _work(workload, layout, device, replica, with_encoders=with_encoders)
    shape = {
        "pp": layout.pp,
        "vpp": layout.vpp,
        "num_microbatches": len(replica) // layout.micro_batch_size,
    }
    # ours as tuned for throughput: memoryBudget = all the device leaves beside the LLM (the
    # trainer's default keeps auto within uniform's peak x HEADROOM instead)
    budget = encoder_budget(work, **shape, hbm_bytes=device.hbm_bytes) if policy == "auto" else None
    table = plan_dataflow(policy, **shape, encoder_mbs=mbs, budget=budget)
    return run_schedule(table, work)


def predict(
    workload: Workload,
    layout: Layout,
    *,
    policy: str = "uniform",
    device: DeviceProfile,
    seed: int = 0,
    max_microbatches: int = 64,
    _with_encoders: bool = True,
) -> Prediction:
    """Predict one step of ``workload`` on ``layout`` with an insertion policy.

    The heaviest of up to 8 sampled replicas is simulated (see :func:`_replica_sequences`).
    With more than ``max_microbatches`` micro-batches per replica, the step is simulated at
    ``max_microbatches / 2`` and ``max_microbatches`` and extrapolated linearly in the number of
    micro-batches (1F1B's steady state is linear in it; so is front-loaded encoder memory); the
    notes say so.
    """
    if layout.world_size != workload.world_size:
        raise ValueError(
            f"layout {layout.describe()} covers {layout.world_size} GPUs, workload "
            f"{workload.name} has {workload.world_size}"
        )
    per_replica = workload.global_batch // layout.dp
    if workload.global_batch % (layout.dp * layout.micro_batch_size):
        raise ValueError(
            f"global batch {workload.global_batch} does not split into dp {layout.dp} x "
            f"micro-batch {layout.micro_batch_size}"
        )
    m = per_replica // layout.micro_batch_size
    notes: list[str] = []
    q = layout.pp if layout.vpp > 1 else 1
    m2 = max(2 * q, max_microbatches // q * q)  # two runs of different lengths
    m2 = m if m <= m2 else m2
    replica, sampled = _replica_sequences(workload, layout, m2, seed=seed)
    r2 = _simulate_replica(workload, layout, policy, device, replica, with_encoders=_with_encoders)
    step_time, bubble, peaks = r2.step_time, r2.bubble, r2.peak_bytes
    if m2 < m:
        m1 = max(q, m2 // 2 // q * q)
        r1 = _simulate_replica(
            workload, layout, policy, device, replica[: m1 * layout.micro_batch_size],
            with_encoders=_with_encoders,
        )  # fmt: skip
        k = (m - m2) / (m2 - m1)
        step_time = r2.step_time + k * (r2.step_time - r1.step_time)
        span = r2.makespan + k * (r2.makespan - r1.makespan)
        busy = sum(r2.busy) + k * (sum(r2.busy) - sum(r1.busy))
        bubble = 1.0 - busy / (layout.pp * span)
        if policy == "front_loaded":  # every encoder activation lives through the step
            peaks = tuple(
                max(b, b + k * (b - a)) for a, b in zip(r1.peak_bytes, r2.peak_bytes, strict=True)
            )
        notes.append(
            f"time extrapolated from {m1} and {m2} of {m} micro-batches"
            + ("" if policy == "front_loaded" else f"; memory of the {m2}-micro-batch run")
        )
    flops = step_flops(workload.model, sampled)
    scale = workload.global_batch / len(sampled)
    tokens = flops.tokens * scale
    model_flops = flops.training * scale
    if not _with_encoders:
        model_flops = 3.0 * flops.llm_forward * scale
    return Prediction(
        workload=workload.name,
        policy=policy,
        layout=layout,
        step_time=step_time,
        tokens_per_s=tokens / step_time,
        mfu=mfu(model_flops / step_time, workload.world_size * device.peak_flops),
        bubble=bubble,
        peak_bytes=tuple(peaks),
        hbm_bytes=device.hbm_bytes,
        notes=tuple(notes),
    )


def encoder_flops_share(workload: Workload, *, seed: int = 0, samples: int = 64) -> float:
    """Encoder share of the training FLOPs of the workload's sampled sequences."""
    seqs = sample_sequences(workload, samples, seed=seed)
    f = step_flops(workload.model, seqs)
    return sum(f.encoder_forward.values()) / f.forward if f.forward else 0.0


def _encoder_seconds(
    workload: Workload,
    layout: Layout,
    seqs: Sequence[PackedSequence],
    *,
    encoder_gpus: int,
    device: DeviceProfile,
) -> float:
    """The disaggregated encoders' seconds per step: the global batch's encoder work (forward
    and backward; a sample's media of one modality as one mb, on one GPU) spread evenly over
    ``encoder_gpus``, bounded below by the longest single media item (tp over at most one
    node's GPUs)."""
    enc_layout = replace(
        layout, tp=min(device.gpus_per_node, encoder_gpus), pp=1, dp=1, reorder_group=1
    )
    per_seq = []
    longest = 0.0
    for s in seqs:
        for modality in ("image", "audio"):
            lengths = [g.media_tokens for g in s.segments if g.modality == modality]
            config = getattr(workload.model.encoders, modality)
            if not lengths or config is None:
                continue
            one = replace(enc_layout, tp=1, eta=1 << 30)
            c = encoder_mb_cost(
                config, lengths, llm_hidden=workload.model.llm.hidden_size, layout=one,
                device=device,
            )  # fmt: skip
            per_seq.append(c.forward + c.backward)
            for length in lengths:
                single = encoder_mb_cost(
                    config, [length], llm_hidden=workload.model.llm.hidden_size,
                    layout=enc_layout, device=device,
                )  # fmt: skip
                longest = max(longest, single.forward + single.backward)
    total = sum(per_seq) * workload.global_batch / len(seqs)
    return max(total / encoder_gpus, longest)


def predict_disaggregated(
    workload: Workload,
    layout: Layout,
    *,
    encoder_gpus: int,
    device: DeviceProfile,
    seed: int = 0,
    max_microbatches: int = 64,
) -> Prediction:
    """The disaggregated baseline: encoders on their own ``encoder_gpus``, the LLM on the rest.

    The LLM keeps ``layout``'s tp and pp with ``dp = (N - encoder_gpus) / (tp pp)`` replicas
    (leftover GPUs idle) and runs plain 1F1B. The encoder GPUs encode the next step's media while
    the LLM trains on this one (pipelined ahead), so the step takes the longer of the two, plus
    the exposed transfer of the encoder outputs. Encoder time: the global batch's encoder work
    (forward + backward, LSSP groups of one node for long samples) spread evenly over the encoder
    GPUs, bounded below by the longest single sample. Memory is reported for the LLM stages.
    """
    n = workload.world_size
    replica = layout.tp * layout.pp
    dp_llm = (n - encoder_gpus) // replica
    if dp_llm < 1:
        raise ValueError(f"{encoder_gpus} encoder GPUs leave no room for one LLM replica")
    mb = layout.micro_batch_size
    per_replica = math.ceil(workload.global_batch / (dp_llm * mb))
    group = min(layout.reorder_group, dp_llm)
    while dp_llm % group:
        group -= 1
    llm_layout = replace(layout, dp=dp_llm, reorder_group=group)
    # The LLM side as its own job: as many micro-batches per replica as the batch needs.
    llm_job = replace(workload, world_size=dp_llm * replica, global_batch=per_replica * dp_llm * mb)
    llm = predict(
        llm_job, llm_layout, policy="uniform", device=device, seed=seed,
        max_microbatches=max_microbatches, _with_encoders=False,
    )  # fmt: skip
    seqs = sample_sequences(workload, 64, seed=seed + 1)
    enc_time = _encoder_seconds(workload, layout, seqs, encoder_gpus=encoder_gpus, device=device)
    media = sum(g.media_tokens for s in seqs for g in s.segments)
    out_bytes = media * workload.model.llm.hidden_size * 2 * workload.global_batch / len(seqs)
    send = out_bytes / (encoder_gpus * device.inter.bandwidth)
    step = max(llm.step_time, enc_time, send)
    flops = step_flops(workload.model, seqs)
    scale = workload.global_batch / len(seqs)
    bottleneck = "encoders" if enc_time > llm.step_time else "LLM"
    return Prediction(
        workload=workload.name,
        policy="disaggregated",
        layout=llm_layout,
        step_time=step,
        tokens_per_s=flops.tokens * scale / step,
        mfu=mfu(flops.training * scale / step, n * device.peak_flops),
        bubble=llm.bubble,
        peak_bytes=llm.peak_bytes,
        hbm_bytes=device.hbm_bytes,
        notes=(
            *llm.notes,
            f"{encoder_gpus} encoder GPUs, LLM dp{dp_llm}; encoders {enc_time:.2f}s vs "
            f"LLM {llm.step_time:.2f}s per step; bottleneck: {bottleneck}",
        ),
    )
