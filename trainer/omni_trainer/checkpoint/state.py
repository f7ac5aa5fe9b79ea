"""A rank's checkpointable state keyed by GLOBAL names, so any layout loads any checkpoint.

Approach: torch DCP with ``ShardedTensor`` values whose shard metadata place this rank's
tensor-parallel shard at its offsets in the full logical tensor. megatron shards with a stride
(SwiGLU ``linear_fc1`` has stride 2: rank r holds pieces r, r+TP of the full weight), so a rank
declares one DCP chunk per piece; DCP records the chunks in its global metadata and a load with
another TP size reads exactly the overlapping byte ranges. Pipeline stages need nothing special:
the keys are global layer names (``global_llm_names``), so a stage simply owns a subset of keys.
Each rank writes only its own shard (no gather, no P2P) and each byte is written once:

* LLM tensors: data-parallel rank 0 of each (TP, PP) position; TP-replicated ones (norms,
  biases of row-parallel layers) by TP rank 0 only;
* encoders and projectors (replicated on every rank): rank 0; their optimizer state: rank 0,
  or each parameter's owner under ZeRO-2;
* LLM parameters under the distributed optimizer (ZeRO-1): every data-parallel rank its own
  flat range of the fp32 main weights and Adam moments (``checkpoint/flat_shards.py``), so
  no rank gathers more than it holds.

Optimizer state (AdamW ``exp_avg``, ``exp_avg_sq``, ``step``) uses the same names and sharding:
``optim.<name>.<key>``. Hyper-parameters (lr, betas, weight decay) are not saved: they come from
the config, and the trainer sets the LR of every step itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import (
    ShardedTensorMetadata,
    TensorProperties,
)

from omni_trainer.checkpoint.flat_shards import MODEL_SLOT, FlatShard, flat_targets, staged_flat

MODEL = "model."
OPTIM = "optim."


@dataclass(frozen=True)
class ModelState:
    """What a checkpoint holds of one rank, with the facts that decide who writes what.

    Attributes:
        llm: global LLM name (``global_llm_names``) -> this rank's (TP-sharded) parameter.
        replicated: name -> parameter replicated on every rank (encoders, projectors).
        optimizer: the torch optimizer over (some of) these parameters; None loads weights
            only (export, generation, ``checkpoint.initFrom``).
        rank: global rank (``ShardedTensor`` placements name it).
        tp_rank, tp_size, dp_rank: this rank's LLM position.
        owned: names in ``replicated`` whose optimizer state lives on this rank (ZeRO-2), or
            None when every rank holds all of it (rank 0 then writes it).
        loaded: called once a load has filled these tensors (ZeRO-1 gathers its slices into
            the model weights; bf16 copies the fp32 main weights into the model).
        flat: LLM name -> this rank's range of a parameter split flat under ZeRO-1; such a
            parameter's weight and optimizer state are saved and loaded from the range only.
    """

    llm: Mapping[str, nn.Parameter]
    replicated: Mapping[str, nn.Parameter]
    optimizer: torch.optim.Optimizer | None
    rank: int = 0
    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0
    owned: frozenset[str] | None = None
    loaded: Callable[[], None] | None = None
    flat: Mapping[str, FlatShard] = field(default_factory=dict)

    @classmethod
    def from_trainer(cls, trainer: Any) -> ModelState:
        """The state of an ``omni_trainer.trainer.Trainer`` (duck-typed: no import cycle)."""
        from omni_trainer.models.init import global_llm_names

        # fp32 main weights and optimizer state (this rank's ranges under ZeRO-1), so
        # checkpoints move across precisions and data-parallel layouts
        view = trainer.main.checkpoint_view(trainer.optimizer)
        llm: dict[str, nn.Parameter] = {}
        flat: dict[str, FlatShard] = {}
        for chunk in trainer.chunks:
            for n, p in global_llm_names(chunk).items():
                llm[n] = view.full.get(id(p), p)
                if id(p) in view.flat:
                    flat[n] = view.flat[id(p)]
        replicated = dict(
            [
                *trainer.model.encoders.named_parameters(prefix="encoders"),
                *trainer.model.projectors.named_parameters(prefix="projectors"),
            ]
        )
        owned = None
        if getattr(trainer, "encoder_zero", None) is not None:
            mine = {id(p) for p in trainer.encoder_zero.owned}
            owned = frozenset(n for n, p in replicated.items() if id(p) in mine)
        groups = trainer.groups
        return cls(
            llm=llm,
            replicated=replicated,
            optimizer=view.optimizer,
            rank=groups.rank,
            tp_rank=groups.tp_rank,
            tp_size=groups.dims.tp,
            # replicas of an LLM shard: data x context parallel (CP ranks hold equal weights)
            dp_rank=groups.dp_rank * groups.dims.cp + groups.cp_rank,
            owned=owned,
            loaded=view.loaded,
            flat=flat,
        )

    # -- who holds what ------------------------------------------------------------------------
    def _writes_llm(self, param: nn.Parameter) -> bool:
        return self.dp_rank == 0 and (_is_tp(param, self.tp_size) or self.tp_rank == 0)

    def _holds_replicated_optim(self, name: str) -> bool:
        return self.rank == 0 if self.owned is None else name in self.owned

    def _entries(self) -> Iterable[tuple[str, nn.Parameter, bool]]:
        """(name, param, is_llm) of every parameter, in a stable order."""
        for name, p in self.llm.items():
            yield name, p, True
        for name, p in self.replicated.items():
            yield name, p, False


def _is_tp(param: nn.Parameter, tp_size: int) -> bool:
    return tp_size > 1 and bool(getattr(param, "tensor_model_parallel", False))


def _pieces(param: nn.Parameter, *, tp_rank: int, tp_size: int) -> tuple[list[int], int, list]:
    """Full shape, partition dim, and [(offset along dim, local start, length)] of each piece.

    Mirrors ``omni_trainer.models.init.shard_of``: the full dim is cut into TP * stride equal
    pieces and rank r holds pieces r, r + TP, ... concatenated in that order.
    """
    dim = param.partition_dim
    stride = getattr(param, "partition_stride", 1)
    full = list(param.shape)
    full[dim] *= tp_size
    piece = full[dim] // (tp_size * stride)
    if piece * tp_size * stride != full[dim]:
        raise ValueError(f"dim {dim} of {full} is not divisible by TP {tp_size} x {stride}")
    return full, dim, [((tp_rank + k * tp_size) * piece, k * piece, piece) for k in range(stride)]


def _sharded(
    local: torch.Tensor, param: nn.Parameter, *, rank: int, tp_rank: int, tp_size: int
) -> ShardedTensor:
    """``local`` (this rank's shard of ``param``'s layout) as chunks of the full tensor.

    The metadata lists every TP rank's chunks (it must cover the tensor); peers are placed at
    ``rank - tp_rank + t``, megatron's order (TP fastest), which ``build_anchor_groups`` checks.
    """
    shards: list[Shard] = []
    everyone: list[ShardMetadata] = []
    for t in range(tp_size):
        full, dim, pieces = _pieces(param, tp_rank=t, tp_size=tp_size)
        for offset, start, length in pieces:
            offsets = [0] * len(full)
            offsets[dim] = offset
            sizes = list(full)
            sizes[dim] = length
            meta = ShardMetadata(
                shard_offsets=offsets,
                shard_sizes=sizes,
                placement=f"rank:{rank - tp_rank + t}/{local.device}",
            )
            everyone.append(meta)
            if t == tp_rank:
                tensor = local.narrow(dim, start, length)
                shards.append(Shard(tensor=tensor.contiguous(), metadata=meta))
    props = TensorProperties(dtype=local.dtype, layout=local.layout, requires_grad=False)
    meta = ShardedTensorMetadata(
        shards_metadata=everyone, size=torch.Size(full), tensor_properties=props
    )
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, meta, process_group=dist.group.WORLD
    )


def _value(
    state: ModelState, local: torch.Tensor, param: nn.Parameter, is_llm: bool
) -> torch.Tensor | ShardedTensor:
    if is_llm and _is_tp(param, state.tp_size) and local.shape == param.shape:
        return _sharded(local, param, rank=state.rank, tp_rank=state.tp_rank, tp_size=state.tp_size)
    return local


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy the training loop can no longer modify (the only blocking part of a save)."""
    return t.detach().to("cpu", copy=True)


