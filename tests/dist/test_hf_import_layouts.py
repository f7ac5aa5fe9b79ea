"""Imported HF weights train the same at every layout: step losses within 1e-6 and gradients
after step 1 equal a single process's, for Llama (untied) and Qwen2 (QKV biases, tied
embeddings: two copies at pp > 1 whose gradients meet over megatron's embedding group), on a
text-only job (no encoders), with a vocabulary that needs padding at tp2 (masked logits)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ..unit.interop.hf_models import save_llm, text_job
from .harness import assert_same_training, launch, run_reference

pytestmark = pytest.mark.dist

STEPS = 2
LAYOUTS = {2: [("tp2", 2, 1), ("pp2", 1, 2)], 4: [("tp2xpp2", 2, 2)]}
FAMILIES = {
    "llama": ("llama", {"vocab_size": 511}),
    "qwen2": ("qwen2", {"tie_word_embeddings": True}),
}


def job(model: Path, tensor: int = 1, pipeline: int = 1) -> dict:
    return text_job(
        {"hf": str(model)},
        seed=3,
        optimizer={"lr": 0.003, "clipGrad": 1.0},
        parallelism={"tensor": tensor, "pipeline": pipeline},
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {name: save_llm(root / name, kind, **kw) for name, (kind, kw) in FAMILIES.items()}


@pytest.fixture(scope="module")
def references(models) -> dict[str, dict]:
    return {name: run_reference(job(path), STEPS) for name, path in models.items()}


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_imported_weights_train_alike_at_every_layout(world, models, references, tmp_path):
    scenarios = {
        f"{family}-{name}": job(path, tp, pp)
        for family, path in models.items()
        for name, tp, pp in LAYOUTS[world]
    }
    out = launch(world, scenarios, STEPS, tmp_path)
    for scenario in scenarios:
        assert_same_training(out / scenario, references[scenario.split("-")[0]])
