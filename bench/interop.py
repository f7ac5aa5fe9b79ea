"""HF import and export at scale: time and peak host memory per rank, at tp1 and tp2.

Writes a random Llama (``--size 1b``: Llama-3.2-1B's shape with an untied head, 1.50B parameters,
bf16 safetensors in 2 GiB shards, as transformers saves it), then, in real torchrun processes
with TP = 1 and TP = 2, builds megatron's GPTModel and times ``load_llm_chunk`` (each rank reads
only its slices); then exports the TP = 1 model back to HF safetensors in one process (``omni
export`` runs in one process; a checkpoint of any layout loads into it first). Peak RSS is
``ru_maxrss`` of each rank (model build included); "import RSS" is what the import added to the
rank's resident memory.
Run: ``make bench-interop`` or ``python bench/interop.py [--size small|1b]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import tempfile
import time
from pathlib import Path

SIZES = {
    "smoke": dict(hidden=64, layers=1, heads=4, kv=2, ffn=128, vocab=256),
    "small": dict(hidden=512, layers=4, heads=8, kv=2, ffn=1408, vocab=32000),
    "1b": dict(hidden=2048, layers=16, heads=32, kv=8, ffn=8192, vocab=128256),
}


def write_random_llama(root: Path, size: dict) -> int:
    """Random bf16 tensors under Llama's names, sharded; returns the bytes written."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    h, f, hd = size["hidden"], size["ffn"], size["hidden"] // size["heads"]
    shapes = {"model.embed_tokens.weight": [size["vocab"], h], "model.norm.weight": [h]}
    for i in range(size["layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": [h],
                p + "post_attention_layernorm.weight": [h],
                p + "self_attn.q_proj.weight": [h, h],
                p + "self_attn.k_proj.weight": [size["kv"] * hd, h],
                p + "self_attn.v_proj.weight": [size["kv"] * hd, h],
                p + "self_attn.o_proj.weight": [h, h],
                p + "mlp.gate_proj.weight": [f, h],
                p + "mlp.up_proj.weight": [f, h],
                p + "mlp.down_proj.weight": [h, f],
            }
        )
    shapes["lm_head.weight"] = [size["vocab"], h]
    gen = torch.Generator().manual_seed(0)
    shard, shard_bytes, total, weight_map, files = {}, 0, 0, {}, []

    def flush() -> None:
        name = f"part-{len(files)}.safetensors"
        save_file(shard, root / name, metadata={"format": "pt"})
        files.append((name, list(shard)))

    for name, shape in shapes.items():
        t = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        if shard and shard_bytes + t.numel() * 2 > 2 << 30:
            flush()
            shard, shard_bytes = {}, 0
        shard[name] = t
        shard_bytes += t.numel() * 2
        total += t.numel() * 2
    flush()
    for i, (name, keys) in enumerate(files):
        final = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        os.replace(root / name, root / final)
        weight_map.update(dict.fromkeys(keys, final))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    config = LlamaConfig(
        vocab_size=size["vocab"],
        hidden_size=size["hidden"],
        intermediate_size=size["ffn"],
        num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"],
        num_key_value_heads=size["kv"],
        architectures=["LlamaForCausalLM"],
    ).to_dict()
    config["dtype"] = "bfloat16"
    (root / "config.json").write_text(json.dumps(config))
    return total


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _text_job(model: str):
    """The trainer config of a text-only job around the HF model (what ``omni export`` reads)."""
    from omni_trainer.config import parse_manifest

    source = {"kind": "synthetic", "name": "text", "modality": "text", "preset": "longtext"}
    doc = {
        "apiVersion": "omni.megascale.io/v1alpha1",
        "kind": "OmniTrainingJob",
        "metadata": {"name": "bench-interop"},
        "spec": {
            "trainer": {
                "model": {"llm": {"hf": model}},
                "data": {
                    "seqLength": 128,
                    "globalBatchSize": 1,
                    "microBatchSize": 1,
                    "sources": [source],
                },
            }
        },
    }
    return parse_manifest(doc).spec.trainer


def worker(model: str, out: Path, export_dir: str | None) -> None:
    """One torchrun rank: build the TP shard, import it, report; rank 0 of a world of one also
    exports."""
    import torch.distributed as dist

    from omni_trainer.distributed.config import ParallelDims
    from omni_trainer.interop.llm import load_llm_chunk
    from omni_trainer.mcore.parallel import build_process_groups, init_distributed
    from omni_trainer.models.config import LLMConfig
    from omni_trainer.models.llm import build_gpt

    rank, world, device = init_distributed()
    build_process_groups(ParallelDims(world_size=world, tp=world), device)
    cfg = LLMConfig(hf=model)
    chunk = build_gpt(cfg, max_sequence_length=128)
    dist.barrier()
    before, t0 = _rss(), time.perf_counter()
    load_llm_chunk(chunk, cfg, tp_rank=rank, tp_size=world)
    result = {
        "rank": rank,
        "import_s": time.perf_counter() - t0,
        "import_rss_gib": (_rss() - before) / 2**30,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }
    if export_dir is not None:
        from types import SimpleNamespace

        from omni_trainer.interop.export import write_hf

        job = _text_job(model)
        t0 = time.perf_counter()
        written = write_hf(SimpleNamespace(llm_chunks=[chunk]), job, Path(export_dir), step=None)
        result.update(
            export_s=time.perf_counter() - t0,
            export_gib=written.bytes / 2**30,
            export_peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        )
    (out / f"rank{rank}-of-{world}.json").write_text(json.dumps(result))
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="1b")
    parser.add_argument("--smoke", action="store_true", help="--size smoke: one tiny layer")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.size = "smoke"
    if args.worker:
        model, out, export_dir = args.worker
        worker(model, Path(out), None if export_dir == "-" else export_dir)
        return
    from omni_trainer.launch import torchrun_argv

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = root / "hf"
        model.mkdir()
        t0 = time.perf_counter()
        size = write_random_llama(model, SIZES[args.size])
        print(f"random {args.size} Llama: {size / 2**30:.2f} GiB bf16 written in "
              f"{time.perf_counter() - t0:.1f} s")  # fmt: skip
        for tp in (1, 2):
            export = str(root / "export") if tp == 1 else "-"
            cmd = [*torchrun_argv(tp), __file__, "--worker", str(model), tmp, export]
            subprocess.run(cmd, check=True, env={**os.environ, "OMNI_NUM_THREADS": "1"})
        print(f"{'layout':8s} {'rank':>4s} {'import s':>9s} {'import RSS GiB':>15s} "
              f"{'peak RSS GiB':>13s}")  # fmt: skip
        for tp in (1, 2):
            for rank in range(tp):
                r = json.loads((root / f"rank{rank}-of-{tp}.json").read_text())
                print(f"tp{tp:<6d} {rank:4d} {r['import_s']:9.1f} {r['import_rss_gib']:15.2f} "
                      f"{r['peak_rss_gib']:13.2f}")  # fmt: skip
        r = json.loads((root / "rank0-of-1.json").read_text())
        print(f"export (one process, fp32 params -> {r['export_gib']:.2f} GiB safetensors): "
              f"{r['export_s']:.1f} s, peak RSS {r['export_peak_rss_gib']:.2f} GiB")  # fmt: skip


if __name__ == "__main__":
    main()