@torch.no_grad()
def staged_state_dict(state: ModelState) -> dict[str, torch.Tensor | ShardedTensor]:
    """This rank's share of the checkpoint, copied to host memory, keyed for DCP.

    Returns:
        ``model.<name>`` and ``optim.<name>.<key>`` -> CPU tensor or ``ShardedTensor``; only
        the entries this rank writes (see the module docstring), so nothing is written twice.
    """
    optim_state = state.optimizer.state
    out: dict[str, torch.Tensor | ShardedTensor] = {}
    for name, p, is_llm in state._entries():
        if is_llm and name in state.flat:
            if _is_tp(p, state.tp_size) or state.tp_rank == 0:
                staged = staged_flat(
                    p, state.flat[name], optim_state, tp_rank=state.tp_rank, tp_size=state.tp_size
                )
                out.update({_key(name, slot): v for slot, v in staged.items()})
            continue
        writes_value = state._writes_llm(p) if is_llm else state.rank == 0
        writes_optim = writes_value if is_llm else state._holds_replicated_optim(name)
        if writes_value:
            out[MODEL + name] = _value(state, _host_copy(p), p, is_llm)
        if writes_optim and p in optim_state:
            for key, v in sorted(optim_state[p].items()):
                if torch.is_tensor(v):
                    out[f"{OPTIM}{name}.{key}"] = _value(state, _host_copy(v), p, is_llm)
    return out


