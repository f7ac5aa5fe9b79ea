"""The synthetic source: shapes, lengths, determinism, and that it is learnable."""

from __future__ import annotations

import numpy as np
import pytest

from omni_trainer.data import FIRST_TEXT_ID, MediaGeometry, SyntheticSource, SyntheticSourceConfig
from omni_trainer.data.config import PRESETS
from omni_trainer.data.synthetic import bigram_table, class_token, draw_length


def source(modality: str, seq_length: int = 256, seed: int = 0, **kw: object) -> SyntheticSource:
    cfg = SyntheticSourceConfig.model_validate(
        {"kind": "synthetic", "name": modality, "modality": modality, **kw}
    )
    return SyntheticSource(
        cfg,
        source_index=2,
        seed=seed,
        vocab_size=256,
        geometry=MediaGeometry(),
        seq_length=seq_length,
    )


def test_preset_lengths_have_the_paper_means() -> None:
    rng = np.random.default_rng(0)
    for name, want in [("openimages", 3800), ("refcocog", 1400), ("librispeech", 340)]:
        lengths = [draw_length(PRESETS[name][1], 1.0, rng) for _ in range(4000)]
        assert np.mean(lengths) == pytest.approx(want, rel=0.05), name
    text = [draw_length(PRESETS["longtext"][1], 1.0, rng) for _ in range(4000)]
    assert np.mean(text) == pytest.approx(6000, rel=0.1)
    assert np.percentile(text, 99) > 4 * np.percentile(text, 50)  # heavy tail


def test_image_audio_video_shapes(geometry: MediaGeometry) -> None:
    p = geometry.patch_size
    aspects = []
    src = source("image", preset="openimages", lengthScale=0.05)
    for i in range(60):
        s = src.get(i)
        _, h, w = s.media.shape
        assert h % p == 0 and w % p == 0
        if i < 5:
            pixels = src.load_media(s.media)
            assert pixels.shape == s.media.shape and pixels.dtype == np.float32
            assert pixels.nbytes == s.media.nbytes
        assert s.media_tokens == (h // p) * (w // p)
        assert s.num_tokens <= 256 and len(s.text) >= 2
        assert s.text[0] == class_token(int(s.text[0]) - 1)
        assert 1 <= s.text[0] < FIRST_TEXT_ID <= s.text[1:].min()
        aspects.append(h / w)
    assert min(aspects) < 0.9 and max(aspects) > 1.1  # dynamic aspect ratio
    audio = source("audio", preset="librispeech", lengthScale=0.2)
    a = audio.get(3)
    assert a.media.shape[1] == 80 and a.media.shape[0] % geometry.audio_subsampling == 0
    assert a.media_tokens == a.media.shape[0] // geometry.audio_subsampling
    assert audio.load_media(a.media).shape == a.media.shape
    video = source("video", length={"mean": 200, "sigma": 0.3})
    v = video.get(1)
    t, c, h, w = v.media.shape
    assert c == 3 and t >= 2 and v.media_tokens == t * (h // p) * (w // p)
    assert video.load_media(v.media).shape == v.media.shape
    big = source("image", seq_length=64, preset="openimages").get(0)
    assert big.num_tokens <= 64  # media never exceeds seq_length


def test_random_access_is_deterministic() -> None:
    a, b = (
        source("image", preset="refcocog", lengthScale=0.05),
        source("image", preset="refcocog", lengthScale=0.05),
    )
    for i in (5, 0, 5):
        x, y = a.get(i), b.get(i)
        assert x.sample_id == f"image/{i:06d}" and x.key == (2, i)
        assert x.media == y.media and (x.media.source, x.media.index) == x.key
        np.testing.assert_array_equal(a.load_media(x.media), b.load_media(y.media))
        np.testing.assert_array_equal(x.text, y.text)
    other = source("image", seed=1, preset="refcocog", lengthScale=0.05).get(5)
    assert not np.array_equal(other.text, a.get(5).text)


def test_text_follows_the_sparse_bigram_table() -> None:
    succ = bigram_table(0, 256)
    s = source("text", preset="longtext", lengthScale=0.1).get(0)
    assert len(s.text) > 50
    pairs = zip(s.text[:-1], s.text[1:], strict=True)
    assert all(nxt in succ[cur] for cur, nxt in pairs)


def test_media_class_is_recoverable_from_the_pixels() -> None:
    """Nearest-centroid on mean colour separates classes, so the class token is learnable."""
    src = source("image", preset="refcocog", lengthScale=0.03)
    feats, labels = [], []
    for i in range(200):
        s = src.get(i)
        feats.append(src.load_media(s.media).mean(axis=(1, 2)))
        labels.append(int(s.text[0]))
    x, y = np.array(feats), np.array(labels)
    train, test = slice(0, 120), slice(120, 200)
    classes = np.unique(y[train])
    centroids = np.stack([x[train][y[train] == c].mean(0) for c in classes])
    pred = classes[np.argmin(((x[test][:, None] - centroids[None]) ** 2).sum(-1), axis=1)]
    assert (pred == y[test]).mean() > 0.8


def test_media_is_a_small_reference_generated_only_when_loaded(monkeypatch) -> None:
    """``get`` draws shape and text only; pixels come from ``load_media``, from the key alone."""
    import pickle

    src = source("image", preset="openimages", lengthScale=0.05)
    calls = []
    image = SyntheticSource._image
    monkeypatch.setattr(
        SyntheticSource, "_image", lambda self, *a: calls.append(a) or image(self, *a)
    )
    s = src.get(7)
    assert not calls and s.media.nbytes > 10_000
    assert len(pickle.dumps(s.media)) < 200
    pixels = src.load_media(pickle.loads(pickle.dumps(s.media)))
    assert len(calls) == 1 and pixels.shape == s.media.shape
    # another process with the same config regenerates the same pixels
    np.testing.assert_array_equal(
        source("image", preset="openimages", lengthScale=0.05).load_media(s.media), pixels
    )


def test_vocab_too_small_is_rejected() -> None:
    with pytest.raises(ValueError, match="vocab_size must be >="):
        bigram_table(0, 32)
