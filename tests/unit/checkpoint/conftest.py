from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture
def fake_world(request: pytest.FixtureRequest) -> Iterator[int]:
    """This process as rank 0 of ``request.param`` (default 8) ranks in PyTorch's fake process
    group: collectives return at once and move no data."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    size = getattr(request, "param", 8)
    assert not dist.is_initialized()
    dist.init_process_group("fake", rank=0, world_size=size, store=FakeStore())
    try:
        yield size
    finally:
        dist.destroy_process_group()