def load_targets(
    state: ModelState, available: Mapping[str, tuple[torch.Size, torch.dtype]]
) -> tuple[dict[str, torch.Tensor | ShardedTensor], Callable[[], None]]:
    """Buffers for DCP to fill with this rank's share of a checkpoint, and how to apply them.

    Args:
        state: the freshly built model and optimizer of this rank (any layout).
        available: key -> (full size, dtype) of every tensor in the checkpoint (DCP metadata).

    Returns:
        The state dict to pass to ``dcp.load`` and a function that copies the loaded values into
        the parameters and the optimizer state (call it after ``dcp.load``).

    Raises:
        KeyError: a parameter of this model is missing from the checkpoint.
    """
    targets: dict[str, torch.Tensor | ShardedTensor] = {}
    params: list[tuple[nn.Parameter, str]] = []
    slots_of: list[tuple[nn.Parameter, dict[str, str]]] = []
    flat_applies: list[Callable[[], None]] = []
    for name, p, is_llm in state._entries():
        key = MODEL + name
        if is_llm and name in state.flat and state.flat[name].main is None:
            continue  # no part of it is this rank's: the ranks that hold it load it
        if key not in available:
            raise KeyError(f"checkpoint has no {key}")
        if is_llm and name in state.flat:
            entries = {MODEL_SLOT: available[key], **_slots(available, name)}
            mine, apply_flat = flat_targets(
                p,
                state.flat[name],
                entries,
                state.optimizer,
                tp_rank=state.tp_rank,
                tp_size=state.tp_size,
            )
            targets.update({_key(name, slot): t for slot, t in mine.items()})
            flat_applies.append(apply_flat)
            continue
        targets[key] = _value(state, torch.empty(p.shape, dtype=p.dtype), p, is_llm)
        params.append((p, key))
        if state.optimizer is None:
            continue  # weights only
        if not is_llm and state.owned is not None and name not in state.owned:
            continue  # ZeRO-2: another rank holds this parameter's optimizer state
        slots: dict[str, str] = {}
        for slot, (size, dtype) in _slots(available, name).items():
            k = _key(name, slot)
            shaped_like_param = len(size) == p.ndim and len(size) > 0
            shape = p.shape if shaped_like_param else size
            targets[k] = _value(state, torch.empty(shape, dtype=dtype), p, is_llm)
            slots[slot] = k
        if slots:
            slots_of.append((p, slots))

    @torch.no_grad()
    def apply() -> None:
        for p, key in params:
            p.copy_(_local(targets[key], p))
        for p, slots in slots_of:
            state.optimizer.state[p] = {
                slot: _local(targets[k], p).to(p.device) for slot, k in slots.items()
            }
        for apply_flat in flat_applies:
            apply_flat()
        if state.loaded is not None:
            state.loaded()

    return targets, apply


def _key(name: str, slot: str) -> str:
    """The checkpoint key of parameter ``name``'s weight (``MODEL_SLOT``) or optimizer slot."""
    return MODEL + name if slot == MODEL_SLOT else f"{OPTIM}{name}.{slot}"


def _slots(
    available: Mapping[str, tuple[torch.Size, torch.dtype]], name: str
) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Optimizer slot -> (size, dtype) of parameter ``name`` in a checkpoint."""
    prefix = f"{OPTIM}{name}."
    return {
        k[len(prefix) :]: v
        for k, v in sorted(available.items())
        # not another parameter's (a longer name sharing the prefix)
        if k.startswith(prefix) and "." not in k[len(prefix) :]
    }


def _local(target: torch.Tensor | ShardedTensor, param: nn.Parameter) -> torch.Tensor:
    """This rank's tensor from a loaded target (sharded chunks concatenated in piece order)."""
    if isinstance(target, ShardedTensor):
        return torch.cat([s.tensor for s in target.local_shards()], dim=param.partition_dim)
    return target
