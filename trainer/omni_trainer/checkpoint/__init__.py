"""Checkpoints of model, optimizer and loader state: asynchronous, resharding, on a PVC or S3.

Import the torch-free config from here (the operator validates manifests without torch); the
runtime lives in :mod:`omni_trainer.checkpoint.checkpointer` (``Checkpointer``, ``ModelState``).
"""

from omni_trainer.checkpoint.config import CheckpointConfig

__all__ = ["CheckpointConfig"]
