"""``omni data``: see what the model sees (``preview``), choose ``eta`` and ``seqLength``
(``stats``), and make the tiny real-format example dataset (``make-tiny``)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer

from omni_trainer.cli.common import ManifestArg, fail, load_job
from omni_trainer.data.sample import media_geometry

data_app = typer.Typer(help="Inspect a job's data; make the tiny example dataset.")


def _sources(manifest: Path) -> tuple[Any, list]:
    from omni_trainer.data.loader import build_source

    cfg = load_job(manifest).spec.trainer
    try:
        return cfg, [
            build_source(
                c,
                source_index=i,
                seed=cfg.seed,
                vocab_size=cfg.model.llm.vocab_size,
                geometry=media_geometry(cfg.model),
                seq_length=cfg.data.seq_length,
                tokenizer=cfg.tokenizer,
                media=cfg.data.media,
            )
            for i, c in enumerate(cfg.data.sources)
        ]
    except (ValueError, OSError) as err:
        raise fail(f"{manifest}: {err}") from None


def describe(sample: Any, tokenizer: Any | None) -> dict[str, Any]:
    """One preview record (the ``--json`` line): what the LLM sees of a sample or why it is
    skipped. ``text`` marks media as ``<image x N>`` and loss spans as ``[[...]]``."""
    from omni_trainer.data.sample import Skipped

    if isinstance(sample, Skipped):
        return {"id": sample.sample_id, "text": None, "loss_text": None, "num_tokens": 0,
                "media": [], "skipped": sample.reason, "detail": sample.detail}  # fmt: skip
    media = [{"modality": sample.modality, "tokens": sample.media_tokens}] * bool(sample.media)
    media += [{"modality": sp.modality, "tokens": sp.tokens} for sp in sample.spans]
    text = loss_text = ""
    if tokenizer is not None:
        ids = sample.text
        targets = sample.targets if sample.targets is not None else np.ones(len(ids), bool)
        loss_text = tokenizer.decode(ids[targets].tolist())
        marks = np.zeros(len(ids), dtype=np.int8)  # 0 text, 1 loss, 2 media
        marks[targets] = 1
        for sp in sample.spans:
            marks[sp.offset : sp.offset + sp.tokens] = 2
        parts, i = [], 0
        while i < len(ids):
            j = i
            while j < len(ids) and marks[j] == marks[i]:
                j += 1
            if marks[i] == 2:
                sp = next(s for s in sample.spans if s.offset == i)
                parts.append(f"<{sp.modality} x {sp.tokens}>")
                j = i + sp.tokens
            else:
                piece = tokenizer.decode(ids[i:j].tolist())
                parts.append(f"[[{piece}]]" if marks[i] == 1 else piece)
            i = j
        text = "".join(parts)
    return {"id": sample.sample_id, "text": text, "loss_text": loss_text,
            "num_tokens": sample.num_tokens, "media": media, "skipped": None}  # fmt: skip


@data_app.command()
def preview(
    manifest: ManifestArg,
    samples: Annotated[int, typer.Option(min=1, help="samples per source")] = 5,
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object per line")] = False,
) -> None:
    """Per sample: the rendered text with loss spans marked, token counts, media placeholder
    expansion, or the reason it is skipped."""
    from omni_trainer.data.tokenizer import load_tokenizer

    cfg, sources = _sources(manifest)
    tok = load_tokenizer(cfg.tokenizer) if cfg.tokenizer else None
    for src in sources:
        n = min(samples, src.num_samples or samples)
        for i in range(n):
            rec = describe(src.get(i), tok)
            if as_json:
                typer.echo(json.dumps(rec | {"source": src.name}, ensure_ascii=False))
                continue
            media = ", ".join(f"{m['modality']} {m['tokens']}" for m in rec["media"]) or "none"
            head = f"== {src.name} {rec['id']}"
            if rec["skipped"]:
                typer.echo(f"{head}: skipped ({rec['skipped']}): {rec['detail']}")
            else:
                typer.echo(f"{head}: {rec['num_tokens']} tokens; media: {media}")
                typer.echo(rec["text"] or "(no tokenizer: token ids only)")


def histogram(values: list[int]) -> list[tuple[int, int, int]]:
    """(low, high, count) over power-of-two bins covering ``values``."""
    if not values:
        return []
    top = max(1, math.ceil(math.log2(max(values) + 1)))
    bins = []
    for k in range(top + 1):
        lo, hi = (0 if k == 0 else 2 ** (k - 1) + 1), 2**k
        count = sum(lo <= v <= hi for v in values)
        if count:
            bins.append((lo, hi, count))
    return bins


@data_app.command()
def stats(
    manifest: ManifestArg,
    samples: Annotated[int, typer.Option(min=1, help="samples read per source at most")] = 2000,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Length histograms (LLM positions per sample, encoder positions per media item) per
    source and modality, and skips by reason: to choose ``seqLength`` and ``eta``."""
    from omni_trainer.data.sample import Skipped

    _, sources = _sources(manifest)
    report: dict[str, Any] = {}
    for src in sources:
        lengths: list[int] = []
        media: dict[str, list[int]] = {}
        skipped: dict[str, int] = {}
        for i in range(min(samples, src.num_samples or samples)):
            s = src.get(i)
            if isinstance(s, Skipped):
                skipped[s.reason] = skipped.get(s.reason, 0) + 1
                continue
            lengths.append(s.num_tokens)
            if s.media is not None:
                media.setdefault(s.modality, []).append(s.media_tokens)
            for sp in s.spans:
                media.setdefault(sp.modality, []).append(sp.tokens)
        report[src.name] = {
            "modality": src.modality,
            "samples": len(lengths),
            "skipped": skipped,
            "sample_tokens": _summary(lengths),
            "media_tokens": {m: _summary(v) for m, v in sorted(media.items())},
        }
    if as_json:
        typer.echo(json.dumps(report, indent=1))
        return
    for name, r in report.items():
        typer.echo(f"{name} ({r['modality']}): {r['samples']} samples, skipped {r['skipped']}")
        for label, s in [("sample tokens", r["sample_tokens"])] + [
            (f"{m} tokens/item", s) for m, s in r["media_tokens"].items()
        ]:
            typer.echo(f"  {label}: mean {s['mean']:.0f}, p50 {s['p50']}, p99 {s['p99']}, "
                       f"max {s['max']}")  # fmt: skip
            for lo, hi, count in s["histogram"]:
                typer.echo(f"    {lo:>7}-{hi:<7} {count:>6} {'#' * max(1, 40 * count // s['n'])}")


