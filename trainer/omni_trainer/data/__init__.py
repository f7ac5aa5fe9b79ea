"""Data pipeline: sources (synthetic, tar shards on disk/S3), mixture schedule, packing, loader.

Pure numpy + stdlib (boto3 only when an S3 url is used); no torch import here.
"""

from omni_trainer.data.config import (
    MODALITIES,
    DataConfig,
    LengthDistribution,
    MixturePoint,
    Modality,
    ShardSourceConfig,
    SyntheticSourceConfig,
)
from omni_trainer.data.loader import DataLoader, MediaReader, MultimodalStream, build_source
from omni_trainer.data.mixture import DeficitMixer, MixtureSchedule
from omni_trainer.data.packing import (
    MediaItem,
    MicroBatch,
    PackedSequence,
    Packer,
    Segment,
    collate,
    split_micro_batches,
)
from omni_trainer.data.sample import MediaGeometry, MediaRef, Sample
from omni_trainer.data.shards import ShardSource, make_fixture_shards, write_shards
from omni_trainer.data.synthetic import CLASS_TOKEN_BASE, FIRST_TEXT_ID, PAD_ID, SyntheticSource

__all__ = [
    "CLASS_TOKEN_BASE",
    "FIRST_TEXT_ID",
    "MODALITIES",
    "PAD_ID",
    "DataConfig",
    "DataLoader",
    "DeficitMixer",
    "LengthDistribution",
    "MediaGeometry",
    "MediaItem",
    "MediaReader",
    "MediaRef",
    "MicroBatch",
    "MixturePoint",
    "MixtureSchedule",
    "Modality",
    "MultimodalStream",
    "PackedSequence",
    "Packer",
    "Sample",
    "Segment",
    "ShardSource",
    "ShardSourceConfig",
    "SyntheticSource",
    "SyntheticSourceConfig",
    "build_source",
    "collate",
    "make_fixture_shards",
    "split_micro_batches",
    "write_shards",
]
