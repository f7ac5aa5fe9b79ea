"""Media preprocessing identical to the Hugging Face processors (numpy + Pillow; torch for STFT).

Images: Qwen2-VL ``smart_resize`` between min/max pixels and its patch layout (``pixel_values``
+ ``image_grid_thw``); CLIP/SigLIP resize, center crop, rescale and normalize. Audio: Whisper's
log-mel spectrogram (80 or 128 bins; any bin count for our Conformer). Video: PyAV decode and
Qwen2-VL's frame sampling at an fps under a frame and total-pixel budget, in temporal patches of 2.
The settings are the HF ``preprocessor_config.json`` keys, so a model's own config drives them.
Sizes come from headers alone (:func:`image_size`, :func:`audio_frames`, :func:`video_info`), so
the loader knows a sample's token count without decoding it.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
BICUBIC, BILINEAR = 3, 2
"""PIL resampling filters, as HF configs name them (``resample``)."""


def smart_resize(
    height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Qwen2-VL's target size: sides multiples of ``factor``, area in [min, max] pixels, aspect
    ratio kept as closely as possible."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.0f} exceeds 200")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


Source = bytes | str
"""A media file: its bytes, or a local path (then headers are read without reading the rest)."""


def _file(src: Source):
    return io.BytesIO(src) if isinstance(src, bytes) else src


def open_image(data: Source):
    """A lazily opened Pillow image (only the header is parsed)."""
    from PIL import Image

    return Image.open(_file(data))


def image_size(data: Source) -> tuple[int, int]:
    """(height, width) from the header; raises on anything Pillow cannot identify."""
    img = open_image(data)
    return img.height, img.width


def _rgb(img) -> np.ndarray:
    """HF's ``convert_rgb`` then HWC uint8."""
    if img.mode != "RGB":
        img = img.convert("RGBA").convert("RGB") if img.mode in ("P", "LA") else img.convert("RGB")
    return np.asarray(img)


def _normalize(chw_uint8: np.ndarray, mean, std, rescale: float = 1 / 255) -> np.ndarray:
    x = (chw_uint8.astype(np.float64) * rescale).astype(np.float32)
    m = np.asarray(mean, dtype=np.float32)[:, None, None]
    s = np.asarray(std, dtype=np.float32)[:, None, None]
    return ((x - m) / s).astype(np.float32)


def _resize(img, height: int, width: int, resample: int):
    from PIL import Image

    rgb = Image.fromarray(_rgb(img))
    return np.asarray(rgb.resize((width, height), resample=resample)).transpose(2, 0, 1)


