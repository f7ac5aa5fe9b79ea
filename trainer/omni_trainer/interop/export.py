"""``omni export``: the model back in its Hugging Face family, tensor by tensor.

The LLM is written in the family it came from (``model.llm.hf``'s config.json, updated to the
exported dtype) or, for presets, as a Llama; a whole Qwen2.5-VL's tower too. The output appears
atomically: everything is written into a hidden sibling directory that is renamed to ``--out``
only once complete, so a failure never leaves a half-written model where transformers would load
it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from omni_trainer.config import TrainerConfig
from omni_trainer.interop import qwen2_5_vl
from omni_trainer.interop.llm import split_full, tensor_map
from omni_trainer.interop.source import HFModelError
from omni_trainer.models.config import LLMConfig

# Files that travel with a model: tokenizer, chat template, generation and processor settings.
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "generation_config.json",
    "preprocessor_config.json",
    "processor_config.json",
)
SHARD_BYTES = 2 << 30


@dataclass
class ExportResult:
    out: Path
    step: int | None
    tensors: int
    bytes: int
    files: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    """Parts of the model no HF family here can hold (our own encoders and projectors)."""


def llama_config(cfg: LLMConfig, dtype: torch.dtype) -> dict:
    """A Llama config.json for a preset LLM (only SwiGLU + RMSNorm presets are Llamas)."""
    if not cfg.gated_mlp or cfg.normalization != "RMSNorm" or cfg.qkv_bias:
        raise HFModelError(
            "export: only Llama-shaped LLMs (gatedMlp, RMSNorm, no QKV bias) can be written as "
            f"LlamaForCausalLM; this one has gatedMlp={cfg.gated_mlp}, "
            f"normalization={cfg.normalization}, qkvBias={cfg.qkv_bias}"
        )
    from transformers import LlamaConfig

    rope: dict = {"rope_type": "default", "rope_theta": cfg.rotary_base}
    if cfg.rope_scaling is not None:
        rope = {**cfg.rope_scaling.model_dump(exclude={"type"}), **rope}
        rope["rope_type"] = cfg.rope_scaling.type
    config = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups,
        rms_norm_eps=cfg.norm_epsilon,
        rope_parameters=rope,
        tie_word_embeddings=cfg.tie_embeddings,
        architectures=["LlamaForCausalLM"],
    )
    config.dtype = dtype
    return config.to_dict()


class _ShardWriter:
    """Safetensors shards of at most ``limit`` bytes, flushed as they fill."""

    def __init__(self, root: Path, limit: int) -> None:
        self.root, self.limit = root, limit
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []
        self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.limit:
            self._flush()
        self.pending[name] = tensor.detach().contiguous().cpu()
        self.pending_bytes += size
        self.total += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        save_file(self.pending, self.root / f"part-{len(self.shards)}", metadata={"format": "pt"})
        self.shards.append(sorted(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Name the shards as transformers does and write the index when there are several."""
        if self.pending or not self.shards:
            self._flush()
        n = len(self.shards)
        if n == 1:
            os.replace(self.root / "part-0", self.root / "model.safetensors")
            return ["model.safetensors"]
        names, weight_map = [], {}
        for i, keys in enumerate(self.shards):
            name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.root / f"part-{i}", self.root / name)
            names.append(name)
            weight_map.update(dict.fromkeys(keys, name))
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        (self.root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        return [*names, "model.safetensors.index.json"]


def check_export(cfg: TrainerConfig, out: Path) -> dict:
    """The config.json to write, and the checks that need no model: run them before building
    one (a GPT-shaped preset is refused before its weights are allocated)."""
    from omni_trainer.interop.source import read_config

    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"--out {out}: exists and is not empty (choose a new directory)")
    llm = cfg.model.llm
    # Parameters are fp32 in this trainer (bf16 is autocast), so that is what is exported.
    config = read_config(llm.hf) if llm.hf else llama_config(llm, torch.float32)
    config["dtype"] = "float32"
    return config


def write_hf(
    model, cfg: TrainerConfig, out: Path, *, step: int | None, shard_bytes: int | None = None
) -> ExportResult:
    """Write ``model`` (a TP = PP = 1 ``OmniModel``) to ``out`` in its HF family, atomically."""
    from omni_trainer.interop.runtime import hf_files_dir
    from omni_trainer.models.init import global_llm_names

    config = check_export(cfg, out)
    llm = cfg.model.llm
    (chunk,) = model.llm_chunks
    params = global_llm_names(chunk)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        writer = _ShardWriter(tmp, shard_bytes or SHARD_BYTES)
        count = 0
        for name, param in params.items():
            for hf_name, tensor in split_full(tensor_map(name, llm), llm, param.data).items():
                writer.add(hf_name, tensor)
                count += 1
        for hf_name, tensor in qwen2_5_vl.tower_tensors(model, cfg):
            writer.add(hf_name, tensor)
            count += 1
        files = writer.close()
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        files.append("config.json")
        for source in {hf_files_dir(llm.hf), hf_files_dir(cfg.tokenizer)} - {None}:
            for name in SIDE_FILES:
                if (source / name).is_file() and not (tmp / name).exists():
                    shutil.copyfile(source / name, tmp / name)
                    files.append(name)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    written = {"image"} if qwen2_5_vl.exports_tower(cfg) else set()
    skipped = [
        m
        for m in ("image", "audio")
        if getattr(cfg.model.encoders, m) is not None and m not in written
    ]
    return ExportResult(
        out=out, step=step, tensors=count, bytes=writer.total, files=files, skipped=skipped
    )
