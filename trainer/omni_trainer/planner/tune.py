"""Search the parallel configuration of a job with the simulator (``omni plan --tune``).

Two passes, so that a search over hundreds of layouts stays under a minute: first every valid
(tp, pp, vpp, dp, recompute) is simulated with the paper's defaults (uniform insertion, eta 4096,
reorder groups of 8) on a shortened step; then the few fastest layouts that fit in memory are
searched over the encoder knobs (policy, eta, reorder group size). Only configurations whose
predicted peak memory fits the device are returned.

LLM activations are kept (sel-AC) or recomputed (full-AC), the trainer's ``train.recompute``
choices (offload-AC, a what-if of the planner, only when asked for). Full-AC only trades time
for memory, so it is simulated only for layouts whose sel-AC variant does not fit.

:func:`propose_proxy` then scales the winner down for validation on a small cluster (the paper's
technique 10): fewer data-parallel replicas, everything else of a replica unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from omni_trainer.costs.devices import DeviceProfile
from omni_trainer.costs.step_costs import Layout
from omni_trainer.distributed.config import ParallelDims
from omni_trainer.distributed.layout import model_problems
from omni_trainer.multiplex.dataflow.plan import POLICIES
from omni_trainer.planner.simulate import Prediction, predict
from omni_trainer.planner.workloads import Workload

__all__ = ["Candidate", "Progress", "ProxyPlan", "layouts", "propose_proxy", "tune"]

Progress = Callable[[int, int, str], None]
"""``progress(done, total, label)``: called after each simulated configuration."""


@dataclass(frozen=True)
class Candidate:
    """One configuration the tuner recommends, with its predicted figures."""

    prediction: Prediction
    reason: str
    """One line: why this one (rank, margin over the next, memory headroom)."""

    @property
    def layout(self) -> Layout:
        return self.prediction.layout


def layouts(
    workload: Workload,
    *,
    device: DeviceProfile,
    tps: Iterable[int] = (1, 2, 4, 8),
    pps: Iterable[int] = (1, 2, 4, 8, 16),
    vpps: Iterable[int] = (1, 2),
    recomputes: Sequence[str] = ("selective", "full"),
    micro_batch_size: int = 1,
) -> list[Layout]:
    """Every layout the trainer accepts for the job (``distributed.layout.model_problems``:
    heads and query groups divided by tp, layers by pp x vpp; the sequence by tp for sequence
    parallelism), with tp inside a node, vpp only with pp > 1 and micro-batches a multiple of
    pp, dp dividing the global batch. ``recomputes`` are the trainer's (``train.recompute``);
    the planner's what-if ``offload`` is priced only when asked for, on a device with a host
    link."""
    n = workload.world_size
    out = []
    for tp in tps:
        if tp > device.gpus_per_node or n % tp or workload.seq_length % tp:
            continue
        for pp in pps:
            if n % (tp * pp):
                continue
            dp = n // (tp * pp)
            if workload.global_batch % (dp * micro_batch_size):
                continue
            m = workload.global_batch // (dp * micro_batch_size)
            for vpp in vpps:
                if vpp > 1 and (pp == 1 or m % pp):
                    continue
                if model_problems(workload.model, ParallelDims(n, tp=tp, pp=pp, vpp=vpp)):
                    continue
                for rc in recomputes:
                    if rc == "offload" and device.host is None:
                        continue
                    out.append(
                        Layout(
                            tp=tp,
                            pp=pp,
                            vpp=vpp,
                            dp=dp,
                            micro_batch_size=micro_batch_size,
                            recompute=rc,  # type: ignore[arg-type]
                            encoder_recompute="full" if rc == "full" else "selective",
                            reorder_group=_group(dp, 8),
                            overlap_grad_reduce=dp > 1,  # the trainer's default with ZeRO-1
                        )
                    )
    return out


def _group(dp: int, want: int) -> int:
    """The largest divisor of dp that is at most ``want``."""
    return max(g for g in range(1, min(dp, want) + 1) if dp % g == 0)


def tune(
    workload: Workload,
    *,
    device: DeviceProfile,
    top: int = 3,
    keep_layouts: int = 3,
    policies: Sequence[str] = POLICIES,
    etas: Sequence[int] = (2048, 4096, 8192),
    groups: Sequence[int] = (1, 4, 8),
    max_microbatches: int = 32,
    candidates: Sequence[Layout] | None = None,
    progress: Progress | None = None,
    seed: int = 0,
) -> list[Candidate]:
    """The ``top`` fastest configurations that fit in memory, best first.

    Args:
        workload: the job (model, GPUs, batch, sequence length, modality mix).
        device: the device profile to predict on.
        top: how many to return.
        keep_layouts: layouts carried from the first pass into the encoder-knob search.
        policies, etas, groups: the encoder knobs searched in the second pass (reorder groups
            larger than dp, or not dividing it, are skipped).
        max_microbatches: steps with more micro-batches are simulated shortened and
            extrapolated (see :func:`~omni_trainer.planner.simulate.predict`).
        candidates: layouts to consider; default :func:`layouts`.
        progress: called after each simulation, for a progress bar.
        seed: data sampling seed (the same for every configuration, so they see the same data).

    Returns:
        Candidates with a one-line reason each; empty if nothing fits.
    """
    pool = list(candidates) if candidates is not None else layouts(workload, device=device)
    second = len(policies) * len(etas) * len(groups) * min(keep_layouts, len(pool))  # at most
    tick = _Ticker(progress, total=len(pool) + second)

    def run(lay: Layout, policy: str) -> Prediction:
        return predict(
            workload, lay, policy=policy, device=device, seed=seed,
            max_microbatches=max_microbatches,
        )  # fmt: skip

    first, simulated = _first_pass(pool, run, tick)
    seen: list[Prediction] = []
    for base in first[:keep_layouts]:
        seen += _knob_search(base, run, tick, policies=policies, etas=etas, groups=groups)
    if progress is not None:
        progress(tick.done, tick.done, "done")
    seen.sort(key=lambda p: -p.tokens_per_s)
    return _recommend(seen, top=top, fitting=len(first), simulated=simulated)


class _Ticker:
    """Counts the simulated configurations for ``progress``."""

    def __init__(self, progress: Progress | None, *, total: int) -> None:
        self.progress, self.total, self.done = progress, total, 0

    def __call__(self, label: str) -> None:
        self.done += 1
        if self.progress is not None:
            self.progress(self.done, self.total, label)


def _first_pass(
    pool: list[Layout], run: Callable[[Layout, str], Prediction], tick: _Ticker
) -> tuple[list[Prediction], int]:
    """Every layout with the paper's defaults (uniform insertion): those that fit, fastest
    first, and how many were simulated."""
    first: list[Prediction] = []
    # full-AC and offload-AC only add time to sel-AC's ops (recompute, exposed copies), so a
    # layout that fits with sel-AC is never faster with them: simulate those only if it does not.
    pool.sort(key=lambda lay: lay.recompute != "selective")  # stable: sel-AC first
    selective_fits: set[Layout] = set()
    simulated = 0
    for lay in pool:
        if lay.recompute != "selective" and replace(lay, recompute="selective") in selective_fits:
            tick(f"{lay.describe()} skipped: sel-AC fits")
            continue
        p = run(lay, "uniform")
        tick(lay.describe())
        simulated += 1
        if not p.oom:
            first.append(p)
            if lay.recompute == "selective":
                selective_fits.add(lay)
    first.sort(key=lambda p: -p.tokens_per_s)
    return first, simulated


def _knob_search(
    base: Prediction,
    run: Callable[[Layout, str], Prediction],
    tick: _Ticker,
    *,
    policies: Sequence[str],
    etas: Sequence[int],
    groups: Sequence[int],
) -> list[Prediction]:
    """``base``'s layout under every policy, eta and reorder group: the predictions that fit."""
    # With one stage every policy runs the same program: search one.
    one = ("uniform",) if "uniform" in policies else tuple(policies[:1])
    dp = base.layout.dp
    out = []
    for policy in policies if base.layout.pp > 1 else one:
        for eta in etas:
            for g in sorted({_group(dp, g) for g in groups}):  # largest divisor of dp <= g
                lay = replace(base.layout, eta=eta, reorder_group=g)
                p = run(lay, policy)
                tick(f"{lay.describe()} {policy}")
                if not p.oom:
                    out.append(p)
    return out


