"""Every policy's entry: :func:`plan_dataflow` checks the layout and encoder micro-batches once,
then builds the table of a fixed policy or of ``auto``; what it returns always validates."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Final, Literal

from omni_trainer.multiplex.dataflow.auto import plan_auto
from omni_trainer.multiplex.dataflow.policies import FIXED_POLICIES, fixed_table
from omni_trainer.multiplex.dataflow.schedule import DataflowError
from omni_trainer.multiplex.dataflow.table import POST, PRE, DataflowTable, EncoderMicroBatch, Slot
from omni_trainer.multiplex.dataflow.validate import check_structure, validate_dataflow

__all__ = ["POLICIES", "Policy", "plan_dataflow"]

Policy = Literal["auto", "stage0", "front_loaded", "uniform"]
POLICIES: Final[tuple[str, ...]] = ("auto", "stage0", "front_loaded", "uniform")


def plan_dataflow(
    policy: Policy,
    *,
    pp: int,
    vpp: int,
    num_microbatches: int,
    encoder_mbs: Iterable[EncoderMicroBatch],
    budget: float | Sequence[float] | None = None,
    device_budget: float | Sequence[float] | None = None,
    shared_cores: bool = False,
) -> DataflowTable:
    """Build a valid table with one of the policies (the result always passes validation).

    - ``auto`` (the default): places each encoder mb, in ascending (micro-batch, id) order, at
      the stage and slot (forward, then its backward at the first slot after stage 0's B(m,0)
      has finished, else POST) that keeps the stage's live encoder activations within
      ``budget`` and then gives the least makespan in the time model below; ties go to the
      shortest activation lifetime (the latest slot), then the least loaded stage. Encoder work
      thus fills idle time first (warm-up and cool-down bubbles, waits on peers: the makespan
      does not grow), is front-loaded where that shortens the step and the budget allows, and
      is otherwise inserted on demand. A mb that fits nowhere takes the slot exceeding the
      budget least. The best of this and the fixed tables is then refined by a local search
      (each mb placed again knowing all the others, until none moves). ``budget``: per stage (or one
      for all), in :attr:`EncoderMicroBatch.memory` units (bytes in the trainer and simulator: the
      manifest's ``memoryBudget``); where ``front_loaded`` fits it, ``auto`` is at least as fast;
      None: :data:`~omni_trainer.multiplex.dataflow.auto.HEADROOM` x the largest stage peak of the
      ``uniform`` table, and at most ``device_budget`` (what the device leaves beside the LLM, see
      :mod:`omni_trainer.multiplex.encoder_policy`), so ``auto`` holds barely more encoder
      activations than on-demand insertion. ``shared_cores``: the stages share fewer CPU cores than
      they have threads (a local run), so one stage's idle time is another's compute and filling it
      gains nothing the time model (a device per stage) would credit; ``auto`` then takes
      ``front_loaded``'s table wherever that fits the budget (no encoder work inside the LLM
      schedule, nothing to search), and plans as above elsewhere.
      Only ``auto`` reads these three.

    - ``stage0``: the unimodal-like baseline; every encoder mb on stage 0 just before F(m,0),
      backward at the first stage-0 slot after B(m,0) (or POST).
    - ``front_loaded``: stages balanced by cost (LPT), every forward at PRE, every backward at
      POST (the paper's counter-example).
    - ``uniform`` (the paper's): stages balanced by cost (LPT, ties by id); in ascending
      (micro-batch, id) order each forward goes to the LATEST valid slot on its stage that does not
      delay stage 0's F(m,0) in the time model (F = 1, B = 2, encoder forward = cost, backward =
      2 x cost; start times by longest path in the happens-before graph). If every slot delays it,
      the least-delaying one, latest among ties: PRE for early micro-batches on stages > 0, just
      before F(m,0) on stage 0 (PRE would front-load stage 0). Backward: the first valid slot
      that starts after stage 0's B(m,0) has finished (so it never waits for its gradient), else
      POST.
    """
    mbs = tuple(encoder_mbs)
    proto = DataflowTable(
        pp,
        vpp,
        num_microbatches,
        mbs,
        forward={e.id: Slot(0, PRE) for e in mbs},
        backward={e.id: Slot(0, POST) for e in mbs},
    )
    check_structure(proto)  # layout, unique ids, micro-batch range, costs
    if policy in FIXED_POLICIES:
        return fixed_table(policy, proto)
    if policy != "auto":
        raise DataflowError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    fwd, bwd = plan_auto(proto, budget, device_budget, shared_cores)
    table = DataflowTable(pp, vpp, num_microbatches, mbs, fwd, bwd, policy=policy)
    validate_dataflow(table)
    return table
