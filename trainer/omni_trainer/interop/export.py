"""``omni export``: the model back in its Hugging Face family, tensor by tensor.

The LLM is written in the family it came from (``model.llm.hf``'s config.json, updated to the
exported dtype) or, for presets, as a Llama; a whole LLaVA (``model.hf``) as
``LlavaForConditionalGeneration`` (``llava_export``), a whole Qwen2.5-VL as itself (the LLM and
its tower, ``qwen2_5_vl.tower_tensors``). The output appears atomically: everything is written
into a hidden sibling directory that is renamed to ``--out`` only once complete, so a failure
never leaves a half-written model where transformers would load it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import chain
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
LLAVA = "LlavaForConditionalGeneration"
EXPORTABLE_VLMS = (LLAVA, qwen2_5_vl.VLM)


@dataclass
class ExportResult:
    out: Path
    step: int | None
    tensors: int
    bytes: int
    files: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    """Parts of the model left out, each with the reason."""


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


@dataclass
class ExportPlan:
    """What ``omni export`` writes, decided before any weight is allocated."""

    config: dict
    """The config.json."""
    vlm: str | None
    """The architecture of the whole VLM written (tower and projector too); None: the LLM
    alone."""
    skipped: list[str] = field(default_factory=list)
    """Why each part left out is left out."""


def check_export(cfg: TrainerConfig, out: Path) -> ExportPlan:
    """The plan, and the checks that need no model: run them before building one (a GPT-shaped
    preset is refused before its weights are allocated).

    A whole VLM (``model.hf``) is written as itself; an LLM with an imported CLIP / SigLIP tower
    as a LLaVA when the tokenizer has LLaVA's ``<image>`` token; anything else as the LLM's
    family, the encoders left out with the reason."""
    from omni_trainer.interop.llava_export import composed_config
    from omni_trainer.interop.source import read_config

    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"--out {out}: exists and is not empty (choose a new directory)")
    llm = cfg.model.llm
    why = ""
    if cfg.model.hf is not None:
        from omni_trainer.interop.hf_config import architecture

        config = read_config(cfg.model.hf)
        arch = architecture(config, cfg.model.hf)
        if arch not in EXPORTABLE_VLMS:
            raise HFModelError(
                f"export: model.hf {cfg.model.hf} is a {arch}; whole VLMs are exported only as "
                f"{', '.join(EXPORTABLE_VLMS)}"
            )
    else:
        text = read_config(llm.hf) if llm.hf else llama_config(llm, torch.float32)
        composed, why = composed_config(cfg, dict(text))
        config = composed or text
    arch = config["architectures"][0]
    vlm = arch if arch in EXPORTABLE_VLMS else None
    skipped = [f"the image encoder and projector: {why}"] if why else []
    if cfg.model.encoders.audio is not None:
        skipped.append("the audio encoder and projector: no exported family here holds audio")
    # Parameters are fp32 in this trainer (bf16 is autocast), so that is what is exported.
    config["dtype"] = "float32"
    return ExportPlan(config=config, vlm=vlm, skipped=skipped)


def _llm_tensors(model, cfg: TrainerConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of the LLM as a causal LM."""
    from omni_trainer.models.init import global_llm_names

    llm = cfg.model.llm
    (chunk,) = model.llm_chunks
    for name, param in global_llm_names(chunk).items():
        yield from split_full(tensor_map(name, llm), llm, param.data).items()


def _vlm_tensors(model, cfg: TrainerConfig, config: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """(name on disk, tensor) of the whole LLaVA, each checked against transformers' shape."""
    from omni_trainer.interop.llava_export import llava_layout, llava_tensors
    from omni_trainer.interop.safetensors_io import SafetensorsReader
    from omni_trainer.interop.source import local_dir

    layout = llava_layout(config, tied=cfg.model.llm.tie_embeddings)
    reader = SafetensorsReader(local_dir(cfg.model.encoders.image.hf))  # the tower's tail
    for name, tensor in llava_tensors(model, cfg, layout, reader):
        if name not in layout.saved:
            raise HFModelError(f"export: transformers' LLaVA has no tensor {name!r}")
        if list(tensor.shape) != layout.shapes[name]:
            raise HFModelError(
                f"export: tensor {name!r} has shape {list(tensor.shape)}, transformers' LLaVA "
                f"expects {layout.shapes[name]}"
            )
        yield layout.saved[name], tensor


def _tensors(model, cfg: TrainerConfig, plan: ExportPlan) -> Iterator[tuple[str, torch.Tensor]]:
    """(name on disk, tensor) of everything the plan writes."""
    if plan.vlm == LLAVA:
        return _vlm_tensors(model, cfg, plan.config)
    if plan.vlm == qwen2_5_vl.VLM:  # the LLM as Qwen2's names, the tower under ``visual.``
        return chain(_llm_tensors(model, cfg), qwen2_5_vl.tower_tensors(model))
    return _llm_tensors(model, cfg)


def write_hf(
    model, cfg: TrainerConfig, out: Path, *, step: int | None, shard_bytes: int | None = None
) -> ExportResult:
    """Write ``model`` (a TP = PP = 1 ``OmniModel``) to ``out`` in its HF family, atomically."""
    from omni_trainer.interop.runtime import hf_files_dir

    plan = check_export(cfg, out)
    llm, config = cfg.model.llm, plan.config
    tensors = _tensors(model, cfg, plan)
    sources = [(hf_files_dir(cfg.tokenizer), SIDE_FILES), (hf_files_dir(llm.hf), SIDE_FILES)]
    if plan.vlm:  # the tower's image processor (a dual encoder's text tokenizer stays behind)
        sources.append((hf_files_dir(cfg.model.encoders.image.hf), ("preprocessor_config.json",)))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        writer = _ShardWriter(tmp, shard_bytes or SHARD_BYTES)
        count = 0
        for hf_name, tensor in tensors:
            writer.add(hf_name, tensor)
            count += 1
        files = writer.close()
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        files.append("config.json")
        for source, names in sources:
            for name in names if source is not None else ():
                if (source / name).is_file() and not (tmp / name).exists():
                    shutil.copyfile(source / name, tmp / name)
                    files.append(name)
        if plan.vlm == LLAVA and not (tmp / "processor_config.json").exists():
            from omni_trainer.interop.llava_export import write_processor

            files += [name] if (name := write_processor(tmp, cfg)) else []
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportResult(
        out=out, step=step, tensors=count, bytes=writer.total, files=files, skipped=plan.skipped
    )
