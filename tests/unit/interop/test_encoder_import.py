"""Imported encoders (``model.encoders.*.hf``) equal transformers' towers on the same inputs."""

from __future__ import annotations

import pytest
import torch

from omni_trainer.data.sample import media_geometry
from omni_trainer.models.encoders.config import AudioEncoderConfig, VisionEncoderConfig
from omni_trainer.models.omni import build_encoder
from tests.unit.interop.hf_models import save_vision, save_whisper


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    rel = (ours - ref).norm() / ref.norm()
    assert rel < 1e-4, float(rel)


@pytest.mark.parametrize(
    ("family", "dual", "layer", "select"),
    [
        ("clip", True, -2, "default"),  # LLaVA's setting on a dual encoder's vision_model.*
        ("clip", False, -1, "full"),
        ("siglip", True, -1, "full"),
        ("siglip", False, -2, "default"),
    ],
)
def test_vision_tower_equals_transformers(tmp_path, family, dual, layer, select) -> None:
    ref = save_vision(tmp_path, family, dual=dual)
    cfg = VisionEncoderConfig(hf=str(tmp_path), feature_layer=layer, feature_select=select)
    assert cfg.num_layers == 3 + 1 + layer if layer < 0 else layer
    ours = build_encoder("image", cfg).eval()
    torch.manual_seed(1)
    native = torch.randn(2, 3, 28, 28)  # the trained grid: the position table as is
    other = torch.randn(1, 3, 21, 35)  # another grid: positions interpolated (bicubic)
    drop = 1 if select == "default" else 0
    with torch.no_grad():
        got = ours([native[0], other[0], native[1]])
        want_native = ref(native, output_hidden_states=True).hidden_states[layer][:, drop:]
        want_other = ref(
            other, interpolate_pos_encoding=True, output_hidden_states=True
        ).hidden_states[layer][:, drop:]
    counts = [cfg.num_tokens(28, 28), cfg.num_tokens(21, 35), cfg.num_tokens(28, 28)]
    assert counts[1] == 15 + (family == "clip") - drop
    a, b, c = got.split(counts)
    _close(torch.stack([a, c]), want_native)
    _close(b[None], want_other)


@pytest.mark.parametrize(("family", "select"), [("clip", "default"), ("siglip", "full")])
def test_unset_feature_select_drops_only_a_class_token(tmp_path, family, select) -> None:
    save_vision(tmp_path, family)
    cfg = VisionEncoderConfig(hf=str(tmp_path))
    assert cfg.feature_select == select and cfg.num_tokens(28, 28) == 16  # 4 x 4 patches


def test_whisper_encoder_equals_transformers(tmp_path) -> None:
    ref = save_whisper(tmp_path)
    cfg = AudioEncoderConfig(hf=str(tmp_path))
    assert (cfg.subsampling, cfg.n_mels, cfg.max_frames) == (2, 16, 24)
    ours = build_encoder("audio", cfg).eval()
    torch.manual_seed(2)
    full = torch.randn(2, 16, 24)  # Whisper takes only full-length (padded) inputs
    with torch.no_grad():
        want = ref(full).last_hidden_state
        got = ours([full[0].T, full[1].T[:10], full[1].T])  # a short clip between them
        alone = ours([full[1].T[:10]])
    a, short, b = got.split([12, 5, 12])
    _close(torch.stack([a, b]), want)
    _close(short, alone)  # a clip's encoding does not depend on its batch-mates


def test_whisper_key_bias_stays_zero(tmp_path) -> None:
    save_whisper(tmp_path)
    enc = build_encoder("audio", AudioEncoderConfig(hf=str(tmp_path)))
    enc([torch.randn(24, 16)]).square().sum().backward()
    grad = enc.blocks[0].attn.qkv.bias.grad
    assert grad[32:64].abs().max() == 0 and grad[:32].abs().max() > 0