def _recommend(
    seen: list[Prediction], *, top: int, fitting: int, simulated: int
) -> list[Candidate]:
    """The ``top`` of ``seen`` (fastest first), each with its one-line reason."""
    out = []
    for i, p in enumerate(seen[:top]):
        nxt = seen[i + 1] if i + 1 < len(seen) else None
        margin = f", {p.tokens_per_s / nxt.tokens_per_s:.3f}x the next" if nxt else ""
        head = (max(p.peak_bytes)) / 2**30
        out.append(
            Candidate(
                p,
                f"#{i + 1} of {len(seen)} fitting configs ({fitting}/{simulated} layouts fit): "
                f"{p.tokens_per_s / 1e3:.0f}K tok/s, MFU {p.mfu:.1%}, bubble {p.bubble:.1%}"
                f"{margin}; peak {head:.0f} of {p.hbm_bytes / 2**30:.0f} GiB",
            )
        )
    return out


@dataclass(frozen=True)
class ProxyPlan:
    """A scaled-down configuration to validate a prediction on, and what it should show."""

    full: Prediction
    proxy: Prediction
    proxy_global_batch: int
    reason: str
    """Why this size, and how to read the proxy's measurement."""

    @property
    def proxy_gpus(self) -> int:
        return self.proxy.layout.world_size

    @property
    def per_gpu_ratio(self) -> float:
        """Predicted tokens/s per GPU of the full job over the proxy's (1: perfect weak scaling)."""
        full = self.full.tokens_per_s / self.full.layout.world_size
        return full / (self.proxy.tokens_per_s / self.proxy.layout.world_size)


