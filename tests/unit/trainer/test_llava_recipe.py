"""examples/llava-stage{1,2}.yaml: LLaVA's two stages run as shipped (a tiny HF Llama stands in
for ``models/llm``): stage 1 moves only the projector, stage 2 starts from stage 1's weights and
trains everything."""

from __future__ import annotations

import torch
import yaml

from omni_trainer.config import load_manifest
from omni_trainer.interop.runtime import single_process_model
from omni_trainer.launch import run_worker

from ...conftest import EXAMPLES
from ..interop.hf_models import save_llm, save_tokenizer

STEPS = 2


def weights(job) -> dict[str, torch.Tensor]:
    with single_process_model(job.spec.trainer, checkpoint=None) as (model, step):
        assert step is not None
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_llava_two_stages(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    save_tokenizer(save_llm(tmp_path / "models" / "llm", "llama"))
    for stage in ("llava-stage1.yaml", "llava-stage2.yaml"):  # as shipped, with smaller steps
        doc = yaml.safe_load((EXAMPLES / stage).read_text())
        doc["spec"]["trainer"]["data"].update(globalBatchSize=4, microBatchSize=2)
        doc["spec"]["trainer"]["checkpoint"]["intervalSteps"] = STEPS
        (tmp_path / stage).write_text(yaml.safe_dump(doc))
    stage1 = load_manifest("llava-stage1.yaml")
    stage2 = load_manifest("llava-stage2.yaml")
    assert stage2.spec.trainer.checkpoint.init_from == stage1.spec.trainer.checkpoint.path

    with single_process_model(stage1.spec.trainer, checkpoint=None) as (model, _):
        initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    run_worker(stage1, steps=STEPS, summary_path=None)
    after1 = weights(stage1)
    moved = {n for n in after1 if not torch.equal(after1[n], initial[n])}
    assert moved and all(n.startswith("projectors.image.") for n in moved)

    result = run_worker(stage2, steps=STEPS, summary_path=None)
    assert result["first_step"] == 0 and result["steps"] == STEPS
    after2 = weights(stage2)
    moved = {n for n in after2 if not torch.equal(after2[n], after1[n])}
    assert {
        "llm_chunks.0.embedding.word_embeddings.weight",
        "encoders.image.patch_embed.weight",
    } <= moved
