"""Bad job manifests (variants of ``omni_operator.sandbox.testbed.job_manifest``), each with the
field its rejection must name. The operator (tests/operator), `omni validate`, `omni train` and
`omni render` (tests/unit/operator/test_validate_everywhere.py) must all reject every bad one,
before any pod or process exists, naming the same field.
"""

from __future__ import annotations

import copy
from typing import Any

INVALID: dict[str, tuple[dict[str, Any], str]] = {
    # name: (spec overrides, the field the message must name)
    "nodes": ({"nodes": 0}, "spec.nodes"),
    "gpus": ({"gpusPerNode": -1}, "spec.gpusPerNode"),
    "unknown": ({"maxRuntime": 3600}, "spec.maxRuntime"),
    "budget": ({"restartPolicy": {"budget": -1}}, "spec.restartPolicy.budget"),
    "micro": ({"trainer": {"data": {"microBatchSize": 3}}}, "spec.trainer.data.microBatchSize"),
    "typo": (
        {"trainer": {"data": {"sources": [{"colour": "red"}]}}},
        "spec.trainer.data.sources[0].colour",
    ),
    "preset": (
        {"trainer": {"model": {"llm": {"preset": "gpt-9"}}}},
        "spec.trainer.model.llm.preset",
    ),
    "tensor": ({"trainer": {"parallelism": {"tensor": 3}}}, "spec.trainer.parallelism.tensor"),
    "hang": (
        {"restartPolicy": {"hangTimeoutSeconds": 10}},
        "spec.restartPolicy.hangTimeoutSeconds",
    ),
    "group": ({"topology": {"reorderGroupSize": 3}}, "spec.topology.reorderGroupSize"),
    "ckpt": ({"trainer": {"checkpoint": {"intervalSteps": 5}}}, "spec.trainer.checkpoint.path"),
    "memory": ({"resources": {"memory": "lots"}}, "spec.resources.memory"),
    "lr": ({"trainer": {"optimizer": {"lr": -1}}}, "spec.trainer.optimizer.lr"),
    "suspend": ({"suspend": "maybe"}, "spec.suspend"),
    "mixture": (
        {"trainer": {"data": {"mixture": [{"atTokens": 0, "weights": {"video": 1}}]}}},
        "spec.trainer.data.mixture",
    ),
    "steps": ({"trainer": {"train": {"steps": 0}}}, "spec.trainer.train.steps"),
    "exitcodes": (
        {"restartPolicy": {"nonRetryableExitCodes": [0]}},
        "spec.restartPolicy.nonRetryableExitCodes[0]",
    ),
    # Semantic: each field is valid alone, the job cannot run (found today only by the ranks).
    "kvheads": (
        {"trainer": {"parallelism": {"tensor": 2}, "model": {"llm": {"numQueryGroups": 1}}}},
        "spec.trainer.model.llm.numQueryGroups",
    ),
    "heads": (  # 4 processes per node, tensor 4; heads 2 (and groups 2) do not split in 4
        {
            "gpusPerNode": 4,
            "trainer": {
                "parallelism": {"tensor": 4},
                "model": {"llm": {"numAttentionHeads": 2, "numQueryGroups": 2}},
            },
        },
        "spec.trainer.model.llm.numAttentionHeads",
    ),
    "layers": (
        {"trainer": {"parallelism": {"pipeline": 2}, "model": {"llm": {"numLayers": 3}}}},
        "spec.trainer.model.llm.numLayers",
    ),
    "batch": (  # 4 data-parallel ranks x microBatchSize 2 = 8 > 4 sequences per step
        {"trainer": {"data": {"globalBatchSize": 4}}},
        "spec.trainer.data.globalBatchSize",
    ),
    "seqlen": (  # every librispeech sample (22..189 tokens) would be cut to 10
        {"trainer": {"data": {"seqLength": 10}}},
        "spec.trainer.data.sources[2]",
    ),
}


def invalid_job(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """``base`` (not modified) with ``changes`` merged into its ``spec`` (a list's first item
    is updated in place)."""
    doc = copy.deepcopy(base)
    _deep_update(doc["spec"], changes)
    return doc


def _deep_update(doc: dict[str, Any], changes: dict[str, Any]) -> None:
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(doc.get(key), dict):
            _deep_update(doc[key], value)
        elif isinstance(value, list) and value and isinstance(value[0], dict) and doc.get(key):
            doc[key][0].update(value[0])
        else:
            doc[key] = value