def test_unsupported_and_broken_checkpoints_are_named(tmp_path) -> None:
    import json

    from safetensors.torch import load_file, save_file

    save_whisper(tmp_path / "whisper")
    with pytest.raises(ValueError, match=r"'WhisperForConditionalGeneration' is not supported as "
                       r"an image encoder \(supported: CLIPModel, CLIPVisionModel"):  # fmt: skip
        VisionEncoderConfig(hf=str(tmp_path / "whisper"))
    with pytest.raises(ValueError, match="numLayers cannot be set beside 'hf'"):
        VisionEncoderConfig(hf=str(tmp_path / "whisper"), num_layers=2)
    with pytest.raises(ValueError, match="featureLayer 4 selects no block of a 3-layer tower"):
        save_vision(tmp_path / "clip", "clip")
        VisionEncoderConfig(hf=str(tmp_path / "clip"), feature_layer=4)
    with pytest.raises(ValueError, match="featureSelect: only for an imported tower"):
        VisionEncoderConfig(preset="vit-tiny", feature_select="full")

    cfg = VisionEncoderConfig(hf=str(tmp_path / "clip"))
    weights = load_file(tmp_path / "clip" / "model.safetensors")
    weights["encoder.layers.1.mlp.fc1.weight"] = torch.zeros(40, 32)
    save_file(weights, tmp_path / "clip" / "model.safetensors")
    with pytest.raises(ValueError, match=r"'encoder.layers.1.mlp.fc1.weight' .* has shape "
                       r"\[40, 32\], the model expects \[48, 32\]"):  # fmt: skip
        build_encoder("image", cfg)
    del weights["encoder.layers.1.mlp.fc1.weight"], weights["pre_layrnorm.bias"]
    save_file(weights, tmp_path / "clip" / "model.safetensors")
    with pytest.raises(ValueError, match=r"tensor 'pre_layrnorm\.bias' is missing"):
        build_encoder("image", cfg)
    config = json.loads((tmp_path / "clip" / "config.json").read_text())
    (tmp_path / "clip" / "config.json").write_text(json.dumps(config | {"hidden_act": "relu"}))
    with pytest.raises(ValueError, match="activation 'relu' is not supported"):
        VisionEncoderConfig(hf=str(tmp_path / "clip"))


def test_deferred_hf_leaves_the_shape_unknown() -> None:
    cfg = VisionEncoderConfig.model_validate({"hf": "s3://bucket/clip"}, context={"defer_hf": True})
    assert not cfg.resolved and cfg.tower is None


@pytest.mark.parametrize("family", ["clip", "siglip"])
def test_conversations_feed_the_tower_what_transformers_would(tmp_path, family) -> None:
    """The imported processor sizes the images, every <image> expands to the tower's output
    count, and the tower encodes the pixels transformers' processor makes to its features."""
    from PIL import Image
    from transformers import AutoImageProcessor

    from omni_trainer.config import TrainerConfig
    from omni_trainer.data.loader import MultimodalStream
    from omni_trainer.data.tinyset import make_tiny_dataset

    data = make_tiny_dataset(str(tmp_path / "data"), images=4, audio=2)
    ref = save_vision(tmp_path / "vision", family, dual=True)
    save_whisper(tmp_path / "whisper")
    cfg = TrainerConfig.model_validate(
        {
            "tokenizer": data["tokenizer"],
            "model": {
                "llm": {"preset": "tiny"},
                "encoders": {
                    "image": {"hf": str(tmp_path / "vision")},
                    "audio": {"hf": str(tmp_path / "whisper")},
                },
            },
            "data": {
                "seqLength": 256,
                "globalBatchSize": 2,
                "microBatchSize": 1,
                "sources": [
                    {
                        "kind": "conversations",
                        "name": "tiny",
                        "url": data["annotations"],
                        "modality": "image",
                    },
                ],
            },
        }
    )
    image_cfg = cfg.model.encoders.image
    stream = MultimodalStream(
        cfg.data, seed=0, vocab_size=512, geometry=media_geometry(cfg.model),
        tokenizer=cfg.tokenizer,
    )  # fmt: skip
    source = stream.sources[0]
    tower = build_encoder("image", image_cfg).eval()
    hf_processor = AutoImageProcessor.from_pretrained(tmp_path / "vision")
    kinds = set()
    for index in range(6):
        sample = source.get(index)
        for span in sample.spans:
            kinds.add(span.modality)
            pixels = source.load_media(span.ref)
            if span.modality == "audio":  # cut to Whisper's 24 frames, 2 per position
                assert pixels.shape == (24, 16) and span.tokens == 12
                continue
            assert span.tokens == image_cfg.num_tokens(28, 28) == 16  # every patch
            rel = source.records[index]["image"]
            with Image.open(f"{source.root}/{rel}") as img:
                want = hf_processor(images=[img], return_tensors="pt")["pixel_values"]
            torch.testing.assert_close(torch.from_numpy(pixels), want[0], atol=1e-5, rtol=0)
            with torch.no_grad():
                features = tower([torch.from_numpy(pixels)])
                hidden = ref(want, output_hidden_states=True).hidden_states[-2]
                expected = hidden[:, 1:] if family == "clip" else hidden  # CLIP's class token
            assert features.shape[0] == span.tokens
            _close(features, expected[0])
    assert kinds == {"image", "audio"}
