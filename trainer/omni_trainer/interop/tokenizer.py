"""The job's Hugging Face tokenizer: ``spec.trainer.tokenizer``, or the one beside the model."""

from __future__ import annotations

from typing import Any

from omni_trainer.interop.source import HFModelError, local_dir


def tokenizer_path(cfg: Any) -> str | None:
    """Where the tokenizer of a ``TrainerConfig`` lives (None: the job names none)."""
    return cfg.tokenizer or cfg.model.llm.hf


def load_tokenizer(cfg: Any):
    """The tokenizer, offline, after checking that every id it makes fits the model.

    Raises:
        HFModelError: no tokenizer files, or more tokens than the model's vocabulary.
    """
    from transformers import AutoTokenizer

    path = tokenizer_path(cfg)
    if path is None:
        raise HFModelError(
            "no tokenizer: set spec.trainer.tokenizer (Hugging Face tokenizer files) or import "
            "the LLM with model.llm.hf (its tokenizer is used)"
        )
    root = local_dir(path, required=None)
    try:
        tok = AutoTokenizer.from_pretrained(str(root), local_files_only=True)
    except (OSError, ValueError) as err:
        raise HFModelError(
            f"spec.trainer.tokenizer: no usable tokenizer in {path}: {err}"
        ) from None
    vocab = cfg.model.llm.vocab_size
    if len(tok) > vocab:
        raise HFModelError(
            f"spec.trainer.tokenizer: {path} has {len(tok)} tokens but the model's vocabulary "
            f"holds {vocab} (model.llm.vocabSize); use the model's own tokenizer or a model "
            "with a larger vocabulary"
        )
    return tok
