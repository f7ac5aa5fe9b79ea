"""One name for each LLM parameter whatever layer spec built it, so checkpoints, name-seeded
initialisation and Hugging Face interop move between the local spec (CPU) and TE's (GPU).

TE's spec fuses the two pre-norms into the linear layers after them, so the same weight has two
names: the local spec's ``input_layernorm.weight`` is TE's ``self_attention.linear_qkv.
layer_norm_weight``, and ``pre_mlp_layernorm.weight`` is ``mlp.linear_fc1.layer_norm_weight``
(``.bias`` likewise with LayerNorm). Every other parameter has the same name and layout in both
(TE's linears carry megatron's ``partition_dim`` / ``partition_stride`` too). The canonical name
is the local spec's; :func:`canonical_name` is applied where names leave a model
(``models.init.global_llm_names``), so a checkpoint holds only canonical names and loads into
either spec. These are the pairs of ``get_gpt_layer_local_spec``'s
``sharded_state_dict_keys_map`` in megatron-core 0.16.1 (``models/gpt/gpt_layer_specs.py``),
which maps the other way for megatron's own checkpoints; a unit test compares them.
"""

from __future__ import annotations

FUSED_NORMS: tuple[tuple[str, str], ...] = (
    ("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
    ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"),
)
"""(local spec prefix, TE spec prefix) inside a transformer layer."""


def _swap(name: str, *, src: int) -> str:
    for pair in FUSED_NORMS:
        old, new = pair[src], pair[1 - src]
        head, sep, tail = name.rpartition("." + old)
        if sep and "." not in tail:  # the prefix names this parameter's own module
            return f"{head}.{new}{tail}"
    return name


def canonical_name(name: str) -> str:
    """The spec-independent name of a GPTModel parameter (TE names mapped to the local spec's)."""
    return _swap(name, src=1)


def te_name(name: str) -> str:
    """The TE spec's name of a parameter given its canonical name."""
    return _swap(name, src=0)
