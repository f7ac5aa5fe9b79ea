"""The network preflight's rules (pure): which node leaders time a link together, the bus
bandwidth formulas, and the verdict that names the slow or silent nodes.

Attribution. A link is timed between two node leaders, so one figure involves two nodes. The
leaders time the edges of a ring (node i with node i+1) in two or three phases where every node
is in at most one pair; a node's figure is the *best* of its links: a healthy node has at least
one healthy neighbour, a slow node has none. A node below the threshold is only a suspect until
it is timed again paired with the best node (the reference): that clears a healthy node whose two
neighbours were both slow. What cannot be attributed: with two nodes there is one link and no
third node to compare, so a slow link names both nodes (``attributed`` False); when every node is
slow, nothing is below the median and only ``minBandwidthGBps`` catches it; likewise when half
the nodes look slow (a healthy node between two slow ones looks slow too) the median sinks.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace

from pydantic import Field

from omni_trainer.config_base import Spec
from omni_trainer.termination import LIMIT_BYTES

MESSAGE_PREFIX = "PreflightFailed: "
"""How a failed preflight starts the pod's termination message (JSON after it)."""
EXIT_PREFLIGHT = 75
"""The trainer's exit code when its preflight failed (EX_TEMPFAIL: another node may do)."""


class PreflightConfig(Spec):
    """``spec.preflight``: a short bandwidth check across the gang before step 1 of an attempt."""

    enabled: bool | None = Field(
        None, description="run the check; default: on when the job spans more than one node"
    )
    size_mb: float = Field(
        64.0, gt=0, le=4096, description="MiB per all-reduce, all-gather and link exchange"
    )
    iterations: int = Field(5, ge=1, le=100, description="timed repetitions (after one warm-up)")
    min_bandwidth_gbps: float = Field(
        0.0, ge=0, description="a node whose best link is below this (GB/s) fails; 0: no floor"
    )
    min_fraction_of_median: float = Field(
        0.5,
        ge=0,
        lt=1,
        description="a node whose best link is below this fraction of the median node fails "
        "(needs three nodes or more); 0: off",
    )
    timeout_seconds: int = Field(
        120, ge=5, description="a node that does not answer for this long fails the check"
    )

    def applies(self, nodes: int) -> bool:
        return self.enabled if self.enabled is not None else nodes > 1

    @property
    def nbytes(self) -> int:
        return int(self.size_mb * 2**20) // 4 * 4  # whole float32 elements


# -- formulas (nccl-tests' bus bandwidth, GB/s = 1e9 bytes/s) -----------------------------------
def all_reduce_bus_gbps(nbytes: int, seconds: float, n: int) -> float:
    """All-reduce bus bandwidth: ``2(n-1)/n x bytes / t``."""
    return 2 * (n - 1) / n * nbytes / seconds / 1e9


def all_gather_bus_gbps(nbytes: int, seconds: float, n: int) -> float:
    """All-gather bus bandwidth, ``nbytes`` the gathered total: ``(n-1)/n x bytes / t``."""
    return (n - 1) / n * nbytes / seconds / 1e9


def link_gbps(nbytes: int, seconds: float | None) -> float | None:
    """One direction of a bidirectional exchange of ``nbytes``; None when it timed out."""
    return None if seconds is None else nbytes / seconds / 1e9


# -- who times what -----------------------------------------------------------------------------
def node_leaders(node_of_rank: Sequence[str]) -> dict[str, int]:
    """Each node's lowest global rank, nodes in the order of their first rank."""
    leaders: dict[str, int] = {}
    for rank, node in enumerate(node_of_rank):
        leaders.setdefault(node, rank)
    return leaders


def ring_phases(n: int) -> list[list[tuple[int, int]]]:
    """The ring's links (node indexes) in phases where no node is in two pairs."""
    if n < 2:
        return []
    if n == 2:
        return [[(0, 1)]]
    edges = [(i, (i + 1) % n) for i in range(n)]
    phases = [edges[0 : n - (n % 2) : 2], edges[1 : n - (n % 2) : 2]]
    if n % 2:
        phases.append([edges[-1]])
    return phases


# -- the verdict --------------------------------------------------------------------------------
Link = tuple[str, str]


