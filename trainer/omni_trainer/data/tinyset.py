"""``omni data make-tiny``: a small real-format LLaVA dataset, its tokenizer, made locally.

Images are drawn with Pillow (shapes of several colours and counts) with captions and
question/answer conversations; audio clips are tones synthesised with numpy and written with
soundfile. The tokenizer is a byte-level BPE trained on the dataset's own text, with a ChatML
chat template, saved as Hugging Face files. Everything is a pure function of the seed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence

import numpy as np

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML as Qwen2 ships it, without the default system message."""
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
"""Meta Llama 3's stock template (no ``{% generation %}`` markers)."""
MEDIA_TOKENS = ("<image>", "<audio>", "<video>")
"""The placeholders, special tokens of the tokenizer (export and generation mark media by them;
training splits the text at them and never tokenizes them)."""
TEMPLATES = {
    "chatml": (CHATML_TEMPLATE, ["<|im_start|>", "<|im_end|>", "<|endoftext|>"], "<|im_end|>"),
    "llama3": (
        LLAMA3_TEMPLATE,
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "<|eot_id|>",
    ),
}


def train_tokenizer(
    texts: Iterable[str], out_dir: str, *, template: str = "chatml", vocab_size: int = 400
) -> None:
    """Train a byte-level BPE on ``texts`` and save it with a chat template as HF files.

    Args:
        texts: the corpus.
        out_dir: where tokenizer.json and tokenizer_config.json go.
        template: ``chatml`` or ``llama3``.
        vocab_size: target size, special tokens included (the media placeholders come on top).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    chat_template, specials, eos = TEMPLATES[template]
    specials = [*specials, *MEDIA_TOKENS]  # one token each, as LLaVA's tokenizer has <image>
    vocab_size += len(MEDIA_TOKENS)  # the same merges as without them
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=eos,
        pad_token=eos,
        bos_token="<|begin_of_text|>" if template == "llama3" else None,
        chat_template=chat_template,
    )
    fast.save_pretrained(out_dir)


COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220),
           "yellow": (230, 210, 40)}  # fmt: skip
SHAPES = ("circle", "square", "triangle")
NUMBERS = ("one", "two", "three", "four")
TONES = {"low": 220.0, "middle": 440.0, "high": 880.0}


def _draw(rng: np.random.Generator, size: tuple[int, int], colour: str, shape: str, count: int):
    from PIL import Image, ImageDraw

    img = Image.new("RGB", size, (245, 245, 245))
    draw = ImageDraw.Draw(img)
    w, h = size
    r = min(w, h) // 6
    for k in range(count):
        cx = int((k + 0.5) * w / count)
        cy = int(rng.uniform(r, h - r))
        box = (cx - r, cy - r, cx + r, cy + r)
        if shape == "circle":
            draw.ellipse(box, fill=COLOURS[colour])
        elif shape == "square":
            draw.rectangle(box, fill=COLOURS[colour])
        else:
            draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=COLOURS[colour])
    return img


def write_clip(path: str, *, frames: int, fps: int, size: int, colour: str) -> None:
    """An mp4 (MPEG-4 part 2, PyAV) of a ``colour`` square crossing a light background."""
    import av

    with av.open(path, mode="w") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        side = size // 4
        for k in range(frames):
            arr = np.full((size, size, 3), 245, dtype=np.uint8)
            x = (size - side) * k // max(frames - 1, 1)
            arr[size // 2 - side // 2 : size // 2 + side // 2, x : x + side] = COLOURS[colour]
            for packet in stream.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


def _plural(shape: str, count: int) -> str:
    return shape if count == 1 else shape + "s"


def make_tiny_dataset(
    out: str,
    *,
    images: int = 96,
    audio: int = 24,
    seed: int = 0,
    corrupt: Sequence[int] = (),
    missing: Sequence[int] = (),
    size: int | None = None,
    videos: int = 0,
) -> dict[str, str]:
    """Write ``out/{images,audio}/``, ``out/train.json`` (LLaVA format) and ``out/tokenizer/``.

    Args:
        out: the dataset directory.
        images: image samples (captions and Q/A about shapes, colours, counts).
        audio: audio samples (which tone is played).
        seed: everything derives from it.
        corrupt: image sample indices whose file is overwritten with garbage after writing.
        missing: image sample indices whose file is deleted after writing.
        size: draw every image ``size`` x ``size`` (default: small mixed sizes, 84-140 pixels).
        videos: video samples (which colour the moving square is), 1-2 s mp4 clips at 8 fps.

    Returns:
        ``{"annotations", "media_root", "tokenizer"}`` paths.
    """
    rng = np.random.default_rng(seed)
    os.makedirs(os.path.join(out, "images"), exist_ok=True)
    os.makedirs(os.path.join(out, "audio"), exist_ok=True)
    # One generator in this order: the images, then the audio, then the videos.
    records = _image_records(out, rng, count=images, size=size)
    records += _audio_records(out, rng, count=audio)
    records += _video_records(out, rng, count=videos)
    for i in corrupt:
        with open(os.path.join(out, records[i]["image"]), "wb") as f:
            f.write(b"\x00not an image\x00" * 8)
    for i in missing:
        os.remove(os.path.join(out, records[i]["image"]))
    ann = os.path.join(out, "train.json")
    with open(ann, "w") as f:
        json.dump(records, f, indent=1)
    texts = [m["value"] for r in records for m in r["conversations"]]
    train_tokenizer(texts * 4, os.path.join(out, "tokenizer"))
    return {"annotations": ann, "media_root": out, "tokenizer": os.path.join(out, "tokenizer")}


def _image_records(
    out: str, rng: np.random.Generator, *, count: int, size: int | None
) -> list[dict]:
    """Drawn pictures with, by turns, a caption, a two-turn Q/A, or a question on the shape."""
    records: list[dict] = []
    for i in range(count):
        colour = str(rng.choice(list(COLOURS)))
        shape = str(rng.choice(SHAPES))
        n = int(rng.integers(1, 5))
        wh = (int(rng.choice([84, 112, 140])), int(rng.choice([84, 112])))
        wh = (size, size) if size else wh
        name = f"images/{i:05d}.png" if i % 2 else f"images/{i:05d}.jpg"
        _draw(rng, wh, colour, shape, n).save(os.path.join(out, name))
        caption = f"{NUMBERS[n - 1]} {colour} {_plural(shape, n)}"
        kind = i % 3
        if kind == 0:
            conv = [
                {"from": "human", "value": "<image>\nDescribe the picture."},
                {"from": "gpt", "value": f"There are {caption}."},
            ]
        elif kind == 1:
            conv = [
                {"from": "human", "value": "<image>\nWhat colour are the shapes?"},
                {"from": "gpt", "value": f"They are {colour}."},
                {"from": "human", "value": "How many are there?"},
                {"from": "gpt", "value": f"There are {NUMBERS[n - 1]}."},
            ]
        else:
            conv = [
                {"from": "human", "value": "What shape is in the picture?\n<image>"},
                {"from": "gpt", "value": f"The shape is a {shape}."},
            ]
        records.append({"id": f"img-{i:05d}", "image": name, "conversations": conv})
    return records


def _audio_records(out: str, rng: np.random.Generator, *, count: int) -> list[dict]:
    """Noisy tones of 0.5-1 s at 16 kHz, asked which tone they are."""
    import soundfile as sf

    records: list[dict] = []
    for i in range(count):
        tone = str(rng.choice(list(TONES)))
        seconds = float(rng.choice([0.5, 0.75, 1.0]))
        t = np.arange(int(16000 * seconds)) / 16000
        wave = 0.5 * np.sin(2 * np.pi * TONES[tone] * t) + 0.01 * rng.standard_normal(len(t))
        name = f"audio/{i:05d}.wav"
        sf.write(os.path.join(out, name), wave.astype(np.float32), 16000)
        conv = [
            {"from": "human", "value": "<audio>\nWhich tone is this?"},
            {"from": "gpt", "value": f"It is a {tone} tone."},
        ]
        records.append({"id": f"aud-{i:05d}", "audio": name, "conversations": conv})
    return records


def _video_records(out: str, rng: np.random.Generator, *, count: int) -> list[dict]:
    """Clips of a moving square, asked its colour."""
    if count:
        os.makedirs(os.path.join(out, "videos"), exist_ok=True)
    records: list[dict] = []
    for i in range(count):
        colour = str(rng.choice(list(COLOURS)))
        name = f"videos/{i:05d}.mp4"
        write_clip(os.path.join(out, name), frames=int(rng.choice([8, 16])), fps=8, size=112,
                   colour=colour)  # fmt: skip
        conv = [
            {"from": "human", "value": "<video>\nWhat colour is the moving square?"},
            {"from": "gpt", "value": f"It is {colour}."},
        ]
        records.append({"id": f"vid-{i:05d}", "video": name, "conversations": conv})
    return records