@dataclass(frozen=True)
class ImageSettings:
    """Dynamic-resolution images (Qwen2-VL style, also our ViT's): HF config key names."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    resample: int = BICUBIC

    @classmethod
    def from_processor(
        cls, raw: dict, *, patch_size: int, merge_size: int, temporal_patch_size: int
    ) -> ImageSettings:
        """The settings of a Qwen2-VL ``preprocessor_config.json`` (``raw``; empty:
        Qwen2VLImageProcessor's defaults) for a tower of these patch sizes: the pixel bounds as
        ``min_pixels``/``max_pixels`` or ``size: {shortest_edge, longest_edge}``."""
        tower = dict(
            patch_size=patch_size, merge_size=merge_size, temporal_patch_size=temporal_patch_size
        )
        for key, value in tower.items():
            if int(raw.get(key, value)) != value:
                raise ValueError(
                    f"preprocessor_config.json: {key} {raw[key]} differs from the tower's {value}"
                )
        size, default = raw.get("size") or {}, cls()
        return cls(
            min_pixels=int(
                raw.get("min_pixels") or size.get("shortest_edge") or default.min_pixels
            ),
            max_pixels=int(raw.get("max_pixels") or size.get("longest_edge") or default.max_pixels),
            image_mean=tuple(raw.get("image_mean", default.image_mean)),
            image_std=tuple(raw.get("image_std", default.image_std)),
            resample=int(raw.get("resample", default.resample)),
            **tower,
        )

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        return smart_resize(
            height,
            width,
            factor=self.factor,
            min_pixels=self.min_pixels,
            max_pixels=self.max_pixels,
        )

    def resized(self, data: Source) -> np.ndarray:
        """[C, H, W] float32, resized by ``smart_resize``, rescaled and normalized."""
        return self.resized_image(open_image(data))

    def resized_image(self, img) -> np.ndarray:
        """:meth:`resized` of an opened Pillow image (e.g. a decoded video frame)."""
        h, w = self.target_size(img.height, img.width)
        return _normalize(_resize(img, h, w, self.resample), self.image_mean, self.image_std)


@dataclass(frozen=True)
class FixedImageSettings:
    """CLIP / SigLIP style: resize (shortest edge or exact size), optional center crop."""

    shortest_edge: int | None = 224
    height: int | None = None
    width: int | None = None
    crop_size: tuple[int, int] | None = (224, 224)
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    resample: int = BICUBIC
    rescale_factor: float = 1 / 255

    @classmethod
    def from_processor(cls, raw: dict, *, family: str, side: int) -> FixedImageSettings:
        """The settings of a CLIP / SigLIP ``preprocessor_config.json`` (``raw``; empty: that
        family's defaults for a tower trained on ``side`` x ``side`` images)."""
        clip = family == "clip"
        size = raw.get("size", {"shortest_edge": side} if clip else {"height": side})
        size = size if isinstance(size, dict) else {"shortest_edge": int(size)}
        crop = raw.get("crop_size", side if clip else None)
        if crop is not None and not raw.get("do_center_crop", clip):
            crop = None
        if isinstance(crop, dict):
            crop = (int(crop["height"]), int(crop["width"]))
        mean = OPENAI_CLIP_MEAN if clip else (0.5, 0.5, 0.5)
        std = OPENAI_CLIP_STD if clip else (0.5, 0.5, 0.5)
        edge = size.get("shortest_edge")
        return cls(
            shortest_edge=None if edge is None else int(edge),
            height=None if edge is not None else int(size["height"]),
            width=None if edge is not None else int(size.get("width", size["height"])),
            crop_size=(int(crop), int(crop)) if isinstance(crop, int) else crop,
            image_mean=tuple(raw.get("image_mean", mean)),
            image_std=tuple(raw.get("image_std", std)),
            resample=int(raw.get("resample", BICUBIC)),
            rescale_factor=float(raw.get("rescale_factor", 1 / 255)),
        )

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """The size an image is resized to, before the crop."""
        if self.shortest_edge is None:
            return self.height, self.width
        short, long = sorted((height, width))
        new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
        return (new_short, new_long) if height <= width else (new_long, new_short)

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) of the ``pixel_values`` of a ``height x width`` image."""
        return self.crop_size or self.resized_size(height, width)

    def processed(self, data: Source) -> np.ndarray:
        """[C, H, W] float32 as the HF processor's ``pixel_values`` for one image."""
        return self.processed_image(open_image(data))

    def processed_image(self, img) -> np.ndarray:
        """:meth:`processed` of an opened Pillow image (e.g. a decoded video frame)."""
        h, w = self.resized_size(img.height, img.width)
        x = _resize(img, h, w, self.resample)
        if self.crop_size is not None:
            ch, cw = self.crop_size
            top, left = (h - ch) // 2, (w - cw) // 2
            if top < 0 or left < 0:
                raise ValueError(f"image {h}x{w} is smaller than the crop {ch}x{cw}")
            x = x[:, top : top + ch, left : left + cw]
        return _normalize(x, self.image_mean, self.image_std, self.rescale_factor)


def preprocessor_config(path: str) -> dict:
    """An imported model's ``preprocessor_config.json`` (a directory or ``s3://`` prefix);
    empty when it has none (its family's defaults apply)."""
    import json

    from omni_trainer.storage.blobs import read_bytes

    try:
        return json.loads(read_bytes(f"{path.rstrip('/')}/preprocessor_config.json"))
    except FileNotFoundError:
        return {}


def tower_image_processor(path: str, *, family: str, side: int) -> FixedImageSettings:
    """The image settings of an imported CLIP / SigLIP tower: its ``preprocessor_config.json``,
    else the family's defaults at its trained size."""
    return FixedImageSettings.from_processor(preprocessor_config(path), family=family, side=side)


# -- audio --------------------------------------------------------------------------------------


def _hz_to_mel(f: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear below 1 kHz, logarithmic above."""
    f = np.asarray(f, dtype=np.float64)
    mel = 3.0 * f / 200.0
    log = f >= 1000.0
    return np.where(log, 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) * 27.0 / np.log(6.4), mel)


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    f = 200.0 * m / 3.0
    return np.where(m >= 15.0, 1000.0 * np.exp(np.log(6.4) / 27.0 * (m - 15.0)), f)


def mel_filters(n_mels: int, *, n_fft: int = 400, sampling_rate: int = 16000) -> np.ndarray:
    """[n_fft/2 + 1, n_mels] Slaney-normalized triangular filters from 0 to 8 kHz (Whisper)."""
    fft_freqs = np.linspace(0, sampling_rate // 2, 1 + n_fft // 2)
    mels = np.linspace(_hz_to_mel(0.0), _hz_to_mel(8000.0), n_mels + 2)
    freqs = _mel_to_hz(mels)
    diff = np.diff(freqs)
    slopes = freqs[None, :] - fft_freqs[:, None]
    down = -slopes[:, :-2] / diff[:-1]
    up = slopes[:, 2:] / diff[1:]
    bank = np.maximum(0.0, np.minimum(down, up))
    return bank * (2.0 / (freqs[2 : n_mels + 2] - freqs[:n_mels]))


@dataclass(frozen=True)
class AudioSettings:
    """Whisper's feature extractor settings (HF key names)."""

    feature_size: int = 80
    sampling_rate: int = 16000
    n_fft: int = 400
    hop_length: int = 160
    chunk_length: int | None = 30
    """Seconds every clip is zero-padded (or cut) to; None keeps each clip's own length."""

    def frames(self, num_samples: int) -> int:
        """Feature frames of a clip of ``num_samples`` (after resampling and padding)."""
        n = self.chunk_length * self.sampling_rate if self.chunk_length else num_samples
        return n // self.hop_length

    def log_mel(self, waveform: np.ndarray) -> np.ndarray:
        """[feature_size, frames] float32, as ``WhisperFeatureExtractor`` computes it where torch
        is installed (its default path: float32 ``torch.stft``; the trainer always has torch)."""
        import torch

        x = np.asarray(waveform, dtype=np.float32)
        if self.chunk_length:
            n = self.chunk_length * self.sampling_rate
            x = np.pad(x[:n], (0, max(0, n - len(x))))
        stft = torch.stft(
            torch.from_numpy(np.ascontiguousarray(x)),
            self.n_fft,
            self.hop_length,
            window=torch.hann_window(self.n_fft),
            return_complex=True,
        )
        power = (stft[..., :-1].abs() ** 2).contiguous()
        bank = mel_filters(self.feature_size, n_fft=self.n_fft, sampling_rate=self.sampling_rate)
        log_spec = (torch.from_numpy(bank).to(torch.float32).T @ power).clamp(min=1e-10).log10()
        log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
        return ((log_spec + 4.0) / 4.0).numpy()


def audio_info(data: Source) -> tuple[int, int]:
    """(samples, sample rate) from the header (wav, flac, ogg, mp3 through libsndfile)."""
    import soundfile as sf

    info = sf.info(_file(data))
    return int(info.frames), int(info.samplerate)


def resampled_length(samples: int, rate: int, target: int) -> int:
    """Samples after resampling ``rate`` -> ``target``."""
    return samples if rate == target else round(samples * target / rate)


def read_audio(data: Source, target_rate: int) -> np.ndarray:
    """Mono float32 at ``target_rate`` (linear-interpolation resampling when rates differ)."""
    import soundfile as sf

    wave, rate = sf.read(_file(data), dtype="float32", always_2d=True)
    wave = wave.mean(axis=1)
    if rate != target_rate:
        n = resampled_length(len(wave), rate, target_rate)
        wave = np.interp(np.arange(n) * rate / target_rate, np.arange(len(wave)), wave)
    return wave.astype(np.float32)


# -- video --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VideoSettings:
    """Qwen2-VL's video sampling (HF key names) and the total-pixel budget over all frames."""

    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    temporal_patch_size: int = 2
    total_pixels: int | None = None
    """Pixels over all sampled frames; frames shrink (never below ``min_pixels``) to fit it."""

    def frame_indices(self, total_frames: int, video_fps: float) -> np.ndarray:
        """Indices of the frames to decode (Qwen2-VL ``sample_frames`` with ``fps``)."""
        t = self.temporal_patch_size
        max_frames = math.floor(min(self.max_frames, total_frames) / t) * t
        n = total_frames / video_fps * self.fps
        n = min(max(n, self.min_frames), max_frames, total_frames)
        n = math.floor(n / t) * t
        if n < 1:
            raise ValueError(f"video of {total_frames} frames is shorter than a temporal patch")
        return np.arange(0, total_frames, total_frames / n).astype(np.int32)

    def frame_pixels(self, frames: int, image: ImageSettings) -> int:
        """Max pixels per frame under ``total_pixels`` (or the image budget)."""
        if self.total_pixels is None:
            return image.max_pixels
        return max(image.min_pixels, min(image.max_pixels, self.total_pixels // max(frames, 1)))


def video_info(data: Source) -> tuple[int, float, int, int]:
    """(frames, fps, height, width) from the container's stream metadata (nothing decoded)."""
    import av

    with av.open(_file(data)) as container:
        stream = container.streams.video[0]
        fps = float(stream.average_rate or stream.guessed_rate or 0)
        frames = int(stream.frames)
        if frames <= 0 and stream.duration is not None and stream.time_base is not None:
            frames = round(float(stream.duration * stream.time_base) * fps)
        return frames, fps, int(stream.codec_context.height), int(stream.codec_context.width)


def decode_frames(data: Source, indices: np.ndarray) -> list:
    """The frames at ``indices`` (PIL images, RGB), decoded with PyAV."""
    import av

    wanted = set(int(i) for i in indices)
    out = {}
    with av.open(_file(data)) as container:
        for k, frame in enumerate(container.decode(video=0)):
            if k in wanted:
                out[k] = frame.to_image()
            if k >= max(wanted):
                break
    missing = wanted - set(out)
    if missing:
        raise ValueError(f"video ends before frames {sorted(missing)[:3]}")
    return [out[int(i)] for i in indices]
