"""The GPU path on one GPU, in under 8 minutes: what CPU tests cannot prove.

    python bench/gpu_check.py --out $OUT          # one GPU (an H200 takes about 3-5 minutes)
    python bench/gpu_check.py --cpu-smoke --out /tmp/check   # CI: tiny shapes, no GPU

Parts, each in its own try/except, the JSON rewritten after each (a killed run keeps what ran):

0. ``encoder_varlen``: the encoders' attention core on packed ViT-L images, the one-launch
   varlen kernel (flash-attn's or PyTorch's) against per-sample SDPA in bf16, outputs and
   gradients, both timed.
a. ``te_vs_local``: megatron's TE layer spec against the local spec on the same packed batch
   (samples of several lengths as THD boundaries) and the same weights (name-seeded, canonical
   names): logits and every parameter's gradient, in fp32 and bf16, against stated tolerances.
b. ``train``: ``omni train`` of a ~1.1B LLM (TinyLlama's shape) + ViT-L/14 at 8K sequence, bf16,
   a few steps on synthetic data with the paper's lengths: tokens/s, MFU (LLM + encoder FLOPs, the
   trainer's own accounting), step breakdown and memory from the run summary.
c. ``checkpoint``: a checkpoint saved from the local spec loads into the TE spec and back, and
   from bf16 into fp32: weights equal exactly, logits of the loaded model equal its source's.
d. ``warm``: in-place restarts fork the trainer from a pre-imported zygote (``omni_trainer.warm``),
   safe only if importing the trainer (TransformerEngine included) initialised no CUDA: whether
   the zygote forks or declines here, and a tiny bf16 run forked from it beside the same run
   cold (exit codes, wall times, losses equal).
e. ``layouts``: one rank of tp2 + sequence parallel, pp2 and dp8 + distributed optimizer (world
   8, a 7B LLM at 4K) through PyTorch's fake process group (``bench/fake_layouts.py``): build,
   two steps, one checkpoint save and its load, each phase's peak memory beside the planner's
   prediction for that rank. The trainer takes TE's layer spec where TE works, the local one
   elsewhere.

GPU-only parts report ``skipped`` with the reason where CUDA or TransformerEngine is missing; with
``--cpu-smoke`` every part runs what the CPU can at tiny shapes (local spec on both sides of (a)
and (c), a 2-step bf16 training run) so CI keeps the script working. ``--budget-s`` bounds the
whole run: a part that would not fit is skipped, the training run's timeout is what is left.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")  # fp32 comparisons in true fp32 (before CUDA)

import numpy as np
import torch
import yaml

# Tolerances, as relative errors ||a - b|| / ||b|| per tensor (the worst tensor is reported).
# fp32: kernels differ only in summation order (TE's fused/flash attention vs SDPA, fused RoPE).
# bf16: 8 mantissa bits; TE and the local spec round at different points (fused norm + GEMM).
# bf16 also passes when TE's error against the fp32 local run is at most BF16_NO_WORSE times the
# local spec's own bf16 error against it (TE is no less accurate than the spec CPU tests prove).
TOLERANCE = {
    "float32": {"logits": 1e-4, "grads": 1e-3},
    "bfloat16": {"logits": 2e-2, "grads": 5e-2},
}
BF16_NO_WORSE = 2.0
TINY_LLAMA = {  # ~1.1B parameters (TinyLlama-1.1B's shape), our LLM config's camelCase fields
    "numLayers": 22,
    "hiddenSize": 2048,
    "numAttentionHeads": 32,
    "numQueryGroups": 4,
    "ffnHiddenSize": 5632,
    "vocabSize": 32000,
    "gatedMlp": True,
    "normalization": "RMSNorm",
}


@dataclass(frozen=True)
class Shapes:
    """What each part runs at: the GPU's sizes, or tiny ones for the CPU smoke run."""

    compare_llm: dict  # LLMConfig fields of the model compared in (a) and (c)
    sample_lengths: tuple[int, ...]  # the packed batch of (a) and (c)
    train_llm: dict
    image_preset: str
    seq_length: int
    global_batch: int
    steps: int
    length_scale: float  # synthetic sources' lengths (1.0: the paper's)
    image_tokens: tuple[int, ...]  # images packed for the encoder attention comparison
    encoder_heads: tuple[int, int]  # (heads, head dim) of that attention


