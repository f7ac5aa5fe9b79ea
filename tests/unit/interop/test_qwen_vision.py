"""The imported Qwen2.5-VL vision tower (``model.encoders.image.hf``) equals transformers' on
images of different sizes and video frames, data-parallel and batch-composition invariant."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omni_trainer.data.media import ImageSettings
from omni_trainer.data.sample import media_geometry
from omni_trainer.models.encoders.config import VisionEncoderConfig
from omni_trainer.models.omni import build_encoder
from tests.unit.interop.hf_models import QWEN_VISION, qwen2vl_patches, save_qwen2_5_vl


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    rel = (ours - ref).norm() / ref.norm()
    assert rel < 1e-4, float(rel)


def _video_patches(frames: torch.Tensor, p: int, m: int, tp: int) -> torch.Tensor:
    """Qwen2VLVideoProcessor's flattening of [F, C, H, W] frames (from its source)."""
    f, c, h, w = frames.shape
    x = frames.reshape(f // tp, tp, c, h // p // m, m, p, w // p // m, m, p)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(f // tp * (h // p) * (w // p), c * tp * p * p)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen")
    ref = save_qwen2_5_vl(path)
    return path, ref.model.visual


def test_config_reads_the_tower(qwen) -> None:
    path, _ = qwen
    cfg = VisionEncoderConfig(hf=str(path))
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.patch_size) == (32, 3, 4, 4)
    assert cfg.qwen.window_units == 2 and cfg.qwen.full_attention_blocks == (1,)
    assert cfg.output_size == 64 and cfg.position_side == 8 and cfg.drop_prefix == 0
    assert cfg.num_tokens(40, 56) == 35
    assert cfg.merge_unit == 4 and VisionEncoderConfig(preset="vit-tiny").merge_unit == 1
    enc = build_encoder("image", cfg)
    assert sum(p.numel() for p in enc.parameters()) == cfg.params()
    with pytest.raises(ValueError, match="not a multiple of patch_size x merge size 8"):
        cfg.num_tokens(36, 56)
    with pytest.raises(ValueError, match=r"featureLayer: a Qwen2\.5-VL tower outputs"):
        VisionEncoderConfig(hf=str(path), feature_layer=-1)


def test_tower_equals_transformers_on_images_and_video(qwen) -> None:
    path, ref = qwen
    cfg = VisionEncoderConfig(hf=str(path))
    ours = build_encoder("image", cfg).eval()
    torch.manual_seed(1)
    big = torch.randn(3, 40, 56)  # 5 x 7 merged tokens: windows cut at both edges
    small = torch.randn(3, 24, 32)  # 3 x 4
    video = torch.randn(4, 3, 16, 24)  # 2 temporal patches of 2 x 3 merged tokens
    s = ImageSettings(patch_size=4, merge_size=2, temporal_patch_size=2)
    pixels, grids = [], []
    for img in (big, small):
        patches, grid = qwen2vl_patches(img.numpy(), s)  # the processor's layout (tested)
        pixels.append(torch.from_numpy(np.ascontiguousarray(patches)))
        grids.append(grid)
    pixels.append(_video_patches(video, 4, 2, 2))
    grids.append([2, 4, 6])
    with torch.no_grad():
        want = ref(torch.cat(pixels), grid_thw=torch.tensor(grids)).pooler_output
        got = ours([big, small, video])
        alone = ours([small])
    counts = [35, 12, 12]
    assert got.shape == (sum(counts), 64)
    _close(got, want)
    _close(alone, got.split(counts)[1])  # an image's features do not depend on its batch-mates


def test_tower_patches_equal_the_processor(qwen) -> None:
    path, _ = qwen
    tower = build_encoder("image", VisionEncoderConfig(hf=str(path)))
    img = torch.randn(3, 24, 40)
    want, grid = qwen2vl_patches(img.numpy(), ImageSettings(patch_size=4, merge_size=2))
    got, got_grid = tower.patchify(img)
    assert list(got_grid) == grid
    torch.testing.assert_close(got, torch.from_numpy(np.ascontiguousarray(want)))
    with pytest.raises(ValueError, match="3 video frames is not a multiple of 2"):
        tower.patchify(torch.randn(3, 3, 16, 16))
    assert QWEN_VISION["window_size"] == 16


