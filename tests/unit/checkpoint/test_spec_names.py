"""Checkpoints move between megatron's local and TE layer specs, and between precisions.

TE cannot run here, so its layout is built from a local-spec model by moving the two pre-norms'
parameters where TE's spec holds them (fused into ``linear_qkv`` / ``linear_fc1`` as
``layer_norm_weight`` / ``layer_norm_bias``): the names and the module structure a TE model has.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from omni_trainer.checkpoint.checkpointer import Checkpointer
from omni_trainer.checkpoint.config import CheckpointConfig
from omni_trainer.checkpoint.state import ModelState
from omni_trainer.models.config import LLMConfig
from omni_trainer.models.init import global_llm_names, init_llm_chunk
from omni_trainer.models.llm import LLMRuntime, build_gpt
from omni_trainer.models.spec_names import FUSED_NORMS, canonical_name, te_name

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

CFG = LLMConfig(preset="tiny", normalization="LayerNorm")  # LayerNorm: weights and biases


def test_the_pairs_are_megatrons_own() -> None:
    """megatron maps the local spec's norm names to TE's for its own checkpoints: same pairs."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    keys_map = get_gpt_layer_local_spec().submodules.sharded_state_dict_keys_map
    assert keys_map == dict(FUSED_NORMS)


L = "decoder.layers."


@pytest.mark.parametrize(
    ("local", "te"),
    [
        (L + "3.input_layernorm.weight", L + "3.self_attention.linear_qkv.layer_norm_weight"),
        (L + "0.pre_mlp_layernorm.bias", L + "0.mlp.linear_fc1.layer_norm_bias"),
        (L + "1.mlp.linear_fc1.weight", L + "1.mlp.linear_fc1.weight"),
        ("decoder.final_layernorm.weight", "decoder.final_layernorm.weight"),
    ],
)
def test_names_map_both_ways(local: str, te: str) -> None:
    assert te_name(local) == te and canonical_name(te) == local
    assert canonical_name(local) == local  # canonical names are fixed points


def te_layout(chunk: nn.Module) -> nn.Module:
    """``chunk`` rearranged as megatron's TE spec builds it: the pre-norms are identities and
    their parameters live on the following linear layer, under TE's names."""
    for layer in chunk.decoder.layers:
        for norm_name, linear in (
            ("input_layernorm", layer.self_attention.linear_qkv),
            ("pre_mlp_layernorm", layer.mlp.linear_fc1),
        ):
            for pname, param in getattr(layer, norm_name).named_parameters():
                linear.register_parameter(f"layer_norm_{pname}", param)
            setattr(layer, norm_name, nn.Identity())
    return chunk


def _model(seed: int, *, te: bool, dtype: torch.dtype = torch.float32) -> nn.Module:
    chunk = build_gpt(CFG, max_sequence_length=32, runtime=LLMRuntime(params_dtype=dtype))
    init_llm_chunk(chunk, seed=seed, std=0.02, num_layers=CFG.num_layers, tp_rank=0, tp_size=1)
    with torch.no_grad():  # vectors too, so a load that skipped them would show
        for p in chunk.parameters():
            if p.ndim == 1:
                p.normal_(1.0, 0.1, generator=torch.Generator().manual_seed(seed + p.numel()))
    return te_layout(chunk) if te else chunk


def _state(chunk: nn.Module) -> ModelState:
    """Canonical names, and an optimizer that has taken a step (so it has state to move)."""
    params = global_llm_names(chunk)
    opt = torch.optim.AdamW(params.values(), lr=1e-2, foreach=False)
    for p in params.values():
        p.grad = torch.full_like(p, 0.5)
    opt.step()
    return ModelState(llm=params, replicated={}, optimizer=opt)


def _round_trip(tmp_path: Path, saved: ModelState, loaded: ModelState) -> None:
    config = CheckpointConfig(path=str(tmp_path / "ck"), async_save=False)
    ckpt = Checkpointer(config)
    ckpt.save(1, saved, None)
    assert ckpt.close().committed
    assert Checkpointer(config).load_latest(loaded).step == 1


@pytest.mark.parametrize(("save_te", "load_te"), [(False, True), (True, False)])
def test_a_checkpoint_moves_between_the_specs(
    single_rank, tmp_path: Path, save_te: bool, load_te: bool
) -> None:
    src, dst = _model(0, te=save_te), _model(1, te=load_te)
    te_model = src if save_te else dst
    raw = dict(te_model.named_parameters())
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in raw
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_bias" in raw
    assert not any("input_layernorm" in n or "pre_mlp_layernorm" in n for n in raw)
    saved, loaded = _state(src), _state(dst)
    assert saved.llm.keys() == loaded.llm.keys()  # canonical names on both sides
    _round_trip(tmp_path, saved, loaded)
    for name, p in saved.llm.items():
        q = loaded.llm[name]
        assert torch.equal(p, q), name
        sa, sb = saved.optimizer.state[p], loaded.optimizer.state[q]
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa), name


def test_bf16_weights_load_into_fp32_and_back(single_rank, tmp_path: Path) -> None:
    """Weights saved in bf16 load exactly into an fp32 model (of the other spec), and fp32
    weights saved load into bf16 as their rounding."""
    bf16 = _state(_model(0, te=False, dtype=torch.bfloat16))
    fp32 = _state(_model(1, te=True))
    _round_trip(tmp_path / "a", bf16, fp32)
    for name, p in bf16.llm.items():
        q = fp32.llm[name]
        assert q.dtype == torch.float32 and torch.equal(p.float(), q), name
    again = _state(_model(2, te=False, dtype=torch.bfloat16))
    _round_trip(tmp_path / "b", fp32, again)
    for name, p in fp32.llm.items():
        assert torch.equal(again.llm[name], p.to(torch.bfloat16)), name
