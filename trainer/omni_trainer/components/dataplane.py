"""This rank's share of every global batch: its loader shards, then grouped reordering.

Decentralized loading (the paper's technique 7): each data-parallel rank runs the loaders it hosts
and never sees the rest of the global batch. Inside a reorder group (network-local data-parallel
ranks) the ranks all-gather only metadata (one cost and size per sequence), compute the same
Karmarkar-Karp plan, and move whole packed sequences with one all-to-all. Reordering between
data-parallel replicas does not change the math: the loss is a sum over the global batch.
Sequences carry media as references, so the all-to-all moves token ids and references, never
pixels: the rank that encodes a medium reads it itself (``DataPlane.media``).
"""

from __future__ import annotations

import pickle
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch.distributed as dist

from omni_trainer.balance.cost import cost_from_config, cost_from_llm_config
from omni_trainer.balance.reorder import ItemMeta, ReorderPlan, plan_reorder
from omni_trainer.config import TrainerConfig
from omni_trainer.data.loader import MediaReader, MultimodalStream, hosted_shards
from omni_trainer.data.packing import PackedSequence
from omni_trainer.data.sample import MediaRef, media_geometry
from omni_trainer.distributed import comm
from omni_trainer.models.config import ModelConfig


@dataclass(frozen=True)
class ReorderStats:
    """One step of one group: balance before and after, and the traffic it cost."""

    bytes_moved: int
    """What the all-to-all carried, whole group: pickled sequences (token ids + media refs)."""
    media_bytes_referenced: int
    """Media bytes of the sequences that changed rank: what moving arrays would have added;
    their new rank reads the ones it encodes from the source instead."""
    max_over_mean_before: float
    max_over_mean_after: float


def sequence_cost(model: ModelConfig) -> Callable[[PackedSequence], float]:
    """FLOPs a packed sequence costs its rank: LLM over its samples plus their encoders."""
    llm = cost_from_llm_config(model.llm)
    encoders = {
        m: cost_from_config(getattr(model.encoders, m))
        for m in ("image", "audio")
        if getattr(model.encoders, m) is not None
    }

    def cost(seq: PackedSequence) -> float:
        total = 0.0
        for seg in seq.segments:
            total += llm(seg.length)
            for modality, n in seg.media_lengths():
                total += encoders[modality](n)
        return total

    return cost


def sequence_bytes(seq: PackedSequence) -> int:
    """What moving the sequence costs: its pickle (token ids and media references)."""
    return len(pickle.dumps(seq, protocol=pickle.HIGHEST_PROTOCOL))


def media_bytes(seq: PackedSequence) -> int:
    """Bytes of the media arrays the sequence refers to."""
    return sum(
        (s.media.nbytes if s.media is not None else 0) + sum(sp.ref.nbytes for sp in s.spans)
        for s in seq.samples
    )


