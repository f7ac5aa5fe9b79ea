"""The job manifest: an ``OmniTrainingJob`` whose ``spec.trainer`` configures the trainer.

The same YAML is what users ``kubectl apply`` and what ``omni train`` reads locally. Only
``spec.trainer`` belongs to the trainer; the rest of ``spec`` (image, nodes, resources...) is
cluster settings validated by the operator's CRD schema and ignored by a local run.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, Field, PrivateAttr, ValidationError, model_validator

from omni_trainer.checkpoint.config import CheckpointConfig
from omni_trainer.config_base import Spec
from omni_trainer.data.config import DataConfig
from omni_trainer.distributed.config import ParallelismConfig
from omni_trainer.models.config import ModelConfig
from omni_trainer.models.encoders.config import DEFER_HF

API_VERSION = "omni.megascale.io/v1alpha1"
KIND = "OmniTrainingJob"


LRModule = Literal[
    "llm", "encoders.image", "encoders.audio", "projectors.image", "projectors.audio"
]


class OptimizerConfig(Spec):
    name: Literal["adamw"] = "adamw"
    lr: float = Field(3e-4, gt=0)
    min_lr: float = Field(0.0, ge=0, description="floor of the LR decay")
    weight_decay: float = Field(0.01, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-8, gt=0)
    clip_grad: float = Field(1.0, ge=0, description="max global grad norm; 0 disables clipping")
    lr_multipliers: dict[LRModule, Annotated[float, Field(gt=0)]] = Field(
        default_factory=dict,
        description="per module, a factor on the LR of every step (e.g. a 0.1x vision tower)",
    )

    @model_validator(mode="after")
    def _min_below_peak(self) -> OptimizerConfig:
        if self.min_lr > self.lr:
            raise ValueError(f"minLr ({self.min_lr}) must not exceed lr ({self.lr})")
        return self


class LRScheduleConfig(Spec):
    warmup_steps: int = Field(0, ge=0)
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    decay_steps: int | None = Field(
        None, ge=1, description="steps from start to minLr; default: train.steps"
    )


class TrainConfig(Spec):
    steps: int = Field(100, ge=1, description="optimizer steps (overridable by --steps)")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto",
        description="bf16: bf16 LLM weights and activations with fp32 main weights and "
        "gradients, encoders under bf16 autocast; auto: bf16 on GPUs, fp32 on CPU",
    )
    recompute: Literal["none", "selective", "full"] = Field(
        "none",
        description="activation recompute in the backward, for the LLM and the encoders: "
        "selective = core attention, full = whole transformer layers (recomputeLayers per "
        "LLM model chunk and per encoder)",
    )
    recompute_layers: int | None = Field(
        None,
        ge=1,
        description="with recompute: full, the layers of each LLM model chunk and of each "
        "encoder recomputed (the first ones; megatron's block method); default all",
    )

    @model_validator(mode="after")
    def _layers_need_full(self) -> TrainConfig:
        if self.recompute_layers is not None and self.recompute != "full":
            raise ValueError(
                f"recomputeLayers applies to recompute: full (recompute is {self.recompute!r}); "
                "set recompute: full or drop recomputeLayers"
            )
        return self

    peak_flops_per_device: float | None = Field(
        None, gt=0, description="override the peak FLOP/s used for MFU"
    )
    step_log: str | None = Field(
        None,
        description="a file that global rank 0 appends one JSON line per optimizer step to "
        "(step, loss, tokens/s, MFU, restart attempt); a resumed run appends, so the last line "
        "of each step is the curve that counted",
    )


class TrainerConfig(Spec):
    seed: int = 1234
    tokenizer: str | None = Field(
        None,
        description="Hugging Face tokenizer files (a directory or s3:// prefix with "
        "tokenizer.json and a chat_template); conversation sources are rendered with it; "
        "default: the tokenizer saved beside model.llm.hf",
    )
    model: ModelConfig
    data: DataConfig
    parallelism: ParallelismConfig = ParallelismConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    lr_schedule: LRScheduleConfig = LRScheduleConfig()
    train: TrainConfig = TrainConfig()
    checkpoint: CheckpointConfig | None = None

    @model_validator(mode="after")
    def _positions_fit_layout(self) -> TrainerConfig:
        if self.model.llm.mrope_section is not None and self.parallelism.context > 1:
            raise ValueError(
                "parallelism.context: the LLM's M-RoPE (Qwen2.5-VL) positions are not sharded "
                "for context parallelism; set context: 1"
            )
        return self

    @model_validator(mode="after")
    def _data_fits_model(self) -> TrainerConfig:
        if self.tokenizer is None and self.model.llm.hf is not None:  # the model's own
            object.__setattr__(self, "tokenizer", self.model.llm.hf)
        consumable = set(self.model.modalities)
        for i, source in enumerate(self.data.sources):
            if source.kind in ("conversations", "webdataset", "parquet") and not self.tokenizer:
                raise ValueError(
                    f"data.sources[{i}] ({source.name!r}) holds conversations, which are "
                    "rendered with a chat template: set spec.trainer.tokenizer to a directory "
                    "(or s3:// prefix) of Hugging Face tokenizer files"
                )
            if source.modality not in consumable:
                raise ValueError(
                    f"data.sources[{i}] ({source.name!r}) has modality {source.modality!r} "
                    f"but model.encoders has no {source.modality!r} encoder; add one "
                    f"or remove the source (the model consumes: {', '.join(sorted(consumable))})"
                )
        return self


class Metadata(Spec):
    model_config = Spec.model_config | {"extra": "allow"}
    name: str = Field(..., min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    namespace: str | None = None


class JobSpecTrainerView(Spec):
    """``spec`` as the trainer sees it: ``trainer`` is validated, cluster settings pass through."""

    model_config = Spec.model_config | {"extra": "allow"}
    trainer: TrainerConfig


class JobManifest(Spec):
    api_version: Literal["omni.megascale.io/v1alpha1"] = Field(alias="apiVersion")
    kind: Literal["OmniTrainingJob"]
    metadata: Metadata
    spec: JobSpecTrainerView
    _job_warnings: list[str] = PrivateAttr(default_factory=list)

    @property
    def job_warnings(self) -> list[str]:
        """Lines of :data:`JOB_CHECKS` (whole-manifest checks) for what they let through."""
        return self._job_warnings


class ManifestError(ValueError):
    """A manifest that cannot be used; the message lists every bad field by its YAML path."""


def format_errors(err: ValidationError, model: type[BaseModel] | None = None) -> str:
    """One line per problem: ``spec.trainer.data.microBatchSize: <what is wrong and allowed>``;
    with the ``model`` validated, an unknown field names the closest known one."""
    from omni_trainer.field_names import did_you_mean

    lines = []
    for e in err.errors():
        path = ""
        for part in e["loc"]:
            if isinstance(part, int):
                path += f"[{part}]"
            elif not _is_union_tag(part):
                path += f".{part}" if path else str(part)
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            close = did_you_mean(model, e["loc"]) if model is not None else None
            msg = f"unknown field; did you mean {close!r}?" if close else "unknown field"
            msg += " (check the spelling; fields are camelCase)"
        elif e["type"] == "literal_error" and "expected" in e.get("ctx", {}):
            msg = f"must be one of {e['ctx']['expected']}"
        lines.append(f"{path or '<root>'}: {msg}")
    return "\n".join(lines)


def _is_union_tag(part: object) -> bool:
    # pydantic puts the chosen member of a tagged union into the location ("synthetic").
    return isinstance(part, str) and part in _SOURCE_KINDS


_SOURCE_KINDS = {"synthetic", "shards", "conversations", "webdataset", "parquet"}


def parse_manifest(doc: Any, *, defer_hf: bool = False) -> JobManifest:
    """Validate a manifest for the trainer; ``defer_hf``: do not read ``model.llm.hf``
    (:data:`omni_trainer.models.config.DEFER_HF`)."""
    if not isinstance(doc, dict):
        raise ManifestError("the manifest must be a YAML mapping with apiVersion, kind, spec")
    try:
        return JobManifest.model_validate(doc, context={DEFER_HF: defer_hf})
    except ValidationError as err:
        raise ManifestError(format_errors(err, JobManifest)) from None


JobCheck = Callable[[Any, int | None, bool], list[str]]
"""Validates a whole manifest document (cluster fields included) for a run on this machine
with that many processes (None: where the manifest's cluster fields put it), reading
``model.llm.hf`` unless the flag defers it; raises :class:`ManifestError` listing every
problem, and returns warning lines (``spec.<path>: <what happens and what to set>``) for what
it lets through."""

JOB_CHECKS: list[JobCheck] = []
"""Whole-manifest checks of other installed parts: the operator adds its own (the one
validation it applies to every job) when it registers its ``omni`` commands, so that
``omni validate`` and ``omni train`` reject what the operator would, before anything starts."""


def load_manifest(
    path: str | Path,
    *,
    whole: bool = False,
    local_world_size: int | None = None,
    defer_hf: bool = False,
) -> JobManifest:
    """Read and validate a manifest file; errors name the file and every bad field.

    ``whole``: also run :data:`JOB_CHECKS` (every field of ``spec``, the layout at
    ``local_world_size`` processes or, when None, at the cluster fields' size).
    ``defer_hf``: do not read ``model.llm.hf`` (as the operator cannot).
    """
    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ManifestError(f"{path}: no such file") from None
    except yaml.YAMLError as err:
        raise ManifestError(f"{path}: not valid YAML: {err}") from None
    try:
        checks = JOB_CHECKS if whole else []
        warnings = [line for check in checks for line in check(doc, local_world_size, defer_hf)]
        job = parse_manifest(doc, defer_hf=defer_hf)
        job.job_warnings.extend(warnings)
        return job
    except ManifestError as err:
        raise ManifestError(f"{path}: invalid OmniTrainingJob\n{err}") from None
