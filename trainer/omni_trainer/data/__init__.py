"""Data pipeline: sources (synthetic, tar shards on disk/S3), mixture schedule, packing, loader.

Pure numpy + stdlib (boto3 only when an S3 url is used); no torch import here. Names resolve
lazily (PEP 562): the operator imports ``omni_trainer.data.config`` through this package and
has no numpy.
"""

from __future__ import annotations

import importlib
from typing import Any

_SOURCES = {
    "CLASS_TOKEN_BASE": "omni_trainer.data.synthetic",
    "DataConfig": "omni_trainer.data.config",
    "DataLoader": "omni_trainer.data.loader",
    "DeficitMixer": "omni_trainer.data.mixture",
    "FIRST_TEXT_ID": "omni_trainer.data.synthetic",
    "LengthDistribution": "omni_trainer.data.config",
    "MODALITIES": "omni_trainer.data.config",
    "MediaGeometry": "omni_trainer.data.sample",
    "MediaItem": "omni_trainer.data.packing",
    "MediaReader": "omni_trainer.data.loader",
    "MediaRef": "omni_trainer.data.sample",
    "MicroBatch": "omni_trainer.data.packing",
    "MixturePoint": "omni_trainer.data.config",
    "MixtureSchedule": "omni_trainer.data.mixture",
    "Modality": "omni_trainer.data.config",
    "MultimodalStream": "omni_trainer.data.loader",
    "PAD_ID": "omni_trainer.data.synthetic",
    "PackedSequence": "omni_trainer.data.packing",
    "Packer": "omni_trainer.data.packing",
    "Sample": "omni_trainer.data.sample",
    "Segment": "omni_trainer.data.packing",
    "ShardSource": "omni_trainer.data.shards",
    "ShardSourceConfig": "omni_trainer.data.config",
    "SyntheticSource": "omni_trainer.data.synthetic",
    "SyntheticSourceConfig": "omni_trainer.data.config",
    "build_source": "omni_trainer.data.loader",
    "collate": "omni_trainer.data.packing",
    "split_micro_batches": "omni_trainer.data.packing",
    "write_shards": "omni_trainer.data.shards",
}
__all__ = sorted(_SOURCES)


def __getattr__(name: str) -> Any:
    module = _SOURCES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
