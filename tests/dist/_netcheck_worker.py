"""One rank of ``test_netcheck.py`` (started as a plain process per node, as pods are): the
network preflight over gloo, this rank on node ``n<RANK>``; ``argv[2]`` degrades rank 1
(``slow``: 0.2 s late on every exchange, as a congested link) or silences rank 2 (``silent``:
it never joins the check). The result goes to ``argv[1]/rank<R>.json``, with the
seconds the preflight itself took (process start and imports excluded: they vary with the load)."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch.distributed as dist

from omni_trainer.distributed import netcheck
from omni_trainer.distributed.netcheck_rules import PreflightConfig
from omni_trainer.mcore.parallel import init_distributed

out, scenario = Path(sys.argv[1]), sys.argv[2]
rank, _, _ = init_distributed()
cfg = PreflightConfig(size_mb=1, iterations=3, timeout_seconds=5)
if scenario == "healthy":  # three processes share two busy cores: a healthy link's figure
    cfg = cfg.model_copy(update={"min_fraction_of_median": 0.1})  # swings with the scheduler
if scenario == "slow" and rank == 1:
    send = dist.isend

    def late(*args, **kwargs):
        time.sleep(0.2)
        return send(*args, **kwargs)

    dist.isend = late
if scenario == "silent" and rank == 2:
    netcheck.comm.all_gather_object(f"n{rank}")  # joins the gang, then stops answering
    netcheck.preflight_groups(cfg)
    time.sleep(15)
    os._exit(0)
started = time.monotonic()
result = netcheck.run_preflight(cfg, rank=rank, node=f"n{rank}")
record = asdict(result) | {"preflight_seconds": time.monotonic() - started}
(out / f"rank{rank}.json").write_text(json.dumps(record))
netcheck.enforce(result)
