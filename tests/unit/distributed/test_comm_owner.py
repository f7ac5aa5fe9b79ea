"""Every torch.distributed collective and P2P call of the trainer lives in distributed/comm.py.

On GPUs the groups carry NCCL for CUDA tensors and gloo for CPU ones: a call made elsewhere
bypasses the staging that puts each tensor on the right side, and fails on its first NCCL run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import omni_trainer

PACKAGE = Path(omni_trainer.__file__).parent
OWNER = PACKAGE / "distributed" / "comm.py"
COLLECTIVES = {
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "irecv",
    "isend",
    "monitored_barrier",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
    "P2POp",
}


def collective_calls(source: str) -> list[str]:
    """Collectives this source calls through torch.distributed (any alias), with their lines."""
    tree = ast.parse(source)
    aliases = {"torch.distributed"}
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch.distributed":
                    aliases.add(a.asname or a.name)
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            for a in node.names:
                if a.name in COLLECTIVES:
                    found.append(f"{node.lineno}: from torch.distributed import {a.name}")
                if a.name == "distributed_c10d":
                    aliases.add(a.asname or a.name)
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            for a in node.names:
                if a.name == "distributed":
                    aliases.add(a.asname or a.name)
    for node in ast.walk(tree):
        is_collective = isinstance(node, ast.Attribute) and node.attr in COLLECTIVES
        if is_collective and ast.unparse(node.value) in aliases:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_collectives_are_called_only_in_comm():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == OWNER:
            continue
        calls = collective_calls(path.read_text())
        if calls:
            offenders[str(path.relative_to(PACKAGE))] = calls
    assert not offenders, (
        f"torch.distributed collectives outside distributed/comm.py: {offenders}; "
        "route them through omni_trainer.distributed.comm"
    )


def test_the_scan_sees_every_spelling():
    assert collective_calls("import torch.distributed as dist\ndist.all_reduce(x)\n")
    assert collective_calls("import torch\ntorch.distributed.broadcast(x, 0)\n")
    assert collective_calls("from torch import distributed as d\nd.isend(x, 1)\n")
    assert collective_calls("from torch.distributed import all_gather_object\n")
    assert collective_calls("import torch.distributed as dist\nf = dist.barrier\n")
    assert not collective_calls("import torch.distributed as dist\ndist.get_rank()\n")
    assert collective_calls(OWNER.read_text())  # the owner itself is seen calling them
