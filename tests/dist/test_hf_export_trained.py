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

from ..unit.interop.hf_models import save_llm, save_tokenizer
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
