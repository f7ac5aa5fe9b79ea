"""Read-ahead and decoding workers change when data is read, never what: the same batches,
arrays, counters and loader state at every step boundary as decoding on the training thread."""

from __future__ import annotations

import numpy as np
import yaml

from omni_trainer.components.dataplane import DataPlane
from omni_trainer.config import parse_manifest
from omni_trainer.data.tinyset import make_tiny_dataset

from ...conftest import EXAMPLES


def _config(data: str, workers: int):
    doc = yaml.safe_load((EXAMPLES / "llava-tiny.yaml").read_text())
    spec = doc["spec"]["trainer"]
    spec["tokenizer"] = f"{data}/tokenizer"
    spec["data"]["sources"][0]["url"] = f"{data}/train.json"
    spec["data"]["prefetch"] = {"workers": workers, "depth": {"image": 2, "audio": 1}}
    return parse_manifest(doc).spec.trainer


def _ids(batch):
    return [s.sample_id for seq in batch for s in seq.samples]


def test_read_ahead_is_invisible_to_batches_state_and_counters(tmp_path):
    make_tiny_dataset(str(tmp_path), images=60, audio=12, corrupt=[4], missing=[9])
    ahead = DataPlane(_config(str(tmp_path), 2), dp_rank=0, dp_size=1, group=None, read_ahead=True)
    plain = DataPlane(_config(str(tmp_path), 0), dp_rank=0, dp_size=1, group=None)
    assert ahead.depth == {"image": 2, "audio": 1} and not plain.depth
    try:
        for step in range(5):
            a, b = ahead.next_local_batch(), plain.next_local_batch()
            assert _ids(a) == _ids(b)
            refs = [r for seq in a for s in seq.samples for r in (sp.ref for sp in s.spans)]
            for ref in refs:
                np.testing.assert_array_equal(ahead.media.load(ref), plain.media.load(ref))
            assert ahead.state_dict() == plain.state_dict(), f"state after step {step}"
            mine = {k: v for k, v in ahead.counters.items() if not k.startswith("media")}
            assert mine == {k: v for k, v in plain.counters.items() if not k.startswith("media")}
        assert ahead.media.prefetcher.hits > 0 and len(ahead._ahead) == 2
        skipped = ahead.counters["skipped_samples"]  # once per epoch of the small dataset
        assert set(skipped) == {"corrupt", "missing"} and skipped["corrupt"] == skipped["missing"]
        # a resume rewinds the read-ahead: both continue identically from the saved state
        saved = plain.state_dict()
        a0, b0 = ahead.next_local_batch(), plain.next_local_batch()
        ahead.load_state_dict(saved)
        plain.load_state_dict(saved)
        assert _ids(ahead.next_local_batch()) == _ids(plain.next_local_batch()) == _ids(a0)
        assert _ids(a0) == _ids(b0)
    finally:
        ahead.close()
        plain.close()
