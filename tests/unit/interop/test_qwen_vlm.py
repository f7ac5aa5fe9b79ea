"""``model.hf``: a whole Qwen2.5-VL (tower + merger, Qwen2 LLM with M-RoPE) from one field,
against transformers' ``Qwen2_5_VLForConditionalGeneration``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omni_trainer.config import parse_manifest
from omni_trainer.data.media import ImageSettings
from omni_trainer.data.sample import media_geometry
from omni_trainer.interop.generate import logits
from omni_trainer.interop.qwen2_5_vl import mrope_positions
from omni_trainer.interop.runtime import single_process_model

from .hf_models import QWEN_TOKENS, qwen2vl_patches, save_qwen2_5_vl
from .test_vlm_import import _close, vlm_job

IMAGE = QWEN_TOKENS["image"]


def test_mrope_positions_follow_get_rope_index() -> None:
    """Text counts on; an image of 2 x 3 tokens starting at position 2 spans rows 2..3 and
    columns 2..4 at time 2; the text after it resumes at 2 + max(2, 3) = 5."""
    pos = mrope_positions(10, [(2, 2, 3)])
    assert pos[:, :2].tolist() == [[0, 1]] * 3
    assert pos[0, 2:8].tolist() == [2] * 6
    assert pos[1, 2:8].tolist() == [2, 2, 2, 3, 3, 3]
    assert pos[2, 2:8].tolist() == [2, 3, 4, 2, 3, 4]
    assert pos[:, 8:].tolist() == [[5, 6]] * 3


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen_vlm")
    return path, save_qwen2_5_vl(path)


def test_qwen_vlm_logits_equal_transformers(qwen) -> None:
    path, ref = qwen
    cfg = parse_manifest(vlm_job(path)).spec.trainer
    llm, image = cfg.model.llm, cfg.model.encoders.image
    assert llm.mrope_section == [2, 3, 3] and llm.qkv_bias and image.output_size == 64
    torch.manual_seed(3)
    big, small = torch.randn(3, 40, 56), torch.randn(3, 24, 32)  # 5 x 7 and 3 x 4 tokens
    text_ids = torch.randint(0, 290, (1, 12))
    ids = torch.cat(
        [text_ids[:, :3], torch.full((1, 35), IMAGE), text_ids[:, 3:8],
         torch.full((1, 12), IMAGE), text_ids[:, 8:]], dim=1,
    )  # fmt: skip
    with single_process_model(cfg, checkpoint=None) as (model, _), torch.no_grad():
        vocab = llm.vocab_size
        assert isinstance(model.projectors["image"], torch.nn.Identity)
        ours_text = logits(model, text_ids)[..., :vocab]
        where = (ids[0] == IMAGE).nonzero()[:, 0]
        ours_image = logits(model, ids, images=[big, small], image_positions=where)[..., :vocab]
    s = ImageSettings(patch_size=4, merge_size=2)
    pixels = torch.cat(
        [
            torch.from_numpy(np.ascontiguousarray(qwen2vl_patches(x.numpy(), s)[0]))
            for x in (big, small)
        ]
    )
    grids = torch.tensor([[1, 10, 14], [1, 6, 8]])
    with torch.no_grad():
        want_text = ref(input_ids=text_ids).logits
        kwargs = dict(input_ids=ids, image_grid_thw=grids, mm_token_type_ids=(ids == IMAGE).int())
        want_image = ref(pixel_values=pixels, **kwargs).logits
        flat = ref(pixel_values=pixels, **{**kwargs, "mm_token_type_ids": None}).logits
    _close(ours_text, want_text)
    _close(ours_image, want_image)
    assert (want_image - flat).abs().max() > 1e-3  # the 3D positions matter in this test


def test_greedy_text_generation_equals_transformers(qwen) -> None:
    from omni_trainer.interop.generate import greedy

    path, ref = qwen
    cfg = parse_manifest(vlm_job(path)).spec.trainer
    prompt = [5, 17, 42, 99, 7]
    with single_process_model(cfg, checkpoint=None) as (model, _):
        ours, _ = greedy(model.llm_chunks[0], prompt, max_new_tokens=6, stop=set(), vocab_size=512)
    with torch.no_grad():
        want = ref.generate(
            torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False
        )
    assert ours == want[0, len(prompt) :].tolist()


def test_batch_positions_restart_per_sample_and_place_images() -> None:
    from omni_trainer.data.packing import MediaItem, MicroBatch
    from omni_trainer.data.sample import MediaRef
    from omni_trainer.interop.qwen2_5_vl import batch_positions

    seg = np.array([[0, 0, 0, 0, 0, 1, 1, 1, -1, -1]], dtype=np.int32)
    zeros = np.zeros(seg.shape, dtype=np.int64)
    image = MediaItem("image", 0, 6, 2, MediaRef(0, 0, (3, 8, 16)), "b")  # 1 x 2 tokens
    mb = MicroBatch(zeros, zeros, zeros.astype(np.float32), seg, zeros, [image], ["a", "b"])
    pos = batch_positions(mb, side=8)
    assert pos.shape == (3, 1, 10)
    assert pos[:, 0, :5].tolist() == [[0, 1, 2, 3, 4]] * 3  # sample a: text only
    assert pos[:, 0, 5:8].tolist() == [[0, 1, 1], [0, 1, 1], [0, 1, 2]]  # b: text, 1x2 image
    assert pos[:, 0, 8:].tolist() == [[0, 0]] * 3  # padding
    wrong = MediaItem("image", 0, 6, 3, MediaRef(0, 0, (3, 8, 16)), "b")
    bad = MicroBatch(zeros, zeros, zeros.astype(np.float32), seg, zeros, [wrong], [])
    with pytest.raises(ValueError, match="b: an image of 1 x 2 merged tokens holds 3 positions"):
        batch_positions(bad, side=8)


def test_context_parallel_is_refused_with_mrope(qwen) -> None:
    from omni_trainer.config import ManifestError

    doc = vlm_job(qwen[0])
    doc["spec"]["trainer"]["parallelism"] = {"context": 2}
    with pytest.raises(ManifestError, match=r"parallelism\.context: the LLM's M-RoPE"):
        parse_manifest(doc)


def test_import_export_round_trip(qwen, tmp_path) -> None:
    """import -> export -> transformers loads it -> logits equal the original's on text and
    image+text (the merger's 3D positions included)."""
    import transformers
    import yaml

    from .test_export_generate import cli

    path, ref = qwen
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(vlm_job(path)))
    out = tmp_path / "exported"
    printed = cli("export", job, "--out", out, "--initial-weights")
    assert "exported initial weights" in printed
    assert {"model.safetensors", "config.json", "preprocessor_config.json"} <= {
        p.name for p in out.iterdir()
    }
    back = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(out).eval()
    torch.manual_seed(4)
    img = torch.randn(3, 24, 40)
    pixels = torch.from_numpy(
        np.ascontiguousarray(qwen2vl_patches(img.numpy(), ImageSettings(patch_size=4))[0])
    )
    ids = torch.cat([torch.tensor([[5, 6]]), torch.full((1, 15), IMAGE), torch.tensor([[7, 8]])], 1)
    kwargs = dict(
        input_ids=ids,
        pixel_values=pixels,
        image_grid_thw=torch.tensor([[1, 6, 10]]),
        mm_token_type_ids=(ids == IMAGE).int(),
    )
    with torch.no_grad():
        for model_kwargs in (kwargs, {"input_ids": ids[:, :2]}):
            torch.testing.assert_close(
                back(**model_kwargs).logits, ref(**model_kwargs).logits, rtol=0, atol=1e-5
            )