class DataPlane:
    """The loaders of one data-parallel rank and its reorder group."""

    def __init__(
        self,
        cfg: TrainerConfig,
        *,
        dp_rank: int,
        dp_size: int,
        group: dist.ProcessGroup | None,
        read_ahead: bool = False,
    ) -> None:
        data = cfg.data
        num_shards = data.shards_for(dp_size)
        self.streams = [
            MultimodalStream(
                data,
                seed=cfg.seed,
                vocab_size=cfg.model.llm.vocab_size,
                geometry=media_geometry(cfg.model),
                shard=s,
                num_shards=num_shards,
                tokenizer=cfg.tokenizer,
            )
            for s in hosted_shards(num_shards, dp_rank, dp_size)
        ]
        self.media = MediaReader(self.streams[0].sources, workers=data.prefetch.workers)
        """Loads the media this rank encodes, whichever rank's loader drew it."""
        self.group = group
        self.group_size = dist.get_world_size(group) if group is not None else 1
        self.group_rank = dist.get_rank(group) if group is not None else 0
        self.method = data.reorder.method
        stays = self.group_size == 1 or self.method == "none"
        self.depth = (
            dict(data.prefetch.depth) if read_ahead and stays and data.prefetch.workers else {}
        )
        """Steps read ahead per modality: only where this rank encodes all it draws."""
        self._drawer = ThreadPoolExecutor(1, "omni-draw") if any(self.depth.values()) else None
        """Draws future steps (reads headers, renders conversations) off the training thread;
        the only user of the streams while a draw is pending."""
        self._ahead: deque[Future[tuple[list[dict], list[PackedSequence]]]] = deque()
        """Future steps: (every stream's state before the draw, the local batch)."""
        self.cost = sequence_cost(cfg.model)
        self.last_stats: ReorderStats | None = None

    def next_local_batch(self) -> list[PackedSequence]:
        """This rank's ``globalBatchSize / dp`` sequences of the next step, reordered."""
        local = self._ahead.popleft().result()[1] if self._ahead else self._draw()
        if self.group_size == 1 or self.method == "none":
            self._read_ahead()
            return local
        metas = [(self.cost(seq), sequence_bytes(seq), media_bytes(seq)) for seq in local]
        gathered = comm.all_gather_object(metas, group=self.group)
        costs = {
            f"{r}:{i}": c for r, items in enumerate(gathered) for i, (c, _, _) in enumerate(items)
        }
        plan = plan_reorder(
            [
                [ItemMeta(f"{r}:{i}", 0, "sequence", meta[1]) for i, meta in enumerate(items)]
                for r, items in enumerate(gathered)
            ],
            cost=lambda item: costs[item.sample_id],
            equal_cardinality=True,
            method=self.method,
        )
        self.last_stats = ReorderStats(
            bytes_moved=plan.bytes_moved,
            media_bytes_referenced=sum(
                gathered[src][i][2]
                for dst, items in enumerate(plan.assignments)
                for src, i in items
                if src != dst
            ),
            max_over_mean_before=_max_over_mean(plan.loads_before),
            max_over_mean_after=plan.max_over_mean,
        )
        return self._exchange(local, plan)

    def _draw(self) -> list[PackedSequence]:
        return [seq for stream in self.streams for seq in stream.next_batch()]

    def _read_ahead(self) -> None:
        """Keep the deepest read-ahead drawn in the background; each drawn step's media are
        submitted to the decoders within their modality's depth. The streams' states before the
        first early draw stay what a checkpoint saves."""
        if self._drawer is None:
            return
        while len(self._ahead) < max(self.depth.values()):
            self._ahead.append(self._drawer.submit(self._draw_ahead, len(self._ahead) + 1))
        for k, pending in enumerate(self._ahead, start=1):
            if pending.done():  # moved closer: modalities of smaller depth become due
                self._prefetch(pending.result()[1], k)

    def _draw_ahead(self, k: int) -> tuple[list[dict], list[PackedSequence]]:
        states = [stream.state_dict() for stream in self.streams]
        batch = self._draw()
        self._prefetch(batch, k)
        return states, batch

    def _prefetch(self, batch: list[PackedSequence], k: int) -> None:
        """Submit the media of a batch ``k`` steps ahead whose modality reads that far."""
        self.media.prefetch(
            ref
            for seq in batch
            for sample in seq.samples
            for modality, ref in _refs(sample)
            if k <= self.depth.get(modality, 0)
        )

    def _exchange(self, local: list[PackedSequence], plan: ReorderPlan) -> list[PackedSequence]:
        """One all-to-all of pickled sequences; every rank ends with ``plan.assignments[me]``."""
        me = self.group_rank
        received = comm.exchange_objects(
            [[local[i] for i in idx] for idx in plan.sends(me)], group=self.group
        )
        by_source: dict[tuple[int, int], PackedSequence] = {}
        for src, seqs in enumerate(received):
            for seq, index in zip(seqs, _sent_indices(plan, src, me), strict=True):
                by_source[(src, index)] = seq
        return [by_source[key] for key in plan.assignments[me]]

    @property
    def counters(self) -> dict:
        """This rank's loaders' counters, summed, and the media this rank loaded (global figures
        need a sum over ranks)."""
        total: dict = dict(self.media.counters)
        for i, stream in enumerate(self.streams):  # as of the step boundary (no read-ahead)
            counters = self._ahead[0].result()[0][i]["counters"] if self._ahead else stream.counters
            for key, value in counters.items():
                if isinstance(value, dict):
                    bucket = total.setdefault(key, {})
                    for k, v in value.items():
                        bucket[k] = bucket.get(k, 0) + v
                else:
                    total[key] = total.get(key, 0) + value
        return total

    def state_dict(self) -> dict:
        """Every hosted stream's state at the step boundary (before any read-ahead draw)."""
        if self._ahead:
            states = self._ahead[0].result()[0]
        else:
            states = [s.state_dict() for s in self.streams]
        return {"shards": {str(s.shard): st for s, st in zip(self.streams, states, strict=True)}}

    def load_state_dict(self, state: dict) -> None:
        for pending in self._ahead:  # the streams are this thread's again
            pending.result()
        self._ahead.clear()
        if self.media.prefetcher is not None:
            self.media.prefetcher.clear()
        for stream in self.streams:
            stream.load_state_dict(state["shards"][str(stream.shard)])

    def close(self) -> None:
        """Stop the drawing and decoding workers."""
        if self._drawer is not None:
            self._drawer.shutdown(wait=True, cancel_futures=True)
        self.media.close()


def _refs(sample) -> list[tuple[str, MediaRef]]:
    """(modality, reference) of every media item of a sample."""
    head = [(sample.modality, sample.media)] if sample.media is not None else []
    return head + [(sp.modality, sp.ref) for sp in sample.spans]


def _sent_indices(plan: ReorderPlan, src: int, dst: int) -> tuple[int, ...]:
    """Indices (on ``src``) of the items ``src`` sends to ``dst``, in sending order."""
    return plan.sends(src)[dst]


def _max_over_mean(loads) -> float:
    total = sum(loads)
    return max(loads) * len(loads) / total if total > 0 else 1.0