GPU = Shapes(
    compare_llm={**TINY_LLAMA, "numLayers": 4},
    sample_lengths=(1500, 700, 2100, 37, 3800),
    train_llm=TINY_LLAMA,
    image_preset="vit-l-14",
    seq_length=8192,
    global_batch=4,
    steps=8,
    length_scale=1.0,
    image_tokens=(576, 1024, 256, 2304, 49),  # ViT-L/14 grids of several image sizes
    encoder_heads=(16, 64),
)
CPU_SMOKE = Shapes(
    compare_llm={"preset": "tiny"},
    sample_lengths=(9, 17, 4, 30),
    train_llm={"preset": "tiny"},
    image_preset="vit-tiny",
    seq_length=256,
    global_batch=2,
    steps=2,
    length_scale=0.02,
    image_tokens=(9, 16, 4),
    encoder_heads=(2, 8),
)


@dataclass
class Report:
    """The JSON written to ``path`` after every part."""

    path: Path
    deadline: float
    data: dict = field(default_factory=dict)

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str))
        tmp.replace(self.path)

    def run(self, name: str, fn: Callable[[], dict], *, need_s: float, cap_s: float) -> None:
        """Run one part: ok / mismatch / failed (with the traceback) / skipped (with why).
        It starts only with ``need_s`` left and is stopped after ``cap_s`` (or the budget)."""
        parts = self.data.setdefault("parts", {})
        left = self.remaining()
        if left < need_s:
            parts[name] = {"status": "skipped", "reason": f"time budget: {left:.0f} s left"}
            print(f"[gpu_check] {name}: skipped ({left:.0f} s left, needs ~{need_s:.0f})")
            self.write()
            return
        print(f"[gpu_check] {name}: running ({left:.0f} s left)", flush=True)
        start = time.monotonic()
        previous = signal.signal(signal.SIGALRM, _on_alarm)
        signal.alarm(max(1, int(min(cap_s, left - 5))))  # an in-process hang ends the part too
        try:
            result = fn()
            status = "mismatch" if result.pop("mismatch", False) else "ok"
            parts[name] = {"status": status, **result}
        except _Skip as why:
            parts[name] = {"status": "skipped", "reason": str(why)}
        except BaseException as err:  # every failure is a result here
            if isinstance(err, KeyboardInterrupt):
                raise
            parts[name] = {
                "status": "failed",
                "error": f"{type(err).__name__}: {err}",
                "traceback": traceback.format_exc()[-4000:],
            }
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        parts[name]["seconds"] = round(time.monotonic() - start, 1)
        print(f"[gpu_check] {name}: {parts[name]['status']} in {parts[name]['seconds']} s")
        self.write()


class _Skip(Exception):
    """A part (or one side of it) that cannot run here, with the reason."""


def _on_alarm(signum, frame) -> None:
    raise TimeoutError("the part ran past the time budget")


# -- environment ------------------------------------------------------------------------------


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict:
    from omni_trainer.models.encoders.layers import gpu_varlen_kernel
    from omni_trainer.models.llm import transformer_engine_usable

    env = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "megatron_core": _version("megatron-core"),
        "transformer_engine": _version("transformer_engine") or _version("transformer-engine"),
        "flash_attn": _version("flash_attn") or _version("flash-attn"),
        "te_usable": transformer_engine_usable(),
        "encoder_varlen_kernel": getattr(gpu_varlen_kernel(), "__name__", "sdpa per sample"),
        "device": "cpu",
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["device"] = props.name
        env["capability"] = f"{props.major}.{props.minor}"
        env["memory_gib"] = round(props.total_memory / 2**30, 1)
    return env


