"""Megatron sequence parallelism (SP) with the local (non-TE) layer spec, and the stage-0 reshard.

With SP the tensor-parallel ranks each hold ``seq / tp`` positions of the residual stream: norms,
residual adds and dropout run on that shard, and megatron's column/row parallel linears gather
and reduce-scatter along the sequence instead of all-reducing. TE's norms support it; megatron's
torch norm (``WrappedTorchNorm``, read against megatron-core 0.16.1) asserts it off. Here the same
torch norms are built with their parameters marked ``sequence_parallel = True`` (as TE marks
its own), so the trainer sums those gradients over the TP group after the backward: each rank's
norm saw only its positions.

Stage 0 (send-then-reshard): megatron's embedding returns each TP rank's sequence shard (its
vocab-parallel lookup reduce-scattered along the sequence), and each rank writes into it only
the encoder output rows of its shard, which are all it receives (``multiplex.reshard``).
"""

from __future__ import annotations

import copy
import dataclasses

from torch import nn


class SequenceParallelNorm:
    """``WrappedTorchNorm`` with sequence parallelism: a torch LayerNorm / RMSNorm whose
    parameters carry ``sequence_parallel`` (same module, same parameter names)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused) -> nn.Module:
        norm_cls = {"LayerNorm": nn.LayerNorm, "RMSNorm": nn.RMSNorm}[config.normalization]
        norm = norm_cls(hidden_size, eps=eps, dtype=config.params_dtype)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm


def _swap_norms(spec):
    """A copy of a layer spec with every megatron torch norm replaced by the SP one."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if spec is WrappedTorchNorm:
        return SequenceParallelNorm
    if isinstance(spec, ModuleSpec):
        spec = copy.copy(spec)
        spec.module = _swap_norms(spec.module)
        spec.submodules = _swap_norms(spec.submodules)
        return spec
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {f.name: _swap_norms(getattr(spec, f.name)) for f in dataclasses.fields(spec)}
        return dataclasses.replace(spec, **changes)
    return spec


def local_block_spec(layer_spec, config, vp_stage: int | None):
    """The block spec of one model chunk: SP norms in every layer and as the final norm."""
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    layer = _swap_norms(layer_spec)
    return TransformerBlockSubmodules(
        layer_specs=[layer] * get_num_layers_to_build(config, vp_stage=vp_stage),
        layer_norm=SequenceParallelNorm,
    )
