"""Layout-independent initialisation: every weight is a function of (seed, its global name).

Megatron draws weights from one RNG stream in construction order, so a pipeline stage that builds
only layers 4-7 would draw different numbers than a single process that builds layers 0-7. Here
each full weight is drawn from its own generator, seeded by its global name (global layer number,
not the stage-local index), and this rank keeps its tensor-parallel shard. Any layout therefore
starts from exactly the single-process weights, which the equivalence guarantee needs.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

from omni_trainer.models.spec_names import canonical_name

# megatron's default: output_layer_init_method = normal(0, std / sqrt(2 * num_layers)) for the
# projections that write into the residual stream.
_RESIDUAL_OUTPUTS = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")


def name_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def global_llm_names(chunk: nn.Module) -> dict[str, nn.Parameter]:
    """Parameters of one GPTModel chunk keyed by the names a single-process model would use,
    whatever its layer spec (``models.spec_names``: TE's fused-norm names map to the local's)."""
    names = {}
    for name, param in chunk.named_parameters():
        parts = name.split(".")
        if parts[:2] == ["decoder", "layers"]:
            layer = chunk.decoder.layers[int(parts[2])]
            parts[2] = str(layer.layer_number - 1)  # megatron's layer_number is global, 1-based
        names[canonical_name(".".join(parts))] = param
    return names


def shard_of(
    full: torch.Tensor, param: nn.Parameter, *, tp_rank: int, tp_size: int
) -> torch.Tensor:
    """This rank's piece of a full weight, with megatron's partition dim and stride."""
    if not getattr(param, "tensor_model_parallel", False) or tp_size == 1:
        return full
    dim = param.partition_dim
    stride = getattr(param, "partition_stride", 1)
    pieces = torch.chunk(full, tp_size * stride, dim=dim)
    return torch.cat(pieces[tp_rank::tp_size], dim=dim)


def full_shape(param: nn.Parameter, tp_size: int) -> list[int]:
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= tp_size
    return shape


@torch.no_grad()
def init_llm_chunk(
    chunk: nn.Module, *, seed: int, std: float, num_layers: int, tp_rank: int, tp_size: int
) -> None:
    """Redraw every matrix of a GPTModel chunk from its global name (vectors keep their
    deterministic constants: norms 1, biases 0)."""
    tied = getattr(chunk, "share_embeddings_and_output_weights", False)
    for name, param in global_llm_names(chunk).items():
        if param.ndim < 2:
            continue
        scale = std / math.sqrt(2 * num_layers) if name.endswith(_RESIDUAL_OUTPUTS) else std
        if tied and name == "output_layer.weight":  # the last stage's copy of the embedding
            name = "embedding.word_embeddings.weight"
        gen = torch.Generator().manual_seed(name_seed(seed, name))
        full = torch.randn(full_shape(param, tp_size), generator=gen) * scale
        param.copy_(shard_of(full, param, tp_rank=tp_rank, tp_size=tp_size))