def single_rank() -> torch.device:
    """A world of one with megatron's parallel state (gloo on CPU, NCCL + gloo on a GPU)."""
    from omni_trainer.distributed.config import ParallelDims
    from omni_trainer.mcore.parallel import build_process_groups, init_distributed, seed_everything

    _, world, device = init_distributed()
    build_process_groups(ParallelDims(world_size=world), device)
    seed_everything(0)
    return device


def specs_to_compare(smoke: bool) -> tuple[str, str, str | None]:
    """(reference spec, compared spec, why TE is not compared): TE where it works; else the
    local spec on both sides: in the CPU smoke run (the harness runs; the difference must be 0)
    and on a GPU without TE (see :func:`per_sample_reference`)."""
    from omni_trainer.models.llm import transformer_engine_usable

    if transformer_engine_usable():
        return "local", "te", None
    if not torch.cuda.is_available() and not smoke:
        raise _Skip("no CUDA: the GPU specs cannot be compared (--cpu-smoke runs the harness)")
    why = "no CUDA" if not torch.cuda.is_available() else "TransformerEngine does not import"
    return "local", "local", f"{why}: local spec on both sides"


@contextlib.contextmanager
def per_sample_attention(enabled: bool):
    """The local spec's packed attention as the CPU runs it (causal SDPA per sample) instead of
    the GPU's one-launch varlen kernel: the reference a GPU without TE is checked against."""
    from omni_trainer.models import packed

    if not enabled:
        yield
        return
    kernel = packed.gpu_varlen_kernel
    packed.gpu_varlen_kernel = lambda: None
    try:
        yield
    finally:
        packed.gpu_varlen_kernel = kernel


# -- the models and the packed batch ----------------------------------------------------------


def build_llm(llm: dict, *, spec: str, dtype: torch.dtype, seed: int, device: torch.device):
    """One GPTModel with name-seeded weights (equal across specs: canonical names)."""
    from omni_trainer.models.config import LLMConfig
    from omni_trainer.models.llm import LLMRuntime, build_gpt_chunks

    cfg = LLMConfig.model_validate(llm)
    runtime = LLMRuntime(params_dtype=dtype, layer_spec=spec)
    (chunk,) = build_gpt_chunks(cfg, max_sequence_length=8192, seed=seed, runtime=runtime)
    return chunk.to(device), cfg


def packed_batch(lengths: tuple[int, ...], vocab: int, device: torch.device) -> dict:
    """One packed row of samples of these lengths: THD boundaries, positions per sample."""
    from omni_trainer.models.packed import pack_boundaries

    gen = np.random.default_rng(0)
    segment_ids = np.repeat(np.arange(len(lengths)), lengths)[None]
    tokens = torch.as_tensor(gen.integers(0, vocab, (1, sum(lengths))), device=device)
    positions = np.concatenate([np.arange(n) for n in lengths])[None]
    return {
        "input_ids": tokens,
        "position_ids": torch.as_tensor(positions, device=device),
        "labels": torch.roll(tokens, -1, dims=1),
        "packed_seq_params": pack_boundaries(segment_ids, device),
    }


