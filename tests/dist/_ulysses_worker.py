"""torchrun worker for ``test_ulysses.py``: Ulysses SP and LSSP against single-rank encoding.

Every rank builds identical encoders (same seed), computes the single-rank reference itself (the
encoder's mixer is inactive outside ``sharded``), then the same work sequence parallel over the
whole world (gloo). Rank 0 writes the largest differences per scenario as JSON to ``argv[1]``.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch import Tensor, nn

from omni_trainer.balance.lssp import plan_lssp
from omni_trainer.models.encoders.audio import AudioEncoder
from omni_trainer.models.encoders.config import AudioEncoderConfig, VisionEncoderConfig
from omni_trainer.models.encoders.qwen_vision import QwenVisionTower
from omni_trainer.models.encoders.vision import VisionEncoder
from omni_trainer.models.recompute import Recompute
from omni_trainer.models.ulysses import UlyssesMixer, encode_sequence_parallel

VIT = VisionEncoderConfig(preset="vit-tiny")
# kernel 15 reaches 7 tokens either side: more than a 4-rank shard of a 37-token clip holds
CONFORMER = AudioEncoderConfig(preset="conformer-tiny", conv_kernel_size=15)

QWEN = VisionEncoderConfig(hf=sys.argv[2])
"""A tiny Qwen2.5-VL tower: config.json alone in ``argv[2]`` (random init here)."""


def build(which: str) -> nn.Module:
    torch.manual_seed(0)
    if which == "vision":
        return VisionEncoder(VIT, mixer=UlyssesMixer())
    if which == "qwen":
        return QwenVisionTower(QWEN, mixer=UlyssesMixer())
    return AudioEncoder(CONFORMER, mixer=UlyssesMixer())


def media(which: str, tokens_hw: tuple[int, int], seed: int) -> Tensor:
    """An image of ``h x w`` output tokens, or a clip of ``h * w`` tokens."""
    gen = torch.Generator().manual_seed(seed)
    h, w = tokens_hw
    if which in ("vision", "qwen"):
        side = VIT.position_side if which == "vision" else QWEN.position_side
        return torch.randn(3, h * side, w * side, generator=gen)
    return torch.randn(4 * h * w, CONFORMER.n_mels, generator=gen)


def loss_weights(n: int, seed: int) -> Tensor:
    """Fixed random weights of the loss ``sum(out * w)``, ~N(0, 1/numel): O(1) loss and grads."""
    w = torch.randn(n, 64, generator=torch.Generator().manual_seed(1000 + seed))
    return w / (n * 64) ** 0.5


def gathered(local: Tensor) -> Tensor:
    """Shards of all ranks, concatenated in rank order."""
    parts: list[Tensor | None] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local.detach())
    return torch.cat(parts)  # type: ignore[arg-type]


def grads(enc: nn.Module, *, reduce: bool) -> dict[str, Tensor]:
    out = {}
    for name, p in enc.named_parameters():
        g = p.grad.detach().clone()
        if reduce:
            dist.all_reduce(g)
        out[name] = g
        p.grad = None
    return out


def diffs(out: Tensor, ref: Tensor, g: dict[str, Tensor], g_ref: dict[str, Tensor]) -> dict:
    assert out.shape == ref.shape, (out.shape, ref.shape)
    return {
        "out": (out - ref).abs().max().item(),
        "grad": max((g[k] - g_ref[k]).abs().max().item() for k in g_ref),
        "grad_scale": max(v.abs().max().item() for v in g_ref.values()),
        "zero_grads": sorted(k for k, v in g_ref.items() if not v.abs().sum() > 0),
    }


def one_long_sample(which: str, tokens_hw: tuple[int, int]) -> dict:
    """One sample, SP over the world, vs the same encoder on one rank."""
    enc, sample = build(which), media(which, tokens_hw, seed=1)
    n = tokens_hw[0] * tokens_hw[1]
    weights = loss_weights(n, seed=1)
    ref = enc([sample])
    (ref * weights).sum().backward()
    g_ref = grads(enc, reduce=False)

    rank, world = dist.get_rank(), dist.get_world_size()
    local = encode_sequence_parallel(enc, sample, dist.group.WORLD)
    sizes = [0] * world
    dist.all_gather_object(sizes, local.shape[0])
    start = sum(sizes[:rank])
    (local * weights[start : start + local.shape[0]]).sum().backward()
    return {"sizes": sizes, **diffs(gathered(local), ref.detach(), grads(enc, reduce=True), g_ref)}


def lssp_batch(which: str, recompute: str = "none") -> dict:
    """A mixed micro-batch planned by LSSP: short samples DP, long ones SP, same encoder; with
    ``recompute`` there (the reference without), so blocks and attention cores rerun in the
    backward, after the sharded forward has ended."""
    shapes = [(1, 5), (5, 7), (2, 4), (1, 3), (3, 7), (2, 3), (1, 1)]
    enc = build(which)
    arrays = [media(which, hw, seed=10 + i) for i, hw in enumerate(shapes)]
    lengths = [h * w for h, w in shapes]
    weights = [loss_weights(n, seed=10 + i) for i, n in enumerate(lengths)]
    ref = enc(arrays)
    (ref * torch.cat(weights)).sum().backward()
    g_ref = grads(enc, reduce=False)
    enc.mixer.recompute = Recompute(recompute)

    rank = dist.get_rank()
    plan = plan_lssp(lengths, eta=10, group_size=dist.get_world_size(), cost=float)
    pieces: dict[tuple[int, int], Tensor] = {}
    loss = torch.zeros(())
    if plan.short[rank]:
        short = enc([arrays[i] for i in plan.short[rank]])
        for i, out in zip(
            plan.short[rank], short.split([lengths[i] for i in plan.short[rank]]), strict=True
        ):
            pieces[(i, 0)] = out
    for i in plan.long:
        pieces[(i, plan.placement[i][rank].start)] = encode_sequence_parallel(
            enc, arrays[i], dist.group.WORLD
        )
    for (i, start), out in pieces.items():
        loss = loss + (out * weights[i][start : start + out.shape[0]]).sum()
    loss.backward()
    # route: every output piece to rank 0's view of the batch, via the plan's placement
    everything: list[dict | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everything, {k: v.detach() for k, v in pieces.items()})
    merged = {k: v for part in everything for k, v in part.items()}  # type: ignore[union-attr]
    out = torch.cat([merged[(i, r.start)] for i in range(len(lengths)) for r in plan.placement[i]])
    result = diffs(out, ref.detach(), grads(enc, reduce=True), g_ref)
    return {"long": list(plan.long), **result}


def heads_must_divide() -> dict:
    mixer = UlyssesMixer()
    world = dist.get_world_size()
    q = torch.zeros(1, 3, 8)  # 3 heads: divisible by neither 2 nor 4
    with mixer.sharded(dist.group.WORLD, [1] * world):
        try:
            mixer.attention(q, q, q, torch.tensor([0, 1]))
        except ValueError as err:
            return {"error": str(err)}
    return {"error": None}


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    results = {
        "vision_35": one_long_sample("vision", (5, 7)),
        "audio_37": one_long_sample("audio", (37, 1)),
        "vision_1": one_long_sample("vision", (1, 1)),  # fewer tokens than ranks: empty shards
        "audio_3": one_long_sample("audio", (3, 1)),
        "lssp_vision": lssp_batch("vision"),
        "lssp_audio": lssp_batch("audio"),
        # 35 merged tokens = 140 patches in windows of 4x4 patches: shards of whole 2x2 blocks
        "qwen_35": one_long_sample("qwen", (5, 7)),
        "qwen_1": one_long_sample("qwen", (1, 1)),
        "lssp_qwen": lssp_batch("qwen"),
        "lssp_vision_full": lssp_batch("vision", "full"),
        "lssp_audio_full": lssp_batch("audio", "full"),
        "lssp_audio_selective": lssp_batch("audio", "selective"),
        "lssp_qwen_full": lssp_batch("qwen", "full"),
        "lssp_qwen_selective": lssp_batch("qwen", "selective"),
        "heads": heads_must_divide(),
    }
    dist.barrier()
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump({"world_size": dist.get_world_size(), **results}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