def test_images_are_wrapped_in_vision_start_and_end(tmp_path) -> None:
    """A whole Qwen2.5-VL renders each image as its processor does: <|vision_start|>, the
    image's positions, <|vision_end|> (ids from its config.json); the text and M-RoPE treat
    the two as text."""
    import json

    from transformers import AutoTokenizer

    from omni_trainer.config import TrainerConfig
    from omni_trainer.data.chat import ChatRenderer

    from .hf_models import save_tokenizer

    path = tmp_path / "qwen"
    save_qwen2_5_vl(path)
    save_tokenizer(path, extra_special=("<|vision_start|>", "<|vision_end|>"))
    tok = AutoTokenizer.from_pretrained(path)
    start, end = tok.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])
    config = json.loads((path / "config.json").read_text())
    config |= {"vision_start_token_id": start, "vision_end_token_id": end}
    (path / "config.json").write_text(json.dumps(config))
    trainer = vlm_job(path)["spec"]["trainer"]
    geometry = media_geometry(TrainerConfig.model_validate(trainer).model)
    assert geometry.image_wrap == (start, end)
    rendered = ChatRenderer(tok, image_wrap=geometry.image_wrap).render(
        [{"from": "human", "value": "<image>\nwhat is it"}, {"from": "gpt", "value": "a fox"}],
        media=[("image", 6)],
    )
    ((modality, offset, n),) = rendered.spans
    assert (modality, n) == ("image", 6)
    assert rendered.tokens[offset - 1] == start and rendered.tokens[offset + n] == end
    assert not rendered.targets[offset - 1 : offset + n + 1].any()
    messages = [{"from": "human", "value": "<image>\nhi"}, {"from": "gpt", "value": "ok"}]
    plain = ChatRenderer(tok).render(messages, [("image", 6)])
    assert start not in plain.tokens.tolist()  # tower-only imports and other models: no wrap