def forward_backward(model, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor], float]:
    """Logits (fp32, on the host), every parameter's gradient by canonical name, the loss."""
    from omni_trainer.models.init import global_llm_names

    common = {k: batch[k] for k in ("input_ids", "position_ids", "packed_seq_params")}
    with torch.no_grad():
        logits = model(**common, attention_mask=None).float().cpu()
    model.zero_grad(set_to_none=True)
    loss = model(**common, attention_mask=None, labels=batch["labels"]).float().mean()
    loss.backward()
    grads = {
        n: p.grad.float().cpu() for n, p in global_llm_names(model).items() if p.grad is not None
    }
    return logits, grads, loss.item()


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def compare(a: tuple, b: tuple, tol: dict) -> dict:
    """Relative errors of (logits, grads, loss) of ``a`` against the reference ``b``."""
    (la, ga, lossa), (lb, gb, lossb) = a, b
    if ga.keys() != gb.keys():
        raise AssertionError(f"gradients differ in names: {sorted(ga.keys() ^ gb.keys())[:6]}")
    errors = {n: rel_error(ga[n], gb[n]) for n in gb}
    worst = max(errors, key=errors.get)
    out = {
        "logits_rel_error": rel_error(la, lb),
        "grads_worst_rel_error": errors[worst],
        "grads_worst_param": worst,
        "grads_median_rel_error": float(np.median(list(errors.values()))),
        "loss": [lossa, lossb],
        "tolerance": tol,
    }
    out["within_tolerance"] = (
        out["logits_rel_error"] <= tol["logits"] and out["grads_worst_rel_error"] <= tol["grads"]
    )
    return out


# -- parts ------------------------------------------------------------------------------------


def attempt(name: str, fn: Callable[[], dict]) -> dict:
    """One comparison of a part: its result, or its error (the part's other comparisons run)."""
    try:
        result = fn()
    except TimeoutError:
        raise
    except Exception as err:  # recorded, not raised
        result = {
            "error": f"{type(err).__name__}: {err}",
            "traceback": traceback.format_exc()[-3000:],
        }
        result["within_tolerance"] = False
    print(f"[gpu_check]   {name}: { {k: v for k, v in result.items() if k != 'traceback'} }")
    return result


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def part_te_vs_local(shapes: Shapes, smoke: bool) -> dict:
    """fp32: TE against local within TOLERANCE; bf16: likewise, or TE's error against the
    fp32 local run at most BF16_NO_WORSE times the local bf16 run's."""
    from omni_trainer.models.init import global_llm_names

    ref_spec, spec, note = specs_to_compare(smoke)
    device = single_rank()
    per_sample = spec == ref_spec == "local" and device.type == "cuda"
    out: dict = {"specs": [spec, ref_spec], "sample_lengths": list(shapes.sample_lengths)}
    if per_sample:
        out["reference"] = "local spec, causal SDPA per sample (the CPU path)"
    if note:
        out["note"] = note
    fp32_ref: list[tuple] = []  # the fp32 local run, once it ran

    def run(spec_name: str, dtype: torch.dtype, *, reference: bool) -> tuple:
        model, cfg = build_llm(
            shapes.compare_llm, spec=spec_name, dtype=dtype, seed=1, device=device
        )
        batch = packed_batch(shapes.sample_lengths, cfg.vocab_size, device)
        with per_sample_attention(reference and per_sample):
            return forward_backward(model, batch), global_llm_names(model)

    def one(dtype: torch.dtype) -> dict:
        expected, ref_names = run(ref_spec, dtype, reference=True)
        got, names = run(spec, dtype, reference=False)
        if names.keys() != ref_names.keys() or not all(
            torch.equal(names[n], ref_names[n]) for n in ref_names
        ):
            raise AssertionError("the two specs did not build the same name-seeded weights")
        tol = TOLERANCE[dtype_name(dtype)]
        result = compare(got, expected, tol)
        if dtype == torch.float32:
            fp32_ref.append(expected)
        elif fp32_ref:  # bf16: each spec against the fp32 local run
            vs_ref = [compare(r, fp32_ref[0], tol) for r in (expected, got)]
            keys = ("logits_rel_error", "grads_median_rel_error")
            result["vs_fp32_local"] = {s: {k: r[k] for k in keys} for s, r in zip(
                ("local", "te"), vs_ref, strict=True)}  # fmt: skip
            no_worse = all(vs_ref[1][k] <= BF16_NO_WORSE * max(vs_ref[0][k], 1e-6) for k in keys)
            result["within_tolerance"] = result["within_tolerance"] or no_worse
        return result

    for dtype in (torch.float32, torch.bfloat16):
        out[dtype_name(dtype)] = attempt(dtype_name(dtype), lambda d=dtype: one(d))
    out["mismatch"] = not all(out[d]["within_tolerance"] for d in ("float32", "bfloat16"))
    return out