def test_conversations_feed_the_tower_what_transformers_would(tmp_path, qwen) -> None:
    """Images are sized as Qwen2VLImageProcessor sizes them (smart_resize within the pixel
    bounds of the model's preprocessor_config.json), each <image> expands to the merged token
    count, and the tower's features of our pixels equal transformers' on its processor's."""
    from PIL import Image
    from transformers import AutoImageProcessor

    from omni_trainer.config import TrainerConfig
    from omni_trainer.data.loader import MultimodalStream
    from omni_trainer.data.tinyset import make_tiny_dataset

    path, ref = qwen
    data = make_tiny_dataset(str(tmp_path / "data"), images=4, audio=0)
    cfg = TrainerConfig.model_validate(
        {
            "tokenizer": data["tokenizer"],
            "model": {"llm": {"preset": "tiny"}, "encoders": {"image": {"hf": str(path)}}},
            "data": {
                "seqLength": 256,
                "globalBatchSize": 2,
                "microBatchSize": 1,
                "sources": [
                    {"kind": "conversations", "name": "tiny", "url": data["annotations"],
                     "modality": "image"},
                ],
            },
        }
    )  # fmt: skip
    image_cfg = cfg.model.encoders.image
    geometry = media_geometry(cfg.model)
    assert geometry.patch_size == 8 and geometry.image_settings.min_pixels == 256
    stream = MultimodalStream(
        cfg.data, seed=0, vocab_size=512, geometry=geometry, tokenizer=cfg.tokenizer
    )
    source = stream.sources[0]
    tower = build_encoder("image", image_cfg).eval()
    hf_processor = AutoImageProcessor.from_pretrained(path)
    sizes = set()
    for index in range(4):
        sample = source.get(index)
        (span,) = sample.spans
        pixels = torch.from_numpy(source.load_media(span.ref))
        with Image.open(f"{source.root}/{source.records[index]['image']}") as img:
            want = hf_processor(images=[img], return_tensors="pt")
        grid = want["image_grid_thw"][0].tolist()
        assert list(pixels.shape[1:]) == [grid[1] * 4, grid[2] * 4]
        assert span.tokens == grid[1] * grid[2] // 4 == image_cfg.num_tokens(*pixels.shape[1:])
        sizes.add(tuple(pixels.shape))
        torch.testing.assert_close(
            tower.patchify(pixels)[0], want["pixel_values"], atol=1e-5, rtol=0
        )
        with torch.no_grad():
            features = tower([pixels])
            expected = ref(want["pixel_values"], grid_thw=want["image_grid_thw"]).pooler_output
        assert features.shape[0] == span.tokens
        _close(features, expected)
    assert len(sizes) > 1  # native resolution: the images keep different sizes


def test_bad_tower_configs_are_named() -> None:
    from omni_trainer.interop.qwen2_5_vl import vision_fields
    from omni_trainer.interop.source import HFModelError

    base = {"model_type": "qwen2_5_vl_vision", **QWEN_VISION}
    for change, message in [
        ({"hidden_act": "relu"}, "vision hidden_act 'relu' is not supported"),
        ({"fullatt_block_indexes": [3]}, r"fullatt_block_indexes \[3\] outside 0\.\.2"),
        ({"window_size": 4}, r"window_size 4 is smaller than one merged token \(8 pixels\)"),
    ]:
        with pytest.raises(HFModelError, match=message):
            vision_fields(base | change, "m")
    fields, act, settings = vision_fields({"vision_config": base}, "m")
    assert (fields["num_layers"], act, settings.window_units) == (3, "silu", 2)
