"""Checkpoints of model, optimizer and loader state: asynchronous, resharding, on a PVC or S3.

Import the torch-free config from here (the operator validates manifests without torch). The
runtime's entry is :class:`~omni_trainer.checkpoint.checkpointer.Checkpointer`, over its
collaborators :mod:`.writer`, :mod:`.reader`, :mod:`.ownership` and :mod:`.collectives`; what it
saves is a :class:`~omni_trainer.checkpoint.state.ModelState`.
"""

from omni_trainer.checkpoint.config import CheckpointConfig

__all__ = ["CheckpointConfig"]
