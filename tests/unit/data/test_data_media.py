"""Our processors against transformers' own (PIL backends: torchvision is not installed here)."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest

from omni_trainer.data.media import (
    AudioSettings,
    FixedImageSettings,
    ImageSettings,
    VideoSettings,
    audio_info,
    decode_frames,
    image_size,
    video_info,
)

from ..interop.hf_models import qwen2vl_patches

SIZES = [(37, 53), (224, 224), (300, 120), (90, 640), (481, 333)]


def _png(h: int, w: int, seed: int, mode: str = "RGB") -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
    img = Image.fromarray(arr).convert(mode)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _pil(data: bytes):
    from PIL import Image

    return Image.open(io.BytesIO(data))


@pytest.mark.parametrize("hw", SIZES)
def test_qwen2vl_pixels_and_grid_equal_transformers(hw):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    s = ImageSettings(min_pixels=56 * 56, max_pixels=28 * 28 * 64)
    ref = Qwen2VLImageProcessorPil(min_pixels=s.min_pixels, max_pixels=s.max_pixels)
    data = _png(*hw, seed=hw[0])
    want = ref(images=[_pil(data)], return_tensors="np")
    pixels, grid = qwen2vl_patches(s.resized(data), s)
    assert grid == want["image_grid_thw"][0].tolist()
    np.testing.assert_allclose(pixels, want["pixel_values"], atol=1e-5, rtol=0)
    h, w = image_size(data)  # the header alone gives the token count
    th, tw = s.target_size(h, w)
    assert (th // s.patch_size) * (tw // s.patch_size) == len(pixels)


@pytest.mark.parametrize("hw", SIZES)
@pytest.mark.parametrize("family", ["clip", "siglip"])
def test_clip_and_siglip_pixels_equal_transformers(family, hw):
    if family == "clip":
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil as P

        ours = FixedImageSettings()
        ref = P()
        if min(hw) < 224 and max(hw) * 224 / min(hw) < 224:  # pragma: no cover - never here
            pytest.skip("smaller than the crop")
    else:
        from transformers.models.siglip.image_processing_pil_siglip import (
            SiglipImageProcessorPil as P,
        )

        ours = FixedImageSettings(
            shortest_edge=None, height=224, width=224, crop_size=None,
            image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5),
        )  # fmt: skip
        ref = P()
    data = _png(*hw, seed=hw[1])
    want = ref(images=[_pil(data)], return_tensors="np")["pixel_values"][0]
    np.testing.assert_allclose(ours.processed(data), want, atol=1e-5, rtol=0)


def test_grayscale_and_palette_images_convert_like_transformers():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    s = ImageSettings(max_pixels=28 * 28 * 16)
    for mode in ("L", "P"):
        data = _png(60, 80, seed=3, mode=mode)
        want = Qwen2VLImageProcessorPil(max_pixels=s.max_pixels)(
            images=[_pil(data)], return_tensors="np"
        )["pixel_values"]
        np.testing.assert_allclose(qwen2vl_patches(s.resized(data), s)[0], want, atol=1e-5)


def _wav(seconds: float, rate: int, seed: int) -> bytes:
    import soundfile as sf

    rng = np.random.default_rng(seed)
    t = np.arange(int(rate * seconds)) / rate
    x = 0.3 * np.sin(2 * np.pi * 440 * t) + 0.05 * rng.standard_normal(len(t))
    buf = io.BytesIO()
    sf.write(buf, x.astype(np.float32), rate, format="WAV", subtype="FLOAT")
    return buf.getvalue()


@pytest.mark.parametrize("n_mels", [80, 128])
@pytest.mark.parametrize("seconds", [0.37, 2.0])
def test_log_mel_equals_whisper_feature_extractor(n_mels, seconds):
    import soundfile as sf
    from transformers import WhisperFeatureExtractor

    data = _wav(seconds, 16000, seed=n_mels)
    wave, _ = sf.read(io.BytesIO(data), dtype="float32")
    fe = WhisperFeatureExtractor(feature_size=n_mels)
    ours = AudioSettings(feature_size=n_mels)
    want = fe(wave, sampling_rate=16000, return_tensors="np")["input_features"][0]
    np.testing.assert_allclose(ours.log_mel(wave), want, atol=1e-5, rtol=0)
    assert audio_info(data) == (len(wave), 16000)
    # unpadded (our Conformer): the same features, at the clip's own length
    own = AudioSettings(feature_size=n_mels, chunk_length=None)
    got = own.log_mel(wave)
    assert got.shape == (n_mels, own.frames(len(wave)))
    want = fe(
        wave, sampling_rate=16000, padding="longest", return_tensors="np"
    )["input_features"][0]  # fmt: skip
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def _reference_sample_frames():
    """transformers' Qwen2VLVideoProcessor.sample_frames, taken from its source (the module
    imports torchvision, which does not install against this torch)."""
    import ast
    import inspect
    import pathlib
    import textwrap

    import torch
    import transformers

    path = pathlib.Path(inspect.getfile(transformers)).parent / (
        "models/qwen2_vl/video_processing_qwen2_vl.py"
    )
    tree = ast.parse(path.read_text())
    fn = next(
        n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "sample_frames"
    )
    src = textwrap.dedent(ast.get_source_segment(path.read_text(), fn))
    scope = {"math": math, "torch": torch, "VideoMetadata": object}
    exec(src, scope)
    return scope["sample_frames"]


def _mp4(frames: int, fps: int, h: int, w: int) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        for k in range(frames):
            arr = np.full((h, w, 3), (k * 7) % 256, dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def test_video_frame_indices_equal_qwen2vl_sampling():
    from types import SimpleNamespace

    sample_frames = _reference_sample_frames()
    data = _mp4(frames=50, fps=25, h=64, w=96)
    total, fps, h, w = video_info(data)
    assert (total, fps, h, w) == (50, 25.0, 64, 96)
    for want_fps, max_frames in [(2.0, 768), (10.0, 768), (25.0, 12), (1.0, 768)]:
        s = VideoSettings(fps=want_fps, max_frames=max_frames)
        meta = SimpleNamespace(total_num_frames=total, fps=fps)
        proc = SimpleNamespace(num_frames=None, fps=None, temporal_patch_size=2, min_frames=4,
                               max_frames=max_frames)  # fmt: skip
        want = sample_frames(proc, meta, fps=want_fps).numpy()
        np.testing.assert_array_equal(s.frame_indices(total, fps), want)
    frames = decode_frames(data, s.frame_indices(total, fps))
    assert len(frames) == len(s.frame_indices(total, fps)) and frames[0].size == (96, 64)
