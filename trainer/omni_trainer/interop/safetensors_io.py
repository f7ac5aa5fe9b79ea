"""Streaming safetensors reads: a model's tensors by name, whole or as a row/column slice, without
loading a file (each rank reads only the bytes of the slices it holds)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from omni_trainer.interop.source import HFModelError

INDEX = "model.safetensors.index.json"


class SafetensorsReader:
    """Every ``*.safetensors`` tensor of a directory, found through the index when there is one."""

    def __init__(self, root: Path) -> None:
        from safetensors import safe_open

        self.root = root
        index = root / INDEX
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = sorted(p.name for p in root.glob("*.safetensors"))
        if not files:
            raise HFModelError(f"{root}: no *.safetensors files")
        self._handles = {f: safe_open(str(root / f), framework="pt") for f in files}
        self._where = {k: f for f, h in self._handles.items() for k in h.keys()}  # noqa: SIM118

    def keys(self) -> list[str]:
        return sorted(self._where)

    def prefix_of(self, suffix: str, what: str) -> str:
        """The one prefix under which the checkpoint holds ``suffix`` (where a VLM or a dual
        encoder nests ``what``: ``vision_tower.``, ``model.language_model.``...)."""
        found = [k[: -len(suffix)] for k in self._where if k == suffix or k.endswith("." + suffix)]
        if len(found) != 1:
            raise HFModelError(
                f"{self.root}: expected one {what} (a tensor named *{suffix}), found "
                f"{len(found)}{': ' + ', '.join(sorted(found)) if found else ''}"
            )
        return found[0]

    def _slice(self, name: str):
        if name not in self._where:
            raise HFModelError(f"tensor {name!r} is missing from {self.root}")
        return self._handles[self._where[name]].get_slice(name)

    def shape(self, name: str) -> list[int]:
        return list(self._slice(name).get_shape())

    def has(self, name: str) -> bool:
        return name in self._where

    def dtype(self, name: str) -> str:
        """The header's dtype (``F32``, ``BF16``, ``I8``...)."""
        return self._slice(name).get_dtype()

    def read(
        self,
        name: str,
        *,
        expect: list[int] | None = None,
        rows: tuple[int, int] | None = None,
        cols: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """The tensor (or ``rows`` / ``cols`` of it), after checking its full shape."""
        sl = self._slice(name)
        shape = list(sl.get_shape())
        if expect is not None and shape != expect:
            raise HFModelError(
                f"tensor {name!r} in {self.root} has shape {shape}, the model expects {expect}"
            )
        if rows is not None:
            return sl[rows[0] : rows[1]]
        if cols is not None:
            return sl[:, cols[0] : cols[1]]
        return sl[:]
