"""``seqLength`` against the sources' sample lengths, before anything runs (torch- and numpy-free:
the operator validates with it).

A media sample longer than ``seqLength`` is cut to fit (its media shrunk) and a text sample is
split into chunks; both change what the model sees, so neither may happen silently. Generated
sources know their length distribution; the share of samples over ``seqLength`` and about how
many of a step's samples that is come from its quantiles. Shard sources are only known once read
(``omni validate --sources``).
"""

from __future__ import annotations

import math
from statistics import NormalDist

from omni_trainer.data.config import DataConfig, LengthDistribution, SyntheticSourceConfig

QUANTILES = 512  # midpoint quantiles of the length distribution
WARN_FRACTION = 0.01  # below this share of samples over seqLength, say nothing

Problem = tuple[str, str]  # (path under spec.trainer, the message)


def scaled_lengths(dist: LengthDistribution, scale: float) -> list[int]:
    """Equally likely sample lengths (quantile midpoints), as ``synthetic.draw_length`` draws."""
    if dist.sigma == 0:
        raws = [dist.mean] * QUANTILES
    else:
        mu = math.log(dist.mean) - dist.sigma**2 / 2
        z = NormalDist()
        raws = [
            math.exp(mu + dist.sigma * z.inv_cdf((k + 0.5) / QUANTILES)) for k in range(QUANTILES)
        ]
    return [max(1, round(min(max(r, dist.min), dist.max) * scale)) for r in raws]


def length_problems(data: DataConfig) -> tuple[list[Problem], list[Problem]]:
    """(errors, warnings) about samples longer than ``seqLength``, per generated source: an
    error when every media sample would be cut, a warning stating the share and about how many
    samples of a step are cut or split where the mixture gives the source its largest share."""
    errors: list[Problem] = []
    warnings: list[Problem] = []
    seq = data.seq_length
    step_tokens = data.global_batch_size * seq
    for i, src in enumerate(data.sources):
        if not isinstance(src, SyntheticSourceConfig):
            continue
        lengths = scaled_lengths(src.length_distribution(), src.length_scale)
        over = sum(n > seq for n in lengths) / len(lengths)
        if over < WARN_FRACTION:
            continue
        text = src.modality == "text"
        # text keeps every token (in chunks); media is cut to seqLength
        mean_tokens = sum(n if text else min(n, seq) for n in lengths) / len(lengths)
        siblings = [s for s in data.sources if s.modality == src.modality]
        share = max(
            p.weights.get(src.modality, 0.0) / sum(p.weights.values()) for p in data.mixture
        )
        share *= src.weight / sum(s.weight for s in siblings)
        per_step = share * step_tokens / mean_tokens
        where = f"data.sources[{i}]"
        what = (
            "split into chunks of seqLength (each chunk packed as its own sample)"
            if text
            else "cut to seqLength tokens (their media shrunk to fit)"
        )
        msg = (
            f"{over:.0%} of {src.name!r} samples are longer than data.seqLength ({seq}; lengths "
            f"{min(lengths)}..{max(lengths)} tokens after lengthScale {src.length_scale}) and "
            f"are {what}: about {over * per_step:.1f} of its ~{per_step:.1f} samples per step "
            "where the mixture gives it its largest share"
        )
        if over == 1.0 and not text:
            errors.append((where, f"{msg}; raise seqLength above {min(lengths)} or lower "
                           "lengthScale"))  # fmt: skip
        else:
            warnings.append((where, f"{msg}; raise seqLength to keep them whole"))
    return errors, warnings
