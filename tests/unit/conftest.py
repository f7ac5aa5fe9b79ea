from __future__ import annotations

import pytest


@pytest.fixture
def single_rank():
    """A world of one (gloo on CPU) with megatron's parallel state, torn down afterwards."""
    from omni_trainer.distributed.config import ParallelDims
    from omni_trainer.mcore.parallel import (
        build_process_groups,
        destroy_distributed,
        init_distributed,
        seed_everything,
    )

    _, world, device = init_distributed()
    groups = build_process_groups(ParallelDims(world_size=world), device)
    seed_everything(0)
    yield groups
    destroy_distributed()
