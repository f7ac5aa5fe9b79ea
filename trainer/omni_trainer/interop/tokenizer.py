"""The job's Hugging Face tokenizer (``spec.trainer.tokenizer``, which defaults to the files
beside ``model.llm.hf``), checked against the model's vocabulary."""

from __future__ import annotations

from typing import Any

from omni_trainer.interop.source import HFModelError


def load_checked_tokenizer(cfg: Any):
    """The tokenizer of a ``TrainerConfig``, after checking that every id it makes fits the model.

    Raises:
        HFModelError: no tokenizer, or more tokens than the model's vocabulary.
        ValueError: nothing loadable at the path (``data.tokenizer.load_tokenizer``).
    """
    from omni_trainer.data.tokenizer import load_tokenizer

    if cfg.tokenizer is None:
        raise HFModelError(
            "no tokenizer: set spec.trainer.tokenizer (Hugging Face tokenizer files) or import "
            "the LLM with model.llm.hf (its tokenizer is used)"
        )
    tok = load_tokenizer(cfg.tokenizer, chat_template=False)  # --raw needs none
    vocab = cfg.model.llm.vocab_size
    if len(tok) > vocab:
        raise HFModelError(
            f"spec.trainer.tokenizer: {cfg.tokenizer} has {len(tok)} tokens but the model's "
            f"vocabulary holds {vocab} (model.llm.vocabSize); use the model's own tokenizer or "
            "a model with a larger vocabulary"
        )
    return tok
