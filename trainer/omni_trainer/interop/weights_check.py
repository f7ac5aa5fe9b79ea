"""The imported weights against the manifest's model before anything is built: every tensor the
LLM and each imported tower read must be in the safetensors files with the shape their
config.json implies and a floating dtype. Only the files' headers are read (``safe_open``'s
slices give shape and dtype without the data), so a hidden-size mismatch or a quantized export
is named in ``omni validate --sources``, not at start-up."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omni_trainer.interop.source import HFModelError
from omni_trainer.models.config import ModelConfig

FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
SHOWN = 3
"""Mismatches named per checkpoint (the rest are counted)."""


def check_weights(model: ModelConfig) -> list[str]:
    """One problem per checkpoint whose tensors do not fit the model, each naming the field,
    the tensors and both shapes (or dtypes)."""
    problems = []
    if model.llm.hf is not None:
        field = "model.hf" if model.hf is not None else "model.llm.hf"
        problems += _check(field, model.llm.hf, lambda r: _llm_shapes(r, model.llm))
    for modality, enc in model.encoders.items():
        if enc.hf is not None:  # a whole VLM (model.hf): its tower sits in the same files
            whole = model.hf is not None and modality == "image"
            field = "model.hf" if whole else f"model.encoders.{modality}.hf"
            problems += _check(field, enc.hf, lambda r, e=enc: _tower(r, e))
    return problems


def _check(field: str, path: str, expected: Callable[[Any], dict[str, list[int]]]) -> list[str]:
    """Compare ``expected(reader)`` (HF name -> shape) with the headers under ``path``."""
    from omni_trainer.interop.safetensors_io import SafetensorsReader
    from omni_trainer.interop.source import local_dir

    where = f"spec.trainer.{field} ({path})"
    try:
        reader = SafetensorsReader(local_dir(path))
        want = expected(reader)
    except HFModelError as err:
        return [f"{where}: {err}"]
    except Exception as err:  # an unreadable header
        return [f"{where}: {type(err).__name__}: {err}"]
    missing, shapes, dtypes = [], [], []
    for name, shape in want.items():
        if not reader.has(name):
            missing.append(name)
            continue
        if (got := reader.shape(name)) != shape:
            shapes.append(f"{name} is {got}, the config implies {shape}")
        if (dtype := reader.dtype(name)) not in FLOAT_DTYPES:
            dtypes.append(f"{name} is {dtype}")
    out = []
    for what, found, fix in (
        ("tensors missing", missing, "a checkpoint of another architecture?"),
        ("shapes differ from config.json", shapes, "config.json and the weights disagree"),
        (
            "non-float dtypes",
            dtypes,
            f"quantized weights are not read; use {'/'.join(FLOAT_DTYPES)}",
        ),
    ):
        if found:
            more = f" and {len(found) - SHOWN} more" if len(found) > SHOWN else ""
            out.append(f"{where}: {len(found)} {what}: {'; '.join(found[:SHOWN])}{more} ({fix})")
    return out


def _llm_shapes(reader: Any, cfg: Any) -> dict[str, list[int]]:
    from omni_trainer.interop.llm import expected_hf_shapes, hf_names_of

    return expected_hf_shapes(cfg, hf_names_of(reader))


def _tower(reader: Any, cfg: Any) -> dict[str, list[int]]:
    """HF name -> shape of each tensor the tower reads (the tower built on the meta device)."""
    import torch

    from omni_trainer.interop.encoders import ZERO, encoder_prefix, hf_names
    from omni_trainer.models.omni import imported_tower

    family = cfg.tower.family
    prefix = encoder_prefix(reader, family)
    with torch.device("meta"):
        tower = imported_tower(cfg)
    out: dict[str, list[int]] = {}
    for name, param in tower.named_parameters():
        names = hf_names(name, family, prefix)
        rows = param.shape[0] // len(names)
        out.update({n: [rows, *param.shape[1:]] for n in names if n != ZERO})
    return out
