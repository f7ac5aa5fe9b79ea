"""Decentralized loader shards: disjoint samples, deterministic, restorable, mixture kept."""

from __future__ import annotations

import pytest

from omni_trainer.data.loader import MultimodalStream


def _ids(batch) -> list[str]:
    return [s.sample_id for seq in batch for s in seq.samples]


def test_shards_read_disjoint_samples_and_fill_their_share(make_config, geometry) -> None:
    cfg = make_config(loaderShards=4, globalBatchSize=8)
    streams = [
        MultimodalStream(cfg, seed=3, vocab_size=256, geometry=geometry, shard=s, num_shards=4)
        for s in range(4)
    ]
    seen: list[str] = []
    for _ in range(3):
        for st in streams:
            batch = st.next_batch()
            assert len(batch) == 2  # globalBatchSize / loaderShards
            seen += [i for i in _ids(batch) if "#" not in i]  # text chunks share an id prefix
    assert len(seen) == len(set(seen)), "two loaders read the same sample"


def test_shard_is_deterministic_and_restores(make_config, geometry) -> None:
    cfg = make_config(loaderShards=2, globalBatchSize=4)

    def stream():
        return MultimodalStream(
            cfg, seed=5, vocab_size=256, geometry=geometry, shard=1, num_shards=2
        )

    a, b = stream(), stream()
    assert _ids(a.next_batch()) == _ids(b.next_batch())
    state = a.state_dict()
    expected = [_ids(a.next_batch()) for _ in range(3)]
    c = stream()
    c.load_state_dict(state)
    assert [_ids(c.next_batch()) for _ in range(3)] == expected
    other = MultimodalStream(cfg, seed=5, vocab_size=256, geometry=geometry, shard=0, num_shards=2)
    with pytest.raises(ValueError, match="loader state is for shard 1 of 2, not 0 of 2"):
        other.load_state_dict(state)


def test_loader_shards_must_divide_global_batch(make_config) -> None:
    with pytest.raises(ValueError, match=r"loaderShards \(3\) must divide globalBatchSize \(8\)"):
        make_config(loaderShards=3, globalBatchSize=8)
