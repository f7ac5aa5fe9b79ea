"""``omni generate --image`` on a whole LLaVA against transformers' ``LlavaProcessor`` and
``LlavaForConditionalGeneration.generate(do_sample=False)`` (tiny models, built offline)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml
from typer.testing import CliRunner

from omni_trainer.cli import app

from .hf_models import CHAT_TEMPLATE, save_llava, save_tokenizer
from .test_vlm_import import vlm_job

# llava-hf's template: every image of a turn first, then its text.
LLAVA_TEMPLATE = (
    "{% for m in messages %}{{ m['role'].upper() + ': ' }}"
    "{% for c in m['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}"
    "{% endfor %}{% for c in m['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ c['text'] + ' ' }}{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
# Qwen2's ChatML template as its tokenizer_config.json ships it: string content only (a list of
# parts makes it raise TypeError).
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TEMPLATES = {"chat-parts": LLAVA_TEMPLATE, "chat-string": CHAT_TEMPLATE, "chatml": CHATML_TEMPLATE}
PROMPT = "the quick fox"
NEW_TOKENS = 10


def llava_dir(root, template: str):
    """A LLaVA (CLIP + Llama) whose tokenizer and processor sit beside it; returns
    (directory, reference model, processor)."""
    import transformers

    save_tokenizer(root, chat_template=template)
    tok = transformers.AutoTokenizer.from_pretrained(root)
    model = save_llava(root, "clip", "llama", image_token=tok.convert_tokens_to_ids("<image>"))
    processor = transformers.LlavaProcessor(
        image_processor=transformers.AutoImageProcessor.from_pretrained(root),
        tokenizer=tok,
        patch_size=7,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's class token
        chat_template=template,
    )
    return root, model, processor


def write_image(path, seed: int, size=(45, 37)):
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (*size[::-1], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path


def ours(tmp_path, src, *args: str) -> dict:
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(vlm_job(src)))
    argv = ["generate", job, "--prompt", *args, "--max-new-tokens", NEW_TOKENS, "--json"]
    result = CliRunner().invoke(app, [str(a) for a in argv])
    assert result.exit_code == 0, result.output + str(result.exception)
    return json.loads(result.stdout)


def transformers_greedy(model, processor, inputs) -> tuple[list[int], list[int], list[float]]:
    """(prompt ids, generated ids, log-probability of each) from transformers."""
    ids = inputs["input_ids"]
    stop = [processor.tokenizer.eos_token_id]
    with torch.no_grad():
        full = model.generate(**inputs, do_sample=False, max_new_tokens=NEW_TOKENS,
                              eos_token_id=stop)  # fmt: skip
        logits = model(input_ids=full, pixel_values=inputs["pixel_values"]).logits
    new = full[0, ids.shape[1] :].tolist()
    logprobs = logits[0].log_softmax(-1)
    at = ids.shape[1] - 1
    return ids[0].tolist(), new, [float(logprobs[at + i, t]) for i, t in enumerate(new)]


@pytest.mark.parametrize("mode", ["raw", "chat-parts", "chat-string", "chatml"])
def test_generate_with_images_equals_transformers(tmp_path, mode) -> None:
    template = TEMPLATES.get(mode, LLAVA_TEMPLATE)
    src, model, processor = llava_dir(tmp_path / "src", template)
    images = [write_image(tmp_path / "a.png", 0), write_image(tmp_path / "b.png", 1, (28, 50))]
    pil = [__import__("PIL.Image").Image.open(p) for p in images]
    media = [a for p in images for a in ("--image", p)]
    if mode == "raw":  # placeholders written in the prompt: the processor expands them
        prompt = "<image> the quick <image>\nfox"
        got = ours(tmp_path, src, prompt, *media, "--raw")
        inputs = processor(text=prompt, images=pil, return_tensors="pt")
    elif mode == "chat-parts":  # the template places the images ahead of the text
        got = ours(tmp_path, src, PROMPT, *media)
        parts = [{"type": "image", "path": str(p)} for p in images]
        messages = [{"role": "user", "content": [*parts, {"type": "text", "text": PROMPT}]}]
        inputs = processor.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True,
            return_tensors="pt",
        )  # fmt: skip
        assert processor.tokenizer.decode(inputs["input_ids"][0]).startswith("USER: <image>")
    else:  # a template of strings only: LLaVA's "<image>\n" lines open the user turn
        got = ours(tmp_path, src, PROMPT, *media)
        text = processor.tokenizer.apply_chat_template(
            [{"role": "user", "content": "<image>\n<image>\n" + PROMPT}],
            add_generation_prompt=True, tokenize=False,
        )  # fmt: skip
        inputs = processor(text=text, images=pil, return_tensors="pt")
    want_prompt, want_new, want_logprobs = transformers_greedy(model, processor, inputs)
    assert got["prompt_ids"] == want_prompt
    assert want_prompt.count(model.config.image_token_id) == 2 * 16  # 28x28 crops, 7px patches
    assert got["output_ids"] == want_new and len(want_new) == NEW_TOKENS
    assert got["output_text"] == processor.tokenizer.decode(want_new, skip_special_tokens=True)
    assert got["logprobs"] == pytest.approx(want_logprobs, abs=1e-4)


def test_media_errors_are_named(tmp_path) -> None:
    src, _, _ = llava_dir(tmp_path / "src", LLAVA_TEMPLATE)
    image = write_image(tmp_path / "a.png", 0)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(vlm_job(src)))

    def fails(*args) -> str:
        result = CliRunner().invoke(app, ["generate", str(job), *map(str, args)])
        assert result.exit_code == 2, result.output
        return " ".join(result.output.split())

    assert "--audio: the model has no audio encoder (model.encoders.audio); it takes " in fails(
        "--prompt", "hi", "--audio", tmp_path / "x.wav"
    )
    assert "the prompt has 1 <image> placeholder(s) for 2 --image item(s)" in fails(
        "--prompt", "<image> hi", "--image", image, "--image", image
    )
    assert "the prompt has 0 <image> placeholder(s) for 1 --image item(s)" in fails(
        "--prompt", "hi", "--image", image, "--raw"
    )


def test_generate_with_audio_equals_transformers_parts(tmp_path) -> None:
    """An HF Llama with an imported Whisper encoder and our projector: greedy tokens equal
    transformers' Llama generating from the same embeddings, the audio positions holding
    transformers' WhisperEncoder output through our projector."""
    import copy

    import soundfile as sf
    import transformers

    from omni_trainer.config import load_manifest
    from omni_trainer.data.media import AudioSettings
    from omni_trainer.interop.runtime import single_process_model

    from .hf_models import save_llm, save_whisper, text_job

    llm = save_llm(tmp_path / "llm", "llama")
    save_tokenizer(llm)
    tok = transformers.AutoTokenizer.from_pretrained(llm)
    tok.add_special_tokens({"additional_special_tokens": ["<audio>"]})
    tok.save_pretrained(llm)
    whisper = save_whisper(tmp_path / "whisper")  # 16 mels, 12 positions: 24 frames at most
    doc = text_job({"hf": str(llm)}, seed=3)
    doc["spec"]["trainer"]["model"]["encoders"] = {"audio": {"hf": str(tmp_path / "whisper")}}
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    t = np.arange(3840) / 16000  # 0.24 s: 24 mel frames, as many as WhisperEncoder takes
    wave = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    sf.write(tmp_path / "a.wav", wave, 16000)
    argv = ["generate", job, "--prompt", "hello <audio> world", "--audio", tmp_path / "a.wav",
            "--raw", "--max-new-tokens", NEW_TOKENS, "--json"]  # fmt: skip
    result = CliRunner().invoke(app, [str(a) for a in argv])
    assert result.exit_code == 0, result.output + str(result.exception)
    got = json.loads(result.stdout)

    audio_id = tok.convert_tokens_to_ids("<audio>")
    ids = torch.tensor([got["prompt_ids"]])
    where = (ids[0] == audio_id).nonzero()[:, 0]
    assert (
        len(where) == 12 and ids[0].tolist() == tok("hello " + "<audio>" * 12 + " world").input_ids
    )
    cfg = load_manifest(job).spec.trainer
    with single_process_model(cfg, checkpoint=None) as (model, _):
        projector = copy.deepcopy(model.projectors["audio"])
    mel = torch.from_numpy(AudioSettings(16, chunk_length=None).log_mel(wave))[None]
    reference = transformers.LlamaForCausalLM.from_pretrained(llm).eval()
    with torch.no_grad():
        features = projector(whisper(mel).last_hidden_state[0])
        text = reference.get_input_embeddings()(ids)
        new, silent = (
            reference.generate(
                inputs_embeds=text.index_copy(1, where, f[None]), do_sample=False,
                attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                eos_token_id=[tok.eos_token_id],
            )[0].tolist()
            for f in (features, features * 0)
        )  # fmt: skip
    assert got["output_ids"] == new and len(new) == NEW_TOKENS
    assert silent != new  # the audio decides the tokens


def test_a_failing_template_is_one_line(tmp_path) -> None:
    src, _, _ = llava_dir(tmp_path / "src", "{{ messages[0]['content'] + undefined_call() }}")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(vlm_job(src)))
    result = CliRunner().invoke(app, ["generate", str(job), "--prompt", "hi"])
    assert result.exit_code == 2 and result.exception is not None, result.output
    assert result.output.startswith("error: the chat template fails on a user turn given as a ")
    assert "pass --raw" in result.output and "Traceback" not in result.output
