"""``kind: webdataset``: standard WebDataset tars of media + caption or conversation.

Each tar is indexed once (member byte ranges grouped by key); a sample's media and text are read
by byte range, locally or from S3. Everything else (header-only lengths, the chat template, loss
on the reply, skips by reason, decoding on the encoding rank) is :class:`ConversationSource`'s.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

from omni_trainer.data.conversations import ConversationSource, with_text
from omni_trainer.data.sample import Skipped
from omni_trainer.data.shards import scan_members
from omni_trainer.storage.blobs import list_dir, read_bytes
from omni_trainer.storage.s3 import is_s3

EXTENSIONS = {"image": ("jpg", "jpeg", "png", "webp"), "audio": ("wav", "flac", "mp3"),
              "video": ("mp4",)}  # fmt: skip


def list_tars(url: str) -> list[str]:
    """The ``.tar`` files of a directory, a glob or an ``s3://`` prefix, sorted."""
    if is_s3(url):
        base = url.rstrip("/")
        return [f"{base}/{n}" for n in list_dir(url) if n.endswith(".tar")]
    if os.path.isdir(url):
        return sorted(glob.glob(os.path.join(url, "*.tar")))
    return sorted(p for p in glob.glob(url) if p.endswith(".tar"))


class WebDatasetSource(ConversationSource):
    """Random access over WebDataset tars: ``get(i)`` is keyed sample ``i % num_samples``."""

    def _index(self) -> int:
        self.tars = list_tars(self.config.url)
        if not self.tars:
            raise FileNotFoundError(f"source {self.name!r}: {self.config.url!r} has no .tar files")
        self.entries: list[tuple[int, str, dict[str, list[int]]]] = []
        for t, tar in enumerate(self.tars):
            for e in scan_members(read_bytes(tar)):
                if "txt" in e["members"] or "json" in e["members"]:
                    self.entries.append((t, e["key"], e["members"]))
        if not self.entries:
            raise FileNotFoundError(f"source {self.name!r}: no sample with a .txt or .json")
        return len(self.entries)

    def _member(self, index: int, suffix: str) -> bytes:
        t, _, members = self.entries[index % len(self.entries)]
        off, size = members[suffix]
        return read_bytes(self.tars[t], off, off + size)

    def _record(self, index: int) -> dict[str, Any] | Skipped:
        _, key, members = self.entries[index % len(self.entries)]
        record: dict[str, Any] = {"id": key}
        for modality, exts in EXTENSIONS.items():
            record[modality] = [ext for ext in exts if ext in members]
        try:
            meta = json.loads(self._member(index, "json")) if "json" in members else {}
            caption = self._member(index, "txt").decode() if "txt" in members else None
        except (ValueError, UnicodeDecodeError) as err:
            return Skipped(f"{self.name}/{key}", "malformed", f"unreadable text: {err}")
        if not isinstance(meta, dict):
            return Skipped(f"{self.name}/{key}", "malformed", ".json is not an object")
        fields = meta | ({"caption": caption} if caption is not None else {})
        return with_text(record, fields, self.config.prompt, f"{self.name}/{key}")

    def _open(self, index: int, rel: str) -> bytes:
        return self._member(index, rel)