def best_per_node(
    nodes: Sequence[str], links: Mapping[Link, float | None]
) -> dict[str, float | None]:
    """Each node's best link (GB/s); None when no link of it answered."""
    out: dict[str, float | None] = {}
    for node in nodes:
        figures = [g for (a, b), g in links.items() if node in (a, b) and g is not None]
        out[node] = max(figures) if figures else None
    return out


def threshold_gbps(
    best: Mapping[str, float | None], cfg: PreflightConfig
) -> tuple[float, float | None]:
    """The floor and the median it came from (None with fewer than three answering nodes)."""
    answered = [g for g in best.values() if g is not None]
    median = statistics.median(answered) if len(answered) >= 3 else None
    relative = cfg.min_fraction_of_median * median if median is not None else 0.0
    return max(cfg.min_bandwidth_gbps, relative), median


def suspects(best: Mapping[str, float | None], floor: float) -> list[str]:
    """Nodes without an answering link or whose best link is below ``floor``."""
    return [n for n, g in best.items() if g is None or g < floor]


def reference_node(best: Mapping[str, float | None], exclude: Sequence[str]) -> str | None:
    """The best node that is no suspect: every suspect is timed again paired with it."""
    clear = [(g, n) for n, g in best.items() if g is not None and n not in exclude]
    return max(clear)[1] if clear else None


@dataclass
class PreflightResult:
    """What the check found; ``failed`` names the nodes to replace."""

    nodes: dict[str, float | None]
    """Each node's figure: its best link, or its link with the reference when it was retimed."""
    all_reduce_gbps: float | None = None
    all_gather_gbps: float | None = None
    median_gbps: float | None = None
    floor_gbps: float = 0.0
    failed: list[str] = field(default_factory=list)
    attributed: bool = True
    complete: bool = True
    """False when a peer stopped answering before the figures were gathered."""
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.complete and not self.failed

    def describe(self) -> str:
        """One line for a human (logs, Events)."""
        figs = ", ".join(f"{n} {_gbps(g)}" for n, g in self.nodes.items())
        world = (
            f"; all-reduce {_gbps(self.all_reduce_gbps)}, all-gather {_gbps(self.all_gather_gbps)}"
            if self.all_reduce_gbps is not None
            else ""
        )
        head = "passed" if self.passed else f"failed on {', '.join(self.failed) or 'a peer'}"
        why = "" if self.attributed else " (two nodes, one link: the slow side cannot be told)"
        floor = f"floor {self.floor_gbps:.3g} GB/s" + (
            f" (median {self.median_gbps:.3g})" if self.median_gbps is not None else ""
        )
        return f"network preflight {head}{why}: links {figs}{world}; {floor}; {self.seconds:.1f} s"

    def to_json(self) -> str:
        return json.dumps(asdict(self) | {"passed": self.passed}, separators=(",", ":"))


def _gbps(g: float | None) -> str:
    return "no answer" if g is None else f"{g:.3g} GB/s"


def judge(
    nodes: Sequence[str],
    links: Mapping[Link, float | None],
    cfg: PreflightConfig,
    *,
    retimed: Mapping[str, float | None] | None = None,
) -> PreflightResult:
    """The verdict from the ring's links and, for the suspects, their link with the reference
    node (``retimed``; None: not retimed yet, the suspects stand)."""
    best = best_per_node(nodes, links)
    floor, median = threshold_gbps(best, cfg)
    found = suspects(best, floor)
    figures = dict(best)
    if retimed is not None:
        figures.update(retimed)
        found = [n for n in found if retimed.get(n) is None or retimed[n] < floor]
    attributed = len(nodes) > 2
    return PreflightResult(
        nodes=figures,
        median_gbps=median,
        floor_gbps=floor,
        failed=list(nodes) if found and not attributed else found,
        attributed=attributed or not found,
    )


def failure_message(result: PreflightResult) -> str:
    """The termination message the operator classifies as PreflightFailed; with a large gang
    only the failed nodes' figures, within the size Kubernetes keeps."""
    text = MESSAGE_PREFIX + result.to_json()
    if len(text.encode()) <= LIMIT_BYTES:
        return text
    kept = {n: g for n, g in result.nodes.items() if n in result.failed}
    return MESSAGE_PREFIX + replace(result, nodes=kept).to_json()


def parse_failure(message: str) -> dict | None:
    """The result in a PreflightFailed termination message, else None."""
    if not message.startswith(MESSAGE_PREFIX):
        return None
    try:
        doc = json.loads(message[len(MESSAGE_PREFIX) :])
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None