def _timed_ms(fn: Callable[[], torch.Tensor], repeat: int = 5) -> float:
    fn()  # warm-up
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeat * 1e3


def part_encoder_varlen(shapes: Shapes) -> dict:
    """The encoders' attention core on packed images: the one-launch varlen kernel (bf16)
    against per-sample SDPA (the CPU-proven path), outputs and q/k/v gradients, and both
    timed forward + backward."""
    from omni_trainer.models.encoders.layers import (
        Varlen,
        gpu_varlen_kernel,
        sdpa_varlen,
        varlen_attention,
    )

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kernel = gpu_varlen_kernel()
    seqs = Varlen.of(shapes.image_tokens)
    heads, dim = shapes.encoder_heads
    gen = torch.Generator(device=device).manual_seed(0)
    qkv = [
        torch.randn(seqs.total, heads, dim, generator=gen, device=device, dtype=dtype)
        for _ in range(3)
    ]

    def run(core) -> tuple[torch.Tensor, list[torch.Tensor]]:
        leaves = [t.detach().requires_grad_() for t in qkv]
        out = core(*leaves, seqs)
        out.float().square().sum().backward()
        return out.detach().float(), [t.grad.float() for t in leaves]

    (out, grads), (ref, ref_grads) = run(varlen_attention), run(sdpa_varlen)
    tol = TOLERANCE[dtype_name(dtype)]
    result = {
        "kernel": getattr(kernel, "__name__", None) or "none: sdpa per sample on both sides",
        "tokens": list(shapes.image_tokens),
        "dtype": dtype_name(dtype),
        "out_rel_error": rel_error(out, ref),
        "grads_worst_rel_error": max(
            rel_error(g, r) for g, r in zip(grads, ref_grads, strict=True)
        ),
        "tolerance": tol,
        "kernel_fwd_bwd_ms": _timed_ms(lambda: run(varlen_attention)[0]),
        "sdpa_fwd_bwd_ms": _timed_ms(lambda: run(sdpa_varlen)[0]),
    }
    result["mismatch"] = not (
        result["out_rel_error"] <= tol["logits"] and result["grads_worst_rel_error"] <= tol["grads"]
    )
    print(f"[gpu_check]   {result}", flush=True)
    return result


def _save_then_load(tmp: Path, src, dst) -> None:
    from omni_trainer.checkpoint.checkpointer import Checkpointer
    from omni_trainer.checkpoint.config import CheckpointConfig
    from omni_trainer.checkpoint.state import ModelState
    from omni_trainer.models.init import global_llm_names

    def state(model) -> ModelState:
        params = global_llm_names(model)
        opt = torch.optim.AdamW(params.values(), lr=1e-4)
        return ModelState(llm=params, replicated={}, optimizer=opt)

    config = CheckpointConfig(path=str(tmp), async_save=False)
    saver = Checkpointer(config)
    saver.save(1, state(src), None)
    if not saver.close().committed:
        raise RuntimeError(f"the checkpoint in {tmp} did not commit")
    Checkpointer(config).load_latest(state(dst))