def propose_proxy(
    workload: Workload,
    best: Prediction,
    *,
    device: DeviceProfile,
    max_gpus: int | None = None,
    seed: int = 0,
    max_microbatches: int = 32,
) -> ProxyPlan:
    """A proxy of ``best``: the same replica (tp, pp, vpp, micro-batch, recompute, eta, policy,
    per-replica batch) with the fewest data-parallel replicas that keep what the full job
    exercises: a whole reorder group (so balancing sees the same group), two replicas if the job
    has more than one (a gradient sync), and, if the full job's pipeline/data-parallel traffic
    spans nodes, at least two nodes (so its traffic crosses nodes too). ``max_gpus`` caps the proxy.

    Returns:
        Both predictions; the proxy should measure its predicted tokens/s per GPU, and the full
        job ``per_gpu_ratio`` times that per GPU.

    Raises:
        ValueError: ``max_gpus`` cannot hold one reorder group of replicas.
    """
    lay = best.layout
    replica = lay.tp * lay.pp
    per_replica = workload.global_batch // lay.dp
    want = max(lay.reorder_group, min(2, lay.dp))
    why = [f"reorder group {lay.reorder_group}"] if lay.reorder_group > 1 else []
    if lay.dp > 1 and lay.reorder_group < 2:
        why.append("a gradient sync over 2 replicas")
    if lay.world_size > device.gpus_per_node:
        nodes = -(-2 * device.gpus_per_node // replica)  # replicas filling two nodes
        want = max(want, nodes)
        why.append("two nodes, as the full job's traffic crosses nodes")
    dp = min(lay.dp, -(-want // lay.reorder_group) * lay.reorder_group)
    while lay.dp % dp:  # the proxy's replicas divide the job's, so it is the same job, thinner
        dp += lay.reorder_group
    if max_gpus is not None:
        fit = [d for d in range(lay.reorder_group, dp + 1, lay.reorder_group)
               if d * replica <= max_gpus and lay.dp % d == 0]  # fmt: skip
        if not fit:
            raise ValueError(
                f"a proxy of {lay.describe()} needs at least {lay.reorder_group * replica} GPUs "
                f"(one reorder group of tp x pp = {replica}); --proxy-gpus is {max_gpus}"
            )
        if fit[-1] < dp:
            why.append(f"capped at {max_gpus} GPUs")
        dp = fit[-1]
    proxy_layout = replace(lay, dp=dp)
    proxy_job = replace(
        workload, world_size=dp * replica, global_batch=per_replica * dp,
        name=f"{workload.name}-proxy",
    )  # fmt: skip
    proxy = predict(
        proxy_job, proxy_layout, policy=best.policy, device=device, seed=seed,
        max_microbatches=max_microbatches,
    )  # fmt: skip
    plan = ProxyPlan(best, proxy, proxy_job.global_batch, "")
    per_gpu = proxy.tokens_per_s / plan.proxy_gpus
    reason = (
        f"proxy: {proxy_layout.describe()} on {plan.proxy_gpus} GPUs (of {lay.world_size}), "
        f"global batch {proxy_job.global_batch} (same {per_replica} sequences per replica); "
        f"sized for {', '.join(why) or 'one replica'}. Expect {per_gpu:,.0f} "
        f"tokens/s per GPU there and {best.tokens_per_s / lay.world_size:,.0f} on the full job "
        f"({plan.per_gpu_ratio:.3f}x: gradient sync over more replicas and a heavier slowest "
        f"replica); a proxy measured x% off moves the full prediction by about x%."
    )
    return replace(plan, reason=reason)
