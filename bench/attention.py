"""CPU attention over packed samples: the candidates for the local spec's core attention.

Times causal attention over a packed row of samples, side by side in one run: SDPA per sample
(what ``models.packed.PackedAttention`` does), SDPA with the dense ``[s, s]`` document mask the
LLM path used to build, and ``flex_attention`` with a document mask, eager and compiled (compile
time printed apart: it recurs whenever the layout changes, i.e. every micro-batch). Forward
alone, and forward + backward where the variant has a backward (torch 2.13's flex attention has
none on CPU, so it cannot train there). Each output is checked against the per-sample one.

    python bench/attention.py --lengths 300,700,200,848 --heads 8 --dim 64
    python bench/attention.py --smoke    # 3 short samples, 2 heads, one repeat, no compile
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def per_sample(q, k, v, lengths):
    parts = zip(*(t.split(lengths, dim=2) for t in (q, k, v)), strict=True)
    return torch.cat(
        [F.scaled_dot_product_attention(a, b, c, is_causal=True) for a, b, c in parts], 2
    )


def dense_mask(q, k, v, doc):
    mask = (doc[:, None] == doc[None]) & torch.ones(len(doc), len(doc), dtype=torch.bool).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def timed(fn, qkv, *, repeats: int, backward: bool) -> float:
    """Median seconds of a forward (and backward)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        with torch.set_grad_enabled(backward):
            out = fn(*qkv)
            if backward:
                out.sum().backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="300,700,200,848")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-compile", action="store_true", help="skip compiled flex attention")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, one repeat, no compile")
    args = parser.parse_args()
    if args.smoke:
        args.lengths, args.heads, args.dim, args.repeats = "30,70,20", 2, 16, 1
        args.no_compile = True
    lengths = [int(n) for n in args.lengths.split(",")]
    s = sum(lengths)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, args.heads, s, args.dim, requires_grad=True) for _ in range(3))
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    frozen = tuple(t.detach() for t in (q, k, v))
    reference = per_sample(*frozen, lengths)
    variants = {
        "sdpa per sample": lambda *qkv: per_sample(*qkv, lengths),
        "sdpa dense mask": lambda *qkv: dense_mask(*qkv, doc),
    }
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def document(_b, _h, qi, ki):
        return (doc[qi] == doc[ki]) & (ki <= qi)

    block_mask = create_block_mask(document, None, None, s, s, device="cpu")
    variants["flex eager"] = lambda *qkv: flex_attention(*qkv, block_mask=block_mask)
    if not args.no_compile:
        compiled = torch.compile(flex_attention)
        start = time.perf_counter()
        with torch.no_grad():
            compiled(*frozen, block_mask=block_mask)
        print(f"flex compile (first call, forward): {time.perf_counter() - start:.1f} s")
        variants["flex compiled"] = lambda *qkv: compiled(*qkv, block_mask=block_mask)
    print(f"{len(lengths)} samples, {s} tokens, {args.heads} heads x {args.dim}")
    print(f"{'':18s} {'forward':>10s} {'fwd+bwd':>10s}")
    for name, fn in variants.items():
        with torch.no_grad():
            err = (fn(*frozen) - reference).abs().max().item()
        fwd = timed(fn, frozen, repeats=args.repeats, backward=False)
        try:
            both = f"{timed(fn, (q, k, v), repeats=args.repeats, backward=True) * 1e3:7.1f} ms"
        except NotImplementedError:
            both = "no backward"
        print(f"{name:18s} {fwd * 1e3:7.1f} ms {both:>10s}  max|diff| {err:.1e}")


if __name__ == "__main__":
    main()