def part_checkpoint(shapes: Shapes, smoke: bool, tmp: Path) -> dict:
    """local -> other spec (fp32), other -> local (fp32), local bf16 -> other fp32."""
    from omni_trainer.models.init import global_llm_names

    local, other, note = specs_to_compare(smoke)
    device = single_rank()
    out: dict = {"specs": [local, other]}
    if note:
        out["note"] = note
    trips = [
        ("local_to_other", local, torch.float32, other, torch.float32),
        ("other_to_local", other, torch.float32, local, torch.float32),
        ("local_bf16_to_other_fp32", local, torch.bfloat16, other, torch.float32),
    ]

    def one(i: int, name: str, src_spec, src_dtype, dst_spec, dst_dtype) -> dict:
        llm = shapes.compare_llm
        src, cfg = build_llm(llm, spec=src_spec, dtype=src_dtype, seed=10 + i, device=device)
        dst, _ = build_llm(llm, spec=dst_spec, dtype=dst_dtype, seed=20 + i, device=device)
        _save_then_load(tmp / name, src, dst)
        a, b = global_llm_names(src), global_llm_names(dst)
        unequal = [n for n in a if not torch.equal(a[n].to(dst_dtype), b[n])]
        batch = packed_batch(shapes.sample_lengths, cfg.vocab_size, device)
        logits = rel_error(forward_backward(dst, batch)[0], forward_backward(src, batch)[0])
        tol = TOLERANCE[dtype_name(src_dtype)]["logits"]
        return {
            "params": len(a),
            "params_not_equal": unequal[:8],
            "logits_rel_error": logits,
            "logits_tolerance": tol,
            "within_tolerance": not unequal and logits <= tol,
        }

    for i, trip in enumerate(trips):
        out[trip[0]] = attempt(trip[0], lambda i=i, t=trip: one(i, *t))
    out["mismatch"] = not all(out[t[0]]["within_tolerance"] for t in trips)
    return out


def _synthetic(preset: str, modality: str, scale: float) -> dict:
    return {"kind": "synthetic", "name": preset, "modality": modality, "preset": preset,
            "lengthScale": scale}  # fmt: skip


def training_manifest(shapes: Shapes, tmp: Path, recompute: str = "none") -> dict:
    scale = shapes.length_scale
    return {
        "apiVersion": "omni.megascale.io/v1alpha1",
        "kind": "OmniTrainingJob",
        "metadata": {"name": "gpu-check"},
        "spec": {
            "nodes": 1,
            "gpusPerNode": 1 if torch.cuda.is_available() else 0,
            "trainer": {
                "seed": 0,
                "model": {
                    "llm": shapes.train_llm,
                    "encoders": {"image": {"preset": shapes.image_preset}},
                },
                "data": {
                    "seqLength": shapes.seq_length,
                    "globalBatchSize": shapes.global_batch,
                    "microBatchSize": 1,
                    "sources": [
                        _synthetic("openimages", "image", scale),
                        _synthetic("longtext", "text", scale),
                    ],
                    "mixture": [{"atTokens": 0, "weights": {"image": 1, "text": 1}}],
                },
                "optimizer": {"lr": 1e-4, "minLr": 1e-5, "weightDecay": 0.1, "clipGrad": 1.0},
                "train": {
                    "steps": shapes.steps,
                    "precision": "bf16",
                    "recompute": recompute,
                    "stepLog": str(tmp / "steps.jsonl"),
                },
            },
        },
    }


