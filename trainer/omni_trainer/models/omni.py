"""The multimodal model: one encoder + projector per modality feeding megatron's GPTModel."""

from __future__ import annotations

import torch
from torch import nn

from omni_trainer.models.batch import DeviceBatch, MediaRows
from omni_trainer.models.config import ModelConfig
from omni_trainer.models.llm import FP32, LLMRuntime, build_gpt_chunks


def build_encoder(modality: str, cfg) -> nn.Module:
    """An encoder whose token mixing can switch to Ulysses sequence parallelism per sample; an
    imported one (``hf``) carries the checkpoint's weights."""
    from omni_trainer.models.ulysses import UlyssesMixer

    if cfg.hf is not None:
        from omni_trainer.interop.encoders import load_encoder

        encoder = imported_tower(cfg)
        load_encoder(encoder, cfg.hf, cfg.tower.family)
        return encoder
    if modality == "image":
        from omni_trainer.models.encoders.vision import VisionEncoder

        return VisionEncoder(cfg, mixer=UlyssesMixer())
    if modality == "audio":
        from omni_trainer.models.encoders.audio import AudioEncoder

        return AudioEncoder(cfg, mixer=UlyssesMixer())
    raise ValueError(f"no encoder for modality {modality!r}")


def imported_tower(cfg) -> nn.Module:
    """The module an imported encoder (``hf``) loads its checkpoint into (weights not read:
    built under ``torch.device("meta")`` it gives the shapes the checkpoint must have)."""
    from omni_trainer.models.encoders.pretrained import PretrainedVisionTower, WhisperAudioEncoder
    from omni_trainer.models.encoders.qwen_vision import QwenVisionTower
    from omni_trainer.models.ulysses import UlyssesMixer

    tower_cls = {"whisper": WhisperAudioEncoder, "qwen2_5_vl": QwenVisionTower}.get(
        cfg.tower.family, PretrainedVisionTower
    )
    return tower_cls(cfg, mixer=UlyssesMixer())


class OmniModel(nn.Module):
    """This rank's parts of the multimodal model: its LLM chunks, and every encoder + projector.

    Encoders sit on every pipeline stage (the paper's colocated layout), so every rank holds a
    full replica of each. All weights are layout-independent functions of the seed.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        max_sequence_length: int,
        seed: int,
        llm_runtime: LLMRuntime = FP32,
    ) -> None:
        super().__init__()
        from omni_trainer.models.encoders.projector import Projector
        from omni_trainer.models.freeze import apply_freeze
        from omni_trainer.models.init import name_seed

        self.cfg = cfg
        self.llm_chunks = nn.ModuleList(
            build_gpt_chunks(
                cfg.llm,
                max_sequence_length=max_sequence_length,
                seed=seed,
                runtime=llm_runtime,
            )
        )
        torch.manual_seed(name_seed(seed, "encoders"))
        self.encoders = nn.ModuleDict()
        self.projectors = nn.ModuleDict()
        for modality in ("image", "audio"):
            enc_cfg = getattr(cfg.encoders, modality)
            if enc_cfg is None:
                continue
            self.encoders[modality] = build_encoder(modality, enc_cfg)
            self.encoders[modality].mixer.recompute = llm_runtime.recompute  # train.recompute
            self.projectors[modality] = Projector(enc_cfg.output_size, cfg.llm.hidden_size)
        qwen = cfg.encoders.image is not None and cfg.encoders.image.qwen is not None
        if cfg.hf is not None and qwen:  # Qwen2.5-VL: the tower's merger is the projector
            self.projectors["image"] = nn.Identity()
        elif cfg.hf is not None:  # a whole LLaVA: its projector too
            from omni_trainer.interop.encoders import load_projector

            load_projector(self.projectors["image"], cfg.hf)
        apply_freeze(self, cfg)

    def llm_parameters(self) -> list[nn.Parameter]:
        return list(self.llm_chunks.parameters())

    def encoder_parameters(self) -> list[nn.Parameter]:
        return [*self.encoders.parameters(), *self.projectors.parameters()]


def first_stage_input(
    chunk: nn.Module, batch: DeviceBatch, media: dict[str, MediaRows]
) -> torch.Tensor:
    """Text embeddings with every media span replaced by its projected encoder output. With
    sequence parallelism megatron's embedding returns this TP rank's sequence shard and
    ``media`` holds the rows of that shard with their positions in it (send-then-reshard:
    ``multiplex.reshard``)."""
    emb = chunk.embedding(input_ids=batch.tokens, position_ids=batch.position_ids)
    s, b, h = emb.shape
    flat = emb.reshape(s * b, h)
    for modality, rows in sorted(media.items()):
        encoded, where = rows.encoded, rows.positions
        if where is None:
            target = batch.media[modality]
            where = target.flat_positions
            if target.rows is not None:
                encoded = encoded.index_select(0, target.rows)
        flat = flat.index_copy(0, where, encoded.to(flat.dtype))
    return flat.reshape(s, b, h)
