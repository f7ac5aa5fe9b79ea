"""The dataflow table: where each encoder micro-batch runs inside megatron's pipeline schedule.

EncoderAnchor (PAPER.md techniques 5-6) inserts encoder work into the LLM pipeline without editing
megatron-core. This package is the one description of that joint schedule, shared by the runtime,
the planner (``omni plan``) and the simulators, so it is pure Python (no torch).

Vocabulary
----------
- LLM op: ``F``/``B`` of (micro-batch ``m``, model chunk ``c``) as megatron-core 0.16.1 runs them on
  one pipeline stage (:func:`~omni_trainer.multiplex.dataflow.schedule.stage_ops`).
- Slot ``(stage, index)``: a place on one stage where encoder work may run. ``index`` counts that
  stage's FORWARD ops: ``i`` in ``0..n-1`` (``n = num_microbatches * vpp``) is inside megatron's
  i-th ``forward_step_func`` call of the stage, just before the LLM forward; on a stage > 0 (and on
  stage 0 for chunks > 0) megatron has already received that op's input activation, so the slot
  comes after the op's cross-stage dependency. ``PRE`` (-1) runs before megatron's schedule is
  called, ``POST`` (a large sentinel, sorts after every index) after it ends (in the wrapped
  ``finalize_model_grads_func``). Within one slot encoder backwards run before encoder forwards,
  each group in ascending (LLM micro-batch, id) order.
- An encoder micro-batch (one modality's media of one LLM micro-batch) runs its forward at one slot
  and its backward at a later slot of the SAME stage (its activations live there). Its output goes
  to stage 0, which consumes it at F(m, 0); its gradient comes back from stage 0's B(m, 0).

Validity is acyclicity of a happens-before graph
(:func:`~omni_trainer.multiplex.dataflow.validate.validate_dataflow`). Sends are modelled as
non-blocking (buffered); only receives (and program order) create edges.

Modules, each importing only those above it:

- ``schedule``: megatron's op order per stage (the replica of its schedules).
- ``table``: the table itself, its paper notation and serialized form, the memory it holds.
- ``graph``: the happens-before graph of one step, weighted with the unit time model.
- ``validate``: why a table cannot run (structure, order, deadlock).
- ``policies``: the fixed policies (``stage0``, ``front_loaded``, ``uniform``).
- ``refine``: ``auto``'s objective and local search.
- ``auto``: ``auto``'s budgets and greedy placement.
- ``plan``: :func:`~omni_trainer.multiplex.dataflow.plan.plan_dataflow`, every policy's entry.
- ``simulate``: the unit time model's step (the first rung of the simulators).
- ``display``: the table as text, for ``omni plan``.
"""
