"""The whole model in one process (TP = PP = 1), with the weights a job would start from or a
checkpoint's: what export and generation work on. A checkpoint of any layout loads here, because
checkpoints are keyed by global names (``checkpoint.state``)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from omni_trainer.config import TrainerConfig
from omni_trainer.models.omni import OmniModel

_STEP_DIR = re.compile(r"^step-(\d{8})$")


def find_checkpoint(path: str) -> tuple[str, int]:
    """(root, step) of ``path``: a checkpoint root (its latest complete step) or one
    ``step-NNNNNNNN`` directory, which must be complete."""
    from omni_trainer.checkpoint.storage import open_storage

    name = path.rstrip("/").rsplit("/", 1)[-1]
    m = _STEP_DIR.match(name)
    root, step = (path.rstrip("/")[: -len(name) - 1], int(m.group(1))) if m else (path, None)
    storage = open_storage(root)
    if step is None:
        step = storage.latest_complete()
        if step is None:
            raise FileNotFoundError(f"{path}: no complete checkpoint there")
    elif storage.read_marker(step) is None:
        raise FileNotFoundError(f"{path}: not a complete (committed) checkpoint")
    return root, step


def resolve_checkpoint(cfg: TrainerConfig, path: str | None) -> tuple[str, int] | None:
    """``find_checkpoint(path)``; without ``path``, the latest complete checkpoint under
    ``checkpoint.path``, or None when there is none."""
    from omni_trainer.checkpoint.storage import open_storage

    if path is not None:
        return find_checkpoint(path)
    if cfg.checkpoint is None:
        return None
    step = open_storage(cfg.checkpoint.path).latest_complete()
    return None if step is None else (cfg.checkpoint.path, step)


@contextmanager
def single_process_model(
    cfg: TrainerConfig, *, checkpoint: str | None, max_sequence_length: int | None = None
) -> Iterator[tuple[OmniModel, int | None]]:
    """The model built in a world of one, with a checkpoint's weights when there is one.

    Yields:
        The model (eval mode) and the step of the checkpoint loaded (None: initial weights).
    """
    from omni_trainer.checkpoint.checkpointer import Checkpointer
    from omni_trainer.checkpoint.config import CheckpointConfig
    from omni_trainer.checkpoint.state import ModelState
    from omni_trainer.distributed.config import ParallelDims
    from omni_trainer.mcore.parallel import (
        build_process_groups,
        destroy_distributed,
        init_distributed,
        seed_everything,
    )
    from omni_trainer.models.init import global_llm_names

    found = resolve_checkpoint(cfg, checkpoint)
    _, _, device = init_distributed()
    try:
        build_process_groups(ParallelDims(world_size=1), device)
        seed_everything(cfg.seed)
        model = OmniModel(
            cfg.model,
            max_sequence_length=max_sequence_length or cfg.data.seq_length,
            seed=cfg.seed,
        ).to(device)
        step = None
        if found is not None:
            root, step = found
            state = ModelState(
                llm={k: v for c in model.llm_chunks for k, v in global_llm_names(c).items()},
                replicated=dict(
                    [
                        *model.encoders.named_parameters(prefix="encoders"),
                        *model.projectors.named_parameters(prefix="projectors"),
                    ]
                ),
                optimizer=None,
            )
            Checkpointer(CheckpointConfig(path=root), cache_plans=False).load(step, state)
        yield model.eval(), step
    finally:
        destroy_distributed()


def hf_files_dir(path: str | None) -> Path | None:
    """The local directory of an HF source, for the files copied beside an export."""
    from omni_trainer.interop.source import local_dir

    return None if path is None else local_dir(path, required=None)