def test_generate_with_an_image_equals_transformers(tmp_path) -> None:
    """``omni generate --image`` on a whole Qwen2.5-VL: the image sized by the model's own
    processor, its positions between <|vision_start|> and <|vision_end|>, on M-RoPE's 3D
    positions; prompt ids, greedy tokens and their log-probabilities equal transformers'."""
    import json

    import transformers
    from PIL import Image

    from .hf_models import save_tokenizer
    from .test_generate_media import NEW_TOKENS, ours, write_image

    path = tmp_path / "qwen"
    save_qwen2_5_vl(path)
    save_tokenizer(path, extra_special=("<|vision_start|>", "<|vision_end|>"))
    tok = transformers.AutoTokenizer.from_pretrained(path)
    marks = tok.convert_tokens_to_ids(["<image>", "<|vision_start|>", "<|vision_end|>"])
    config = json.loads((path / "config.json").read_text())
    keys = ("image_token_id", "vision_start_token_id", "vision_end_token_id")
    config |= dict(zip(keys, marks, strict=True))
    (path / "config.json").write_text(json.dumps(config))
    image = write_image(tmp_path / "a.png", 0)
    got = ours(tmp_path, path, "<image> the quick fox", "--image", image, "--raw")

    pixels = transformers.AutoImageProcessor.from_pretrained(path)(
        images=[Image.open(image)], return_tensors="pt"
    )
    n = int(pixels["image_grid_thw"].prod()) // 4  # 2x2 patches per token
    ids = torch.tensor(
        [tok(f"<|vision_start|>{'<image>' * n}<|vision_end|> the quick fox").input_ids]
    )
    assert got["prompt_ids"] == ids[0].tolist() and n > 1
    ref = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(path).eval()
    stop = [tok.eos_token_id, ref.generation_config.eos_token_id]
    with torch.no_grad():
        full = ref.generate(
            input_ids=ids, **pixels, mm_token_type_ids=(ids == marks[0]).int(), do_sample=False,
            max_new_tokens=NEW_TOKENS, eos_token_id=stop,
        )  # fmt: skip
        logits = ref(input_ids=full, **pixels, mm_token_type_ids=(full == marks[0]).int()).logits
    new = full[0, ids.shape[1] :].tolist()
    assert got["output_ids"] == new and new
    logprobs = logits[0, ids.shape[1] - 1 :].log_softmax(-1)
    want = [float(logprobs[i, t]) for i, t in enumerate(new)]
    assert got["logprobs"] == pytest.approx(want, abs=1e-4)
