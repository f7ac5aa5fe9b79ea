"""Search the parallel configuration of a job with the simulator (``omni plan --tune``).

Two passes, so that a search over hundreds of layouts stays under a minute: first every valid
(tp, pp, vpp, dp, recompute) is simulated with the paper's defaults (uniform insertion, eta 4096,
reorder groups of 8) on a shortened step; then the few fastest layouts that fit in memory are
searched over the encoder knobs (policy, eta, reorder group size). Only configurations whose
predicted peak memory fits the device are returned.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from omni_trainer.multiplex.dataflow import POLICIES
from omni_trainer.planner.costs import Layout
from omni_trainer.planner.devices import DeviceProfile
from omni_trainer.planner.simulate import Prediction, predict
from omni_trainer.planner.workloads import Workload

__all__ = ["Candidate", "Progress", "layouts", "tune"]

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
    """Every layout megatron accepts for the job: tp inside a node and dividing the heads, pp
    at most the layers, vpp only with pp > 1 and micro-batches a multiple of pp, dp dividing
    the global batch."""
    llm = workload.model.llm
    n = workload.world_size
    out = []
    for tp in tps:
        if tp > device.gpus_per_node or llm.num_attention_heads % tp or n % tp:
            continue
        for pp in pps:
            if n % (tp * pp):
                continue
            dp = n // (tp * pp)
            if workload.global_batch % (dp * micro_batch_size):
                continue
            m = workload.global_batch // (dp * micro_batch_size)
            for vpp in vpps:
                if llm.num_layers < pp * vpp or (vpp > 1 and (pp == 1 or m % pp)):
                    continue
                for rc in recomputes:
                    out.append(
                        Layout(
                            tp=tp,
                            pp=pp,
                            vpp=vpp,
                            dp=dp,
                            micro_batch_size=micro_batch_size,
                            recompute=rc,  # type: ignore[arg-type]
                            reorder_group=_group(dp, 8),
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
    total = len(pool) + second
    done = 0

    def tick(label: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total, label)

    first: list[Prediction] = []
    for lay in pool:
        p = predict(
            workload, lay, policy="uniform", device=device, seed=seed,
            max_microbatches=max_microbatches,
        )  # fmt: skip
        tick(lay.describe())
        if not p.oom:
            first.append(p)
    first.sort(key=lambda p: -p.tokens_per_s)
    seen: list[Prediction] = []
    for base in first[:keep_layouts]:
        # With one stage every policy runs the same program: search one.
        one = ("uniform",) if "uniform" in policies else tuple(policies[:1])
        dp = base.layout.dp
        for policy in policies if base.layout.pp > 1 else one:
            for eta in etas:
                for g in sorted({_group(dp, g) for g in groups}):  # largest divisor of dp <= g
                    lay = replace(base.layout, eta=eta, reorder_group=g)
                    p = predict(
                        workload, lay, policy=policy, device=device, seed=seed,
                        max_microbatches=max_microbatches,
                    )  # fmt: skip
                    tick(f"{lay.describe()} {policy}")
                    if not p.oom:
                        seen.append(p)
    if progress is not None:
        progress(done, done, "done")
    seen.sort(key=lambda p: -p.tokens_per_s)
    fitting = len(first)
    out = []
    for i, p in enumerate(seen[:top]):
        nxt = seen[i + 1] if i + 1 < len(seen) else None
        margin = f", {p.tokens_per_s / nxt.tokens_per_s:.3f}x the next" if nxt else ""
        head = (max(p.peak_bytes)) / 2**30
        out.append(
            Candidate(
                p,
                f"#{i + 1} of {len(seen)} fitting configs ({fitting}/{len(pool)} layouts fit): "
                f"{p.tokens_per_s / 1e3:.0f}K tok/s, MFU {p.mfu:.1%}, bubble {p.bubble:.1%}"
                f"{margin}; peak {head:.0f} of {p.hbm_bytes / 2**30:.0f} GiB",
            )
        )
    return out
