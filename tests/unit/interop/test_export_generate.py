"""``omni export`` and ``omni generate`` against transformers itself (tiny models, offline)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from omni_trainer.cli import app

from .hf_models import save_llm, save_tokenizer, text_job


def write_job(path: Path, llm: dict, **trainer) -> Path:
    path.write_text(yaml.safe_dump(text_job(llm, **trainer)))
    return path


def cli(*args: str) -> str:
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output + str(result.exception)
    return result.stdout


def hf_logits(path: Path, tokens: torch.Tensor) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits


TOKENS = torch.randint(0, 511, (2, 40), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    "family,overrides",
    [("llama", {"vocab_size": 511}), ("qwen2", {"tie_word_embeddings": True})],
)
def test_import_export_round_trip(family, overrides, tmp_path, monkeypatch) -> None:
    import omni_trainer.interop.export as export

    if family == "llama":  # several shards and an index, as transformers writes big models
        monkeypatch.setattr(export, "SHARD_BYTES", 100_000)
    src = save_llm(tmp_path / "src", family, **overrides)
    save_tokenizer(src)
    job = write_job(tmp_path / "job.yaml", {"hf": str(src)})
    out = tmp_path / "exported"
    printed = cli("export", job, "--out", out, "--initial-weights")
    assert "exported initial weights" in printed
    files = {p.name for p in out.iterdir()}
    weights = "model.safetensors.index.json" if family == "llama" else "model.safetensors"
    assert {weights, "config.json", "tokenizer.json", "chat_template.jinja"} <= files
    torch.testing.assert_close(hf_logits(out, TOKENS), hf_logits(src, TOKENS), rtol=0, atol=1e-5)
    exported = json.loads((out / "config.json").read_text())
    assert (
        exported["architectures"] == json.loads((src / "config.json").read_text())["architectures"]
    )


def our_logits(job: Path, tokens: torch.Tensor, checkpoint: str | None = None) -> torch.Tensor:
    """Logits of the job's model in one process (the weights export starts from)."""
    from omni_trainer.config import load_manifest
    from omni_trainer.interop.runtime import single_process_model

    cfg = load_manifest(job).spec.trainer
    with single_process_model(cfg, checkpoint=checkpoint) as (model, _), torch.no_grad():
        logits = model.llm_chunks[0](
            input_ids=tokens,
            position_ids=torch.arange(tokens.shape[1]).expand_as(tokens),
            attention_mask=None,
        )
    return logits[..., : cfg.model.llm.vocab_size]


def test_preset_exports_as_llama_with_our_logits(tmp_path) -> None:
    llm = {"preset": "tiny", "ropeScaling": {"type": "llama3", "factor": 4.0}, "rotaryBase": 5e5}
    job = write_job(tmp_path / "job.yaml", llm, seed=11)
    out = tmp_path / "llama"
    cli("export", job, "--out", out, "--initial-weights")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    tokens = torch.randint(0, 512, (1, 32), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(hf_logits(out, tokens), our_logits(job, tokens), rtol=0, atol=1e-5)


def test_failed_export_leaves_nothing(tmp_path, monkeypatch) -> None:
    import omni_trainer.interop.export as export

    src = save_llm(tmp_path / "src", "llama")
    job = write_job(tmp_path / "job.yaml", {"hf": str(src)})
    original, calls = export.split_full, []

    def fail_fifth(tm, cfg, full):
        calls.append(tm)
        if len(calls) == 5:
            raise OSError("disk full")
        return original(tm, cfg, full)

    monkeypatch.setattr(export, "split_full", fail_fifth)
    monkeypatch.setattr(export, "SHARD_BYTES", 1 << 10)  # shards were flushed before the failure
    result = CliRunner().invoke(
        app, ["export", str(job), "--out", str(tmp_path / "out"), "--initial-weights"]
    )
    assert result.exit_code == 2 and "disk full" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.yaml", "src"]
    # An existing non-empty --out is never overwritten.
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("keep")
    result = CliRunner().invoke(
        app, ["export", str(job), "--out", str(tmp_path / "taken"), "--initial-weights"]
    )
    assert result.exit_code == 2 and "not empty" in result.output


@pytest.mark.parametrize("raw", [False, True])
def test_generate_equals_transformers_greedy(raw, tmp_path) -> None:
    import transformers

    src = save_llm(tmp_path / "src", "qwen2", tie_word_embeddings=True)
    save_tokenizer(src)
    job = write_job(tmp_path / "job.yaml", {"hf": str(src)})
    prompt = "hello world, the quick fox"
    args = ["generate", job, "--prompt", prompt, "--max-new-tokens", 12, "--json"]
    got = json.loads(cli(*args, *(["--raw"] if raw else [])))

    tok = transformers.AutoTokenizer.from_pretrained(src)
    if raw:
        ids = tok(prompt).input_ids
    else:
        text = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        assert text.endswith("<|assistant|>")
        ids = tok(text, add_special_tokens=False).input_ids
    model = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    stop = [
        tok.eos_token_id,
        *(
            [model.generation_config.eos_token_id]
            if model.generation_config.eos_token_id is not None
            else []
        ),
    ]
    with torch.no_grad():
        full = model.generate(
            torch.tensor([ids]), do_sample=False, max_new_tokens=12, eos_token_id=stop
        )[0].tolist()
        logprobs = model(torch.tensor([full])).logits[0].log_softmax(-1)
    assert got["prompt_ids"] == ids
    assert got["output_ids"] == full[len(ids) :] and got["output_ids"]
    assert got["output_text"] == tok.decode(full[len(ids) :], skip_special_tokens=True)
    expected = [float(logprobs[len(ids) - 1 + i, t]) for i, t in enumerate(got["output_ids"])]
    assert got["logprobs"] == pytest.approx(expected, abs=1e-4)


def test_generate_checks_the_tokenizer_against_the_vocabulary(tmp_path) -> None:
    src = save_llm(tmp_path / "src", "llama", vocab_size=128)
    save_tokenizer(src, vocab_size=300)
    job = write_job(tmp_path / "job.yaml", {"hf": str(src)})
    result = CliRunner().invoke(app, ["generate", str(job), "--prompt", "hi"])
    assert result.exit_code == 2
    assert "has 300 tokens but the model's vocabulary holds 128 (model.llm.vocabSize)" in (
        result.output
    )


def test_gpt_shaped_preset_is_refused_before_building(tmp_path) -> None:
    job = write_job(tmp_path / "job.yaml", {"preset": "gpt-175b"})  # 175B: building would OOM
    result = CliRunner().invoke(
        app, ["export", str(job), "--out", str(tmp_path / "out"), "--initial-weights"]
    )
    assert result.exit_code == 2
    assert "only Llama-shaped LLMs (gatedMlp, RMSNorm, no QKV bias)" in result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("checkpoint", [True, False])
def test_export_without_a_checkpoint_asks_for_initial_weights(checkpoint, tmp_path) -> None:
    sections = {"checkpoint": {"path": str(tmp_path / "ckpt")}} if checkpoint else {}
    job = write_job(tmp_path / "job.yaml", {"preset": "tiny"}, **sections)
    result = CliRunner().invoke(app, ["export", str(job), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    where = "no complete checkpoint under checkpoint.path" if checkpoint else "no checkpoint sec"
    assert where in result.output and "--initial-weights" in result.output
    assert not (tmp_path / "out").exists()
