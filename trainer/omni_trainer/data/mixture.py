"""Modality mixture that moves with tokens seen, realized by deterministic token-deficit scheduling.

No randomness: each draw goes to the modality (then the source) furthest behind its target, where a
target integrates the schedule's share over the tokens drawn so far. Realized token shares so track
the schedule within about one sample, in any window, and a restore needs only a few counters.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

from omni_trainer.data.config import MODALITIES, MixturePoint, Modality


class MixtureSchedule:
    """Modality token shares as a function of tokens seen (piecewise linear, then constant)."""

    def __init__(self, points: Sequence[MixturePoint], *, token_scale: float = 1.0) -> None:
        """``token_scale`` converts tokens seen here to the schedule's (global) tokens: a loader
        shard that sees 1/K of the data passes K."""
        if not points or points[0].at_tokens != 0:
            raise ValueError("mixture: the first point must be at atTokens 0")
        self.points = list(points)
        self.token_scale = token_scale
        self.modalities: tuple[Modality, ...] = tuple(
            m for m in MODALITIES if any(p.weights.get(m, 0) > 0 for p in points)
        )
        self._at = [p.at_tokens for p in self.points]
        self._shares = [self._normalize(p.weights) for p in self.points]

    def _normalize(self, w: dict[Modality, float]) -> list[float]:
        total = sum(w.values())
        return [w.get(m, 0.0) / total for m in self.modalities]

    def weights(self, tokens_seen: int) -> dict[Modality, float]:
        """Shares (summing to 1) after ``tokens_seen`` tokens."""
        tokens_seen = tokens_seen * self.token_scale
        i = bisect.bisect_right(self._at, tokens_seen) - 1
        if i >= len(self.points) - 1:
            shares = self._shares[-1]
        else:
            t = (tokens_seen - self._at[i]) / (self._at[i + 1] - self._at[i])
            shares = [
                a + t * (b - a) for a, b in zip(self._shares[i], self._shares[i + 1], strict=True)
            ]
        return dict(zip(self.modalities, shares, strict=True))


class DeficitMixer:
    """Chooses which source the next sample comes from, and keeps the token accounting."""

    def __init__(
        self, schedule: MixtureSchedule, sources: Sequence[tuple[Modality, float]]
    ) -> None:
        """``sources[i] = (modality, weight)`` of stream source ``i``."""
        self.schedule = schedule
        self.sources = list(sources)
        for m in schedule.modalities:
            if not any(sm == m for sm, _ in sources):
                raise ValueError(f"mixture gives {m!r} a share but no source has that modality")
        self._members: dict[str, list[int]] = {
            m: [i for i, (sm, _) in enumerate(sources) if sm == m] for m in schedule.modalities
        }
        self.total = 0
        self.tokens: dict[str, int] = dict.fromkeys(schedule.modalities, 0)
        self.target: dict[str, float] = dict.fromkeys(schedule.modalities, 0.0)
        self.source_tokens = [0] * len(sources)
        self.source_target = [0.0] * len(sources)

    def choose(self) -> int:
        """Index of the source to draw from next (largest token deficit, modality then source)."""
        shares = self.schedule.weights(self.total)
        live = [m for m in self.schedule.modalities if shares[m] > 0]
        modality = max(live, key=lambda m: self.target[m] + shares[m] - self.tokens[m])
        members = self._members[modality]
        wsum = sum(self.sources[i][1] for i in members)
        return max(
            members,
            key=lambda i: self.source_target[i] + self.sources[i][1] / wsum - self.source_tokens[i],
        )

    def record(self, source: int, num_tokens: int) -> None:
        """Account ``num_tokens`` drawn from ``source`` (0 for a skipped sample)."""
        if num_tokens <= 0:
            return
        shares = self.schedule.weights(self.total)
        for m, share in shares.items():
            self.target[m] += share * num_tokens
        modality = self.sources[source][0]
        self.tokens[modality] += num_tokens
        members = self._members[modality]
        wsum = sum(self.sources[i][1] for i in members)
        for i in members:
            self.source_target[i] += self.sources[i][1] / wsum * num_tokens
        self.source_tokens[source] += num_tokens
        self.total += num_tokens

    def state_dict(self) -> dict[str, Any]:
        """Counters (JSON-safe; floats round-trip exactly)."""
        return {
            "total": self.total,
            "tokens": dict(self.tokens),
            "target": dict(self.target),
            "source_tokens": list(self.source_tokens),
            "source_target": list(self.source_target),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore counters saved by :meth:`state_dict`."""
        if len(state["source_tokens"]) != len(self.sources):
            raise ValueError(
                f"mixture state has {len(state['source_tokens'])} sources, "
                f"the config has {len(self.sources)}"
            )
        self.total = int(state["total"])
        self.tokens = {m: int(state["tokens"].get(m, 0)) for m in self.tokens}
        self.target = {m: float(state["target"].get(m, 0.0)) for m in self.target}
        self.source_tokens = [int(x) for x in state["source_tokens"]]
        self.source_target = [float(x) for x in state["source_target"]]
