"""Video in conversations: frames sampled like Qwen2-VL from container metadata, each encoded by
the ViT as an image, the ``<video>`` placeholder expanded to all of their positions."""

from __future__ import annotations

import numpy as np

from omni_trainer.data import DataConfig, MediaGeometry
from omni_trainer.data.loader import MultimodalStream
from omni_trainer.data.media import decode_frames, video_info
from omni_trainer.data.tinyset import make_tiny_dataset


def test_video_frames_become_image_spans(tmp_path):
    paths = make_tiny_dataset(str(tmp_path), images=1, audio=0, videos=2)
    cfg = DataConfig.model_validate(
        {
            "seqLength": 512,
            "globalBatchSize": 1,
            "microBatchSize": 1,
            "sources": [
                {
                    "kind": "conversations",
                    "name": "v",
                    "url": paths["annotations"],
                    "modality": "image",
                }
            ],
            "media": {
                "fps": 4,
                "maxFrames": 8,
                "minPixels": 14 * 14 * 4,
                "maxPixels": 14 * 14 * 16,
                "videoTotalPixels": 14 * 14 * 96,
            },
        }
    )
    stream = MultimodalStream(
        cfg, seed=0, vocab_size=512, geometry=MediaGeometry(n_mels=16), tokenizer=paths["tokenizer"]
    )
    src = stream.sources[0]
    for index in (1, 2):
        sample = src.get(index)
        clip = tmp_path / f"videos/{index - 1:05d}.mp4"
        total, fps, _, _ = video_info(str(clip))
        want = src.video.frame_indices(total, fps)
        assert len(sample.spans) == len(want) >= 2 and {sp.modality for sp in sample.spans} == {
            "image"
        }
        first = sample.spans[0]
        for a, b in zip(sample.spans, sample.spans[1:], strict=False):
            assert b.offset == a.offset + a.tokens  # one contiguous <video> expansion
        assert sum(sp.tokens for sp in sample.spans) <= 96  # the total pixel budget
        assert not sample.targets[first.offset : first.offset + len(want) * first.tokens].any()
        frames = decode_frames(str(clip), want)
        settings = src._frame_settings(len(want))
        for sp, frame in zip(sample.spans, frames, strict=True):
            got = src.load_media(sp.ref)
            assert got.shape == sp.ref.shape
            np.testing.assert_array_equal(got, settings.resized_image(frame))