def part_train(
    shapes: Shapes, smoke: bool, tmp: Path, report: Report, recompute: str = "none"
) -> dict:
    if not torch.cuda.is_available() and not smoke:
        raise _Skip("no CUDA: the ~1B + ViT-L run needs a GPU (--cpu-smoke runs a tiny one)")
    tmp.mkdir(parents=True, exist_ok=True)
    manifest, summary = tmp / "job.yaml", tmp / "summary.json"
    manifest.write_text(yaml.safe_dump(training_manifest(shapes, tmp, recompute), sort_keys=False))
    timeout = max(30.0, report.remaining() - 15)
    cmd = [sys.executable, "-m", "omni_trainer.cli", "train", str(manifest)]
    cmd += ["--summary", str(summary)]
    out: dict = {"command": " ".join(cmd[1:]), "timeout_s": round(timeout)}
    try:
        env = {k: v for k, v in os.environ.items() if k != "NVIDIA_TF32_OVERRIDE"}  # as in prod
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, check=False, env=env
        )
        out["returncode"], log = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        out["returncode"], log = "timeout", f"{err.stdout or ''}{err.stderr or ''}"
    steps_file = tmp / "steps.jsonl"
    if steps_file.exists():
        out["steps"] = [json.loads(line) for line in steps_file.read_text().splitlines()]
    if out["returncode"] != 0 or not summary.exists():
        out["log_tail"] = log[-4000:] if isinstance(log, str) else str(log)[-4000:]
        raise RuntimeError(f"omni train ended with {out['returncode']}: {json.dumps(out)[-6000:]}")
    s = json.loads(summary.read_text())
    keys = ("tokens_per_second", "mfu", "peak_flops", "peak_flops_source", "mean_step_time_s",
            "parameters", "memory", "initial_loss", "final_loss", "tokens_per_second_curve",
            "mfu_curve", "mfu_convention", "step_time_curve", "samples_per_modality",
            "wall_time_s")  # fmt: skip
    out.update({k: s.get(k) for k in keys})
    out["phases_s"] = {k: v for k, v in s["breakdown"][0].items() if k.endswith("_s")}
    print(
        f"[gpu_check]   {out['tokens_per_second']:,.0f} tokens/s, MFU {out['mfu']:.1%} "
        f"({out['peak_flops_source']}), {out['mean_step_time_s']:.2f} s/step",
        flush=True,
    )
    return out


def part_layouts(smoke: bool, tmp: Path) -> dict:
    """Single ranks of multi-GPU layouts in a fake world (tiny shapes in the CPU smoke run)."""
    from fake_layouts import CPU_LAYOUTS, GPU_LAYOUTS
    from fake_layouts import part_layouts as run_layouts

    if not torch.cuda.is_available() and not smoke:
        raise _Skip("no CUDA: the 7B layouts need a GPU (--cpu-smoke runs them tiny)")
    return run_layouts(CPU_LAYOUTS if smoke else GPU_LAYOUTS, tmp)


