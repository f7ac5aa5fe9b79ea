"""Tiny random Hugging Face models and a tokenizer, built offline from configs (no Hub access)."""

from __future__ import annotations

from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_SMALL = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def save_llm(path: Path, family: str, **overrides) -> Path:
    """A random Llama / Mistral / Qwen2 causal LM saved with ``save_pretrained`` (fp32)."""
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[family]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**_SMALL, **overrides}))
    with torch.no_grad():  # norms away from 1 and biases away from 0, so a mix-up shows
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(path)
    return path


def save_tokenizer(path: Path, vocab_size: int = 300) -> Path:
    """A byte-level BPE trained in-process, with a chat template, saved beside a model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|user|>", "<|assistant|>", "<|end|>", "<image>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    text = ["the quick brown fox jumps over the lazy dog", "hello world, a tiny model speaks"]
    tok.train_from_iterator(text * 50, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|end|>", chat_template=CHAT_TEMPLATE
    )
    fast.save_pretrained(path)
    return path


def text_job(llm: dict, **trainer) -> dict:
    """A text-only OmniTrainingJob (no encoders, one synthetic text source) around ``llm``."""
    return {
        "apiVersion": "omni.megascale.io/v1alpha1",
        "kind": "OmniTrainingJob",
        "metadata": {"name": "hf-text"},
        "spec": {
            "trainer": {
                "model": {"llm": llm},
                "data": {
                    "seqLength": 64,
                    "globalBatchSize": 4,
                    "microBatchSize": 1,
                    "loaderShards": 2,
                    "sources": [
                        {
                            "kind": "synthetic",
                            "name": "text",
                            "modality": "text",
                            "preset": "longtext",
                            "lengthScale": 0.01,
                        }
                    ],
                },
                **trainer,
            }
        },
    }