def _summary(values: list[int]) -> dict[str, Any]:
    if not values:
        return {"n": 0, "mean": 0.0, "p50": 0, "p99": 0, "max": 0, "histogram": []}
    v = np.asarray(values)
    return {
        "n": len(values),
        "mean": float(v.mean()),
        "p50": int(np.percentile(v, 50)),
        "p99": int(np.percentile(v, 99)),
        "max": int(v.max()),
        "histogram": [list(b) for b in histogram(values)],
    }


@data_app.command("make-tiny")
def make_tiny(
    out: Annotated[Path, typer.Argument(help="dataset directory")] = Path("data/llava-tiny"),
    images: Annotated[int, typer.Option(min=1)] = 600,
    audio: Annotated[int, typer.Option(min=0)] = 120,
    videos: Annotated[int, typer.Option(min=0, help="mp4 clips of a moving square")] = 0,
    seed: int = 0,
    corrupt: Annotated[list[int], typer.Option(help="image record to overwrite with junk")] = [],  # noqa: B006
    missing: Annotated[list[int], typer.Option(help="image record whose file to delete")] = [],  # noqa: B006
) -> None:
    """Write the LLaVA-format example of examples/llava-tiny.yaml: Pillow-drawn shapes with
    captions and Q/A, numpy tones as WAV, optional mp4 clips, and a tokenizer trained on its
    text."""
    from omni_trainer.data.tinyset import make_tiny_dataset

    paths = make_tiny_dataset(
        str(out),
        images=images,
        audio=audio,
        videos=videos,
        seed=seed,
        corrupt=corrupt,
        missing=missing,
    )
    typer.echo(
        f"wrote {images} image, {audio} audio and {videos} video conversations: "
        f"{paths['annotations']}"
    )
