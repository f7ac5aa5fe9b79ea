"""torchrun worker for ``test_megatron_schedule_order.py``: the op order megatron really runs.

For each scenario ``[pp, vpp, num_microbatches]`` (``argv[1]``, JSON; pp = world size) it builds
trivial per-chunk modules, runs ``get_forward_backward_func()`` (1F1B or interleaved, gloo, CPU)
and records every forward call (micro-batch from a per-chunk counter) and every backward op (a
gradient hook on the chunk's output fires inside that op). Each rank writes its records as JSON to
``argv[2]/rank{r}.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor, nn

from omni_trainer.mcore.cpu_compat import apply_cpu_compat

SEQ, HIDDEN = 4, 8
Record = list[object]


class Chunk(nn.Module):
    """One model chunk: a Linear; the first chunk of stage 0 reads data, others the p2p input."""

    def __init__(self, config: TransformerConfig, chunk: int, reads_data: bool) -> None:
        super().__init__()
        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self.chunk = chunk
        self.reads_data = reads_data
        self.linear = nn.Linear(HIDDEN, HIDDEN)
        self.input_tensor: Tensor | None = None
        self.calls = 0

    def set_input_tensor(self, tensor: list[Tensor | None] | Tensor | None) -> None:
        self.input_tensor = tensor[0] if isinstance(tensor, list) else tensor


def run(pp: int, vpp: int, num_microbatches: int) -> list[Record]:
    ps.initialize_model_parallel(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
    )
    stage = ps.get_pipeline_model_parallel_rank()
    config = TransformerConfig(
        num_layers=pp * vpp,
        hidden_size=HIDDEN,
        num_attention_heads=1,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
        batch_p2p_comm=False,
        variable_seq_lengths=False,
        use_cpu_initialization=True,
    )
    torch.manual_seed(stage)
    chunks = [Chunk(config, c, reads_data=stage == 0 and c == 0) for c in range(vpp)]
    log: list[Record] = []

    def forward_step(data_iterator, model: Chunk):
        m = model.calls
        model.calls += 1
        log.append(["F", m, model.chunk])
        x = next(data_iterator) if model.reads_data else model.input_tensor
        out = model.linear(x)
        out.register_hook(lambda grad, m=m, c=model.chunk: log.append(["B", m, c]))

        def loss_func(output: Tensor):
            loss = output.pow(2).mean()
            return loss, {"loss": loss.detach()}

        return out, loss_func

    def data():
        for _ in range(num_microbatches):
            yield torch.randn(SEQ, 1, HIDDEN)

    iters = [data() for _ in range(vpp)]
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iters if vpp > 1 else iters[0],
        model=chunks,
        num_microbatches=num_microbatches,
        seq_length=SEQ,
        micro_batch_size=1,
        forward_only=False,
    )
    ps.destroy_model_parallel()
    return log


def main() -> None:
    scenarios = json.loads(sys.argv[1])
    out = Path(sys.argv[2])
    dist.init_process_group("gloo")
    apply_cpu_compat()
    records = []
    for pp, vpp, m in scenarios:
        assert pp == dist.get_world_size()
        ops = run(pp, vpp, m)
        records.append({"pp": pp, "vpp": vpp, "num_microbatches": m, "ops": ops})
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(records))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
