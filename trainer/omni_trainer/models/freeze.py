"""Which weights train: per-module ``freeze`` and the module names ``optimizer.lrMultipliers``
uses. A frozen parameter has ``requires_grad = False``: autograd computes no gradient for it, the
trainer gives it no gradient buffer, no optimizer state and no all-reduce."""

from __future__ import annotations

from torch import nn

from omni_trainer.models.config import ModelConfig


def parameter_modules(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> its module's name in ``optimizer.lrMultipliers`` (``llm``,
    ``encoders.image``, ``projectors.audio``...) for an ``OmniModel``."""
    out = {id(p): "llm" for p in model.llm_chunks.parameters()}
    for kind in ("encoders", "projectors"):
        for modality, module in getattr(model, kind).items():
            out.update({id(p): f"{kind}.{modality}" for p in module.parameters()})
    return out


def apply_freeze(model: nn.Module, cfg: ModelConfig) -> None:
    """Turn off gradients of the modules (or vision blocks) the manifest freezes."""
    frozen: list[nn.Module] = []
    if cfg.llm.freeze:
        frozen.append(model.llm_chunks)
    for modality, encoder in model.encoders.items():
        enc_cfg = getattr(cfg.encoders, modality)
        if enc_cfg.freeze:
            frozen.append(encoder)
        elif getattr(enc_cfg, "freeze_layers", None) is not None:
            start, stop = enc_cfg.freeze_layers
            frozen.extend(encoder.blocks[start:stop])
            if start == 0:
                frozen.append(encoder.patch_embed)
        if getattr(cfg.projectors, modality).freeze:
            frozen.append(model.projectors[modality])
    for module in frozen:
        module.requires_grad_(False)


def is_frozen(module: nn.Module) -> bool:
    """No parameter of ``module`` trains (its forward needs no autograd graph)."""
    return not any(p.requires_grad for p in module.parameters())
