"""``kind: parquet``: Hugging Face datasets exported to parquet (media bytes in columns).

Rows are located through the files' metadata (row counts per row group); a row is read with its
row group (the last few are cached), so sequential cursors read each group once. Media bytes come
from the row; everything else is :class:`ConversationSource`'s.
"""

from __future__ import annotations

import glob
import io
import os
from bisect import bisect_right
from collections import OrderedDict
from typing import Any

from omni_trainer.data.conversations import ConversationSource, with_text
from omni_trainer.data.sample import Skipped
from omni_trainer.storage.blobs import list_dir, read_bytes
from omni_trainer.storage.s3 import is_s3

MEDIA_COLUMNS = {"image": ("image", "images"), "audio": ("audio",), "video": ("video",)}
CACHED_GROUPS = 4


def list_parquet(url: str) -> list[str]:
    """The ``.parquet`` files of a directory, a glob or an ``s3://`` prefix, sorted."""
    if is_s3(url):
        if url.endswith(".parquet"):
            return [url]
        return [f"{url.rstrip('/')}/{n}" for n in list_dir(url) if n.endswith(".parquet")]
    if os.path.isdir(url):
        return sorted(glob.glob(os.path.join(url, "*.parquet")))
    return sorted(p for p in glob.glob(url) if p.endswith(".parquet"))


def _media_bytes(value: Any) -> bytes | None:
    """HF's Image/Audio cell (``{bytes, path}``) or raw bytes."""
    if isinstance(value, dict):
        value = value.get("bytes")
    return value if isinstance(value, bytes) and value else None


class ParquetSource(ConversationSource):
    """Random access over parquet rows: ``get(i)`` is row ``i % num_samples`` of all files."""

    def _index(self) -> int:
        import pyarrow.parquet as pq

        self.files = list_parquet(self.config.url)
        if not self.files:
            raise FileNotFoundError(f"source {self.name!r}: {self.config.url!r} has no .parquet")
        self._groups: list[tuple[int, int]] = []  # (file, row group) in order
        self._starts: list[int] = []  # first global row of each group
        total = 0
        for f, path in enumerate(self.files):
            meta = pq.ParquetFile(self._handle(path)).metadata
            for g in range(meta.num_row_groups):
                self._groups.append((f, g))
                self._starts.append(total)
                total += meta.row_group(g).num_rows
        if total == 0:
            raise FileNotFoundError(f"source {self.name!r}: the parquet files have no rows")
        self._cache: OrderedDict[int, list[dict]] = OrderedDict()
        return total

    def _handle(self, path: str) -> Any:
        return io.BytesIO(read_bytes(path)) if is_s3(path) else path

    def _row(self, index: int) -> dict[str, Any]:
        import pyarrow.parquet as pq

        i = index % self.num_samples
        k = bisect_right(self._starts, i) - 1
        if k not in self._cache:
            f, g = self._groups[k]
            table = pq.ParquetFile(self._handle(self.files[f])).read_row_group(g)
            self._cache[k] = table.to_pylist()
            if len(self._cache) > CACHED_GROUPS:
                self._cache.popitem(last=False)
        self._cache.move_to_end(k)
        return self._cache[k][i - self._starts[k]]

    def _record(self, index: int) -> dict[str, Any] | Skipped:
        row = self._row(index)
        key = str(row.get("id", index % self.num_samples))
        record: dict[str, Any] = {"id": key}
        for modality, columns in MEDIA_COLUMNS.items():
            cells = [c for col in columns for c in _as_list(row.get(col))]
            record[modality] = [f"{modality}:{j}" for j in range(len(cells))]
        return with_text(record, row, self.config.prompt, f"{self.name}/{key}")

    def _open(self, index: int, rel: str) -> bytes:
        modality, _, j = rel.partition(":")
        row = self._row(index)
        cells = [c for col in MEDIA_COLUMNS[modality] for c in _as_list(row.get(col))]
        data = _media_bytes(cells[int(j)])
        if data is None:
            raise FileNotFoundError(f"{rel}: the cell holds no bytes")
        return data


def _as_list(value: Any) -> list:
    if value is None:
        return []
    return value if isinstance(value, list) else [value]
