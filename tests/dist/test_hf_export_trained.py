"""Train an imported model 5 steps at pp2 (tied embeddings: two copies across the stages), then
``omni export`` its checkpoint: transformers' loss on a batch equals ours (the checkpoint loaded
into one process), and training really moved the weights."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import yaml

from ..unit.interop.hf_models import IMAGE_TOKEN, save_llava, save_llm, save_tokenizer
from ..unit.interop.test_export_generate import our_logits, write_job

pytestmark = pytest.mark.dist


def omni(*args) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "omni_trainer.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def test_export_after_pp2_training_matches_ours(tmp_path) -> None:
    import transformers

    src = save_llm(tmp_path / "src", "qwen2", tie_word_embeddings=True)
    save_tokenizer(src)
    job = write_job(
        tmp_path / "job.yaml",
        {"hf": str(src)},
        parallelism={"pipeline": 2},
        optimizer={"lr": 0.01},
        train={"steps": 5},
        checkpoint={"path": str(tmp_path / "ckpt"), "intervalSteps": 5},
    )
    omni("train", job, "--nproc", 2, "--summary", tmp_path / "s.json")
    assert json.loads((tmp_path / "s.json").read_text())["steps"] == 5
    out = tmp_path / "exported"
    assert "exported checkpoint step 5" in omni("export", job, "--out", out)

    tokens = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(5))
    ours = our_logits(job, tokens)
    ours_loss = F.cross_entropy(ours[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    with torch.no_grad():
        theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        their_loss = theirs(input_ids=tokens, labels=tokens).loss
        before = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
        before_loss = before(input_ids=tokens, labels=tokens).loss
    assert float(their_loss) == pytest.approx(float(ours_loss), abs=1e-5)
    assert abs(float(their_loss) - float(before_loss)) > 1e-3  # the weights trained


def test_llava_export_after_pp2_training_matches_ours(tmp_path) -> None:
    """A whole LLaVA (SigLIP + projector + tied Qwen2) trained 5 steps at pp2 on images and
    text, exported: transformers' loss on an image + text batch equals ours."""
    import transformers

    from omni_trainer.config import load_manifest
    from omni_trainer.interop.generate import logits
    from omni_trainer.interop.runtime import single_process_model

    from ..unit.interop.test_llava_export import image_batch
    from .test_hf_multimodal_layouts import job as multimodal_job

    src = tmp_path / "src"
    save_llava(src, "siglip", "qwen2", tie_word_embeddings=True)
    save_tokenizer(src)  # omni train checks the job's tokenizer, the model's own
    doc = multimodal_job({"hf": str(src)}, pipeline=2)
    trainer = doc["spec"]["trainer"]
    trainer["train"] = {"steps": 5}
    trainer["optimizer"]["lr"] = 0.01
    trainer["checkpoint"] = {"path": str(tmp_path / "ckpt"), "intervalSteps": 5}
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    omni("train", manifest, "--nproc", 2, "--summary", tmp_path / "s.json")
    assert json.loads((tmp_path / "s.json").read_text())["steps"] == 5
    out = tmp_path / "exported"
    assert "exported checkpoint step 5" in omni("export", manifest, "--out", out)

    ids, pixels = image_batch()
    cfg = load_manifest(manifest).spec.trainer
    where = (ids[0] == IMAGE_TOKEN).nonzero()[:, 0]
    with single_process_model(cfg, checkpoint=None) as (model, step), torch.no_grad():
        assert step == 5
        ours = logits(model, ids, images=list(pixels), image_positions=where)
    ours = ours[..., : cfg.model.llm.vocab_size]
    labels = ids.masked_fill(ids == IMAGE_TOKEN, -100)
    ours_loss = F.cross_entropy(ours[0, :-1], labels[0, 1:], ignore_index=-100)
    losses = []
    for path in (out, src):
        model = transformers.LlavaForConditionalGeneration.from_pretrained(path).eval()
        with torch.no_grad():
            losses.append(float(model(input_ids=ids, pixel_values=pixels, labels=labels).loss))
    assert losses[0] == pytest.approx(float(ours_loss), abs=1e-5)
    assert abs(losses[0] - losses[1]) > 1e-4  # the weights trained: 10x the tolerance above
    from safetensors.torch import load_file

    before, after = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    assert before.keys() == after.keys()
    for name in (
        "multi_modal_projector.linear_1.weight",
        "vision_tower.encoder.layers.0.mlp.fc1.weight",
    ):
        assert not torch.equal(before[name], after[name]), name  # tower and projector trained too
