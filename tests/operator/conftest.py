"""The real kopf operator (``omni_operator.handlers``) against the kmock API emulator over HTTP.

Each test gets a fresh emulator on 127.0.0.1 with the CRD and four fake GPU nodes in two spines,
and an operator running in-process (``omni_operator.sandbox.testbed``: pods do not run; tests
write pod phases and container states through ``/status`` like a kubelet, and move the cluster's
clock forward instead of sleeping).
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator

os.environ.setdefault("OMNI_RESYNC_SECONDS", "0.2")  # hang tests: progress is polled

import pytest_asyncio

from omni_operator.sandbox.emulator import Emulator
from omni_operator.sandbox.testbed import Cluster, running_cluster


@pytest_asyncio.fixture
async def cluster() -> AsyncIterator[Cluster]:
    logging.getLogger("kopf").setLevel(logging.WARNING)
    async with running_cluster(["a", "a", "b", "b"], emulator=Emulator(keep_requests=True)) as c:
        yield c
