"""A projector-only stage (LLM and encoders frozen: encoders run without a graph, embedding
gradients still travel back to the projector on the encoding rank) is the same training at tp2
and pp2 as in one process: losses within 1e-6, projector gradients within 1e-5."""

from __future__ import annotations

import pytest

from .harness import assert_same_training, launch, run_reference
from .test_multiplex_equivalence import job as multiplex_job

pytestmark = pytest.mark.dist

STEPS = 2


def job(tensor: int = 1, pipeline: int = 1) -> dict:
    doc = multiplex_job(tensor, pipeline)
    model = doc["spec"]["trainer"]["model"]
    model["llm"]["freeze"] = True
    for encoder in model["encoders"].values():
        encoder["freeze"] = True
    return doc


def test_projector_only_stage_equals_one_process(tmp_path) -> None:
    reference = run_reference(job(), STEPS)
    assert reference["grads"] and all(k.startswith("projectors.") for k in reference["grads"])
    scenarios = {"tp2": job(2, 1), "pp2": job(1, 2)}
    out = launch(2, scenarios, STEPS, tmp_path)
    for name in scenarios:
        assert_same_training(out / name, reference)