def _run_tiny(manifest: Path, *, env: dict, timeout: float) -> tuple[int, float, str]:
    start = time.monotonic()
    cmd = [sys.executable, "-m", "omni_trainer.warm", "train", str(manifest)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    return proc.returncode, time.monotonic() - start, proc.stdout + proc.stderr


def part_warm(tmp: Path) -> dict:
    """The zygote on this machine: forks, or declines (and why); a forked run beside a cold one."""
    from omni_trainer.warm import DECLINED, SOCKET_ENV

    tmp.mkdir(parents=True, exist_ok=True)
    sock, log = tmp / "warm.sock", tmp / "zygote.log"
    env = {k: v for k, v in os.environ.items() if k != "NVIDIA_TF32_OVERRIDE"}
    runs = {}
    for name in ("cold", "warm"):
        (tmp / name).mkdir(exist_ok=True)
        doc = training_manifest(CPU_SMOKE, tmp / name)
        doc["spec"]["trainer"]["train"]["steps"] = 3
        (tmp / name / "job.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    with log.open("wb") as out:
        zygote = subprocess.Popen([sys.executable, "-m", "omni_trainer.warm", "--zygote",
                                   str(sock)], stdout=out, stderr=subprocess.STDOUT,
                                  env=env)  # fmt: skip
    try:
        t0 = time.monotonic()
        while not sock.exists() and zygote.poll() is None and time.monotonic() - t0 < 30:
            time.sleep(0.05)
        code, wall, text = _run_tiny(tmp / "cold/job.yaml", env=env, timeout=120)
        runs["cold"] = {"returncode": code, "wall_s": round(wall, 2), "tail": text[-1500:]}
        code, wall, text = _run_tiny(tmp / "warm/job.yaml", env={**env, SOCKET_ENV: str(sock)},
                                     timeout=120)  # fmt: skip
        runs["warm"] = {"returncode": code, "wall_s": round(wall, 2), "tail": text[-1500:]}
    finally:
        if zygote.poll() is None:
            zygote.kill()
        zygote.wait()
    zlog = log.read_text(errors="replace")
    out = {"declined": zygote.returncode == DECLINED, "forked": "omni warm: forked" in zlog,
           "zygote_log": "\n".join(x for x in zlog.splitlines() if "omni warm" in x)[-1500:],
           **runs}  # fmt: skip
    losses = {}
    for name in ("cold", "warm"):
        steps = tmp / name / "steps.jsonl"
        if steps.exists():
            losses[name] = [json.loads(x)["loss"] for x in steps.read_text().splitlines()]
    out["losses_equal"] = bool(losses) and losses.get("cold") == losses.get("warm")
    if runs["warm"]["returncode"] != 0 or runs["cold"]["returncode"] != 0:
        raise RuntimeError(json.dumps(out)[-6000:])
    print(f"[gpu_check]   zygote {'declined' if out['declined'] else 'forked'}: warm "
          f"{runs['warm']['wall_s']} s, cold {runs['cold']['wall_s']} s", flush=True)  # fmt: skip
    return out


# -- main -------------------------------------------------------------------------------------


def output_path(out: str | None) -> Path:
    """--out (a .json file, or a folder for gpu_check.json), else $OUT, else ./gpu_check.json."""
    target = Path(out or os.environ.get("OUT") or ".")
    return target if target.suffix == ".json" else target / "gpu_check.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="JSON file or folder (default: $OUT, else .)")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, CPU-capable parts")
    parser.add_argument("--budget-s", type=float, default=450.0, help="whole-run time budget")
    parser.add_argument(
        "--parts",
        default="encoder_varlen,te_vs_local,checkpoint,layouts,train,warm",
        help="comma-separated; train:selective / train:full run the training part with that "
        "train.recompute (LLM and encoders)",
    )
    args = parser.parse_args(argv)
    shapes = CPU_SMOKE if args.cpu_smoke else GPU
    report = Report(output_path(args.out), deadline=time.monotonic() + args.budget_s)
    report.data.update(mode="cpu-smoke" if args.cpu_smoke else "gpu", budget_s=args.budget_s)
    report.data["environment"] = environment()
    print(f"[gpu_check] {json.dumps(report.data['environment'])}", flush=True)
    if not torch.cuda.is_available() and not args.cpu_smoke:
        report.data["note"] = "no CUDA device: GPU parts are skipped (use --cpu-smoke on CPU)"
    wanted = args.parts.split(",")
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as scratch:
        tmp = Path(scratch)
        runs = {  # (part, seconds it needs to start, seconds it may take at most)
            "encoder_varlen": (lambda: part_encoder_varlen(shapes), 20, 60),
            "te_vs_local": (lambda: part_te_vs_local(shapes, args.cpu_smoke), 60, 150),
            "checkpoint": (lambda: part_checkpoint(shapes, args.cpu_smoke, tmp / "ckpt"), 60, 120),
            "layouts": (lambda: part_layouts(args.cpu_smoke, tmp / "layouts"), 100, 200),
            "warm": (lambda: part_warm(tmp / "warm"), 40, 150),
        }
        for mode in ("none", "selective", "full"):
            runs["train" if mode == "none" else f"train:{mode}"] = (
                lambda m=mode: part_train(shapes, args.cpu_smoke, tmp / f"train-{m}", report, m),
                90,
                1e9,
            )
        for name in wanted:
            if name not in runs:
                parser.error(f"--parts: no part {name!r} (parts: {', '.join(runs)})")
            fn, need_s, cap_s = runs[name]
            if args.cpu_smoke:  # tiny shapes on a loaded CI machine: only the budget bounds
                need_s, cap_s = 5, 1e9
            report.run(name, fn, need_s=need_s, cap_s=cap_s)
    statuses = {n: p["status"] for n, p in report.data["parts"].items()}
    report.data["ok"] = all(s in ("ok", "skipped") for s in statuses.values())
    report.write()
    print(f"[gpu_check] {statuses} -> {report.path}")
    return 0 if report.data["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
