"""Where checkpoints live: a filesystem path (a PVC) or ``s3://bucket/prefix``.

Layout under the root::

    <root>/step-00000042/model/.metadata         torch DCP metadata (global, written by rank 0)
    <root>/step-00000042/model/__<rank>_0.distcp  torch DCP data, one file per writing rank
    <root>/step-00000042/loader/rank-00000.json  loader state (one file, or one per rank)
    <root>/step-00000042/COMMITTED               commit marker, written LAST

A step counts only when its marker exists and every file it lists is present with the listed
size: a crash, a failed upload or a lost file therefore never yields a checkpoint that a restart
would load. Pure bookkeeping (discovery, retention) lives in the base class over a few storage
primitives, so the filesystem and S3 behave identically.

Attempts are fenced: ``<root>/FENCE`` holds the newest restart attempt that claimed the root
(:meth:`CheckpointStorage.claim`, an atomic compare-and-swap: a lock on a filesystem, S3
conditional writes) and the step it resumed from. Old pods keep running for their grace period
after a restart, so a superseded attempt may still try to commit or prune: both check the fence
first and raise :class:`Fenced`; markers carry their attempt, and one committed by a superseded
attempt past the step the newer one resumed from (it slipped between check and write) is not
counted. Retention never deletes the step the current attempt resumed from.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO

from omni_trainer.storage.s3 import is_s3, s3_client, split_s3

log = logging.getLogger(__name__)

MARKER = "COMMITTED"
FENCE = "FENCE"
FORMAT = "omni-checkpoint/1"
_STEP_RE = re.compile(r"^step-(\d{8})$")


def step_name(step: int) -> str:
    """The directory name of ``step`` (zero-padded so names sort like steps)."""
    return f"step-{step:08d}"


@dataclass(frozen=True)
class FileEntry:
    """What the commit marker records of one file."""

    size: int
    sha256: str


def describe_file(path: Path) -> FileEntry:
    """Size and sha256 of a local file (streamed: checkpoint files can be GBs)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(8 << 20):
            digest.update(block)
    return FileEntry(size=path.stat().st_size, sha256=digest.hexdigest())


class Fenced(RuntimeError):
    """This attempt was superseded: a newer one started on the same checkpoints."""


def superseded(marker: dict[str, Any], fence: dict[str, Any] | None) -> bool:
    """Committed by a superseded attempt past the step the newer one resumed from (it slipped
    between its fence check and its marker write): never counted, in any tier."""
    if not fence or "resumedFrom" not in fence or marker.get("attempt") is None:
        return False
    return marker["attempt"] < fence["attempt"] and marker["step"] > fence["resumedFrom"]


def doomed_steps(
    steps: list[int], complete: list[int], *, keep_last: int, fence: dict[str, Any] | None
) -> list[int]:
    """The steps retention deletes: all but the newest ``keep_last`` complete ones and the
    step the current attempt resumed from (it may still be loading it); partial steps newer
    than the newest complete one are kept (their save may still be in flight)."""
    if not complete:
        return []
    keep = set(complete[-keep_last:])
    if fence and fence.get("resumedFrom", -1) >= 0:
        keep.add(fence["resumedFrom"])
    return [s for s in steps if s not in keep and s < complete[-1]]


class CheckpointStorage(ABC):
    """A root holding ``step-*`` directories; subclasses supply the I/O primitives."""

    url: str
    attempt: int | None = None
    """The attempt this writer claimed (:meth:`claim`); None: unfenced (a local run)."""
    failing_since: float | None = None
    """When (``time.monotonic``) a request last failed and was being retried; None: none did.
    A save stuck in retries (the store is down) shows here long before it raises."""

    # -- primitives ------------------------------------------------------------------------
    @abstractmethod
    def list_steps(self) -> list[int]:
        """Every step with anything stored, complete or not, ascending."""

    @abstractmethod
    def list_files(self, step: int) -> dict[str, int]:
        """Relative path -> size of every file stored under ``step``."""

    @abstractmethod
    def read_bytes(self, step: int, rel: str) -> bytes | None:
        """A small file's content, or None when it does not exist."""

    @abstractmethod
    def write_bytes(self, step: int, rel: str, data: bytes) -> None:
        """Store a small file whole (atomically: readers see all of it or nothing)."""

    @abstractmethod
    def upload(self, step: int, rel: str, local: Path) -> None:
        """Store a local file (large: multipart on S3)."""

    @abstractmethod
    def download(self, step: int, rel: str, local: Path) -> None:
        """Copy a stored file to ``local``."""

    @abstractmethod
    def delete_step(self, step: int) -> None:
        """Remove a step, its marker first (so it is never 'complete with missing files')."""

    @abstractmethod
    def write_marker(self, step: int, data: bytes) -> None:
        """Store the commit marker only if ``step`` has none (never overwrite a commit)."""

    @abstractmethod
    def swap_root(self, name: str, update: Callable[[bytes | None], bytes]) -> None:
        """Atomically replace a small file at the root with ``update(current)`` (None: none
        yet); a concurrent writer makes ``update`` run again on the newer content."""

    @abstractmethod
    def read_root(self, name: str) -> bytes | None:
        """A small file at the root, or None."""

    def local_dir(self, step: int) -> Path | None:
        """A directory writers may fill in place (filesystem), or None (upload needed)."""
        return None

    # -- fencing ---------------------------------------------------------------------------
    def read_fence(self) -> dict[str, Any] | None:
        raw = self.read_root(FENCE)
        try:
            return None if raw is None else json.loads(raw)
        except ValueError:
            return None

    def claim(self, attempt: int) -> None:
        """Record that ``attempt`` writes here from now on, superseding older attempts.

        Raises:
            Fenced: a newer attempt already claimed the root.
        """

        def update(raw: bytes | None) -> bytes:
            fence = json.loads(raw) if raw else {}
            newer = fence.get("attempt", -1)
            if newer > attempt:
                raise Fenced(f"attempt {attempt} is superseded by attempt {newer} on {self.url}")
            if newer == attempt:
                return raw or b""
            return json.dumps({"attempt": attempt, "time": time.time()}).encode()

        self.swap_root(FENCE, update)
        self.attempt = attempt

    def resumed_from(self, step: int | None) -> None:
        """Record the step the claiming attempt resumed from (None: from scratch)."""
        if self.attempt is None:
            return

        def update(raw: bytes | None) -> bytes:
            fence = json.loads(raw) if raw else {}
            if fence.get("attempt") != self.attempt:
                raise Fenced(f"attempt {self.attempt} lost its claim on {self.url}: {fence}")
            return json.dumps({**fence, "resumedFrom": -1 if step is None else step}).encode()

        self.swap_root(FENCE, update)

    def check_fence(self) -> dict[str, Any] | None:
        """The fence; raises :class:`Fenced` when a newer attempt than ours claimed the root."""
        fence = self.read_fence()
        if self.attempt is not None and fence and fence.get("attempt", -1) > self.attempt:
            raise Fenced(
                f"attempt {self.attempt} is superseded by attempt {fence['attempt']} on "
                f"{self.url}: it may neither commit nor delete checkpoints"
            )
        return fence

    def remove(self, step: int) -> None:
        """Delete a step unless a newer attempt took over (then :class:`Fenced`)."""
        self.check_fence()
        self.delete_step(step)

    # -- commit, discovery, retention --------------------------------------------------------
    def commit(
        self,
        step: int,
        files: dict[str, FileEntry],
        *,
        layout: dict[str, Any],
        extra: dict[str, Any] | None = None,
    ) -> None:
        """Write the marker that makes ``step`` count; call only once every file is stored.

        Raises:
            Fenced: a newer attempt claimed the root (nothing is written).
        """
        self.check_fence()
        self.write_marker(step, self.marker(step, files, layout, extra))

    def marker(
        self,
        step: int,
        files: dict[str, FileEntry],
        layout: dict[str, Any],
        extra: dict[str, Any] | None = None,
    ) -> bytes:
        """The commit marker of ``step`` written by this storage's attempt."""
        marker = {
            **(extra or {}),
            "format": FORMAT,
            "step": step,
            "attempt": self.attempt,
            "time": time.time(),
            "layout": layout,
            "files": {rel: asdict(entry) for rel, entry in sorted(files.items())},
        }
        return json.dumps(marker, indent=1).encode()

    def read_marker(self, step: int) -> dict[str, Any] | None:
        """The parsed marker of ``step``, or None when missing or unreadable."""
        raw = self.read_bytes(step, MARKER)
        if raw is None:
            return None
        try:
            marker = json.loads(raw)
        except ValueError:
            return None
        if marker.get("format") != FORMAT or marker.get("step") != step:
            return None
        return marker

    def problem(self, step: int, fence: dict[str, Any] | None = None) -> str | None:
        """Why ``step`` is not a usable checkpoint, or None when it is complete (``fence``:
        as read once by the caller)."""
        marker = self.read_marker(step)
        if marker is None:
            return "no valid commit marker (partial or interrupted save)"
        if superseded(marker, fence):
            return (
                f"committed by attempt {marker['attempt']} after attempt {fence['attempt']} "
                f"resumed from step {fence['resumedFrom']} (a superseded attempt)"
            )
        stored = self.list_files(step)
        for rel, entry in marker["files"].items():
            if rel not in stored:
                return f"listed file {rel} is missing"
            if stored[rel] != entry["size"]:
                return f"{rel} has {stored[rel]} bytes, the marker says {entry['size']}"
        return None

    def latest_complete(self, skip: Collection[int] = ()) -> int | None:
        """The newest complete step not in ``skip`` (steps that failed verification); newer
        partial or corrupt ones are skipped with a warning."""
        fence = self.read_fence()
        for step in reversed(self.list_steps()):
            if step in skip:
                continue
            reason = self.problem(step, fence)
            if reason is None:
                return step
            log.warning("checkpoint %s/%s skipped: %s", self.url, step_name(step), reason)
        return None

    def retain(self, keep_last: int) -> list[int]:
        """Keep the newest ``keep_last`` complete steps; delete older complete ones and partial
        ones older than the newest complete one (newer partial ones may still be in flight).

        Returns:
            The deleted steps.

        Raises:
            Fenced: a newer attempt claimed the root (nothing is deleted).
        """
        fence = self.check_fence()
        steps = self.list_steps()
        complete = [s for s in steps if self.problem(s, fence) is None]
        doomed = doomed_steps(steps, complete, keep_last=keep_last, fence=fence)
        for s in doomed:
            self.delete_step(s)
        if doomed:
            log.info("checkpoint retention deleted %s", ", ".join(map(step_name, doomed)))
        return doomed

    def open_file(self, step: int, rel: str) -> BinaryIO:
        """A stored file of ``step`` opened for streamed reading (checksum verification)."""
        root = self.local_dir(step)
        if root is None:
            raise NotImplementedError(f"{type(self).__name__} cannot stream {rel}")
        return (root / rel).open("rb")

    def fetch(self, step: int, dest: Path, *, prefix: str = "", verify: bool = False) -> Path:
        """A local directory holding the files of ``step`` under ``prefix`` that its marker lists.

        The filesystem returns the step directory itself (no copy); S3 downloads into ``dest``.
        ``verify`` re-hashes every file against the marker (slow on large checkpoints).
        """
        marker = self.read_marker(step)
        if marker is None:
            raise FileNotFoundError(f"{self.url}/{step_name(step)} has no commit marker")
        wanted = {rel: e for rel, e in marker["files"].items() if rel.startswith(prefix)}
        root = self.local_dir(step)
        if root is None:
            root = dest
            for rel in wanted:
                (root / rel).parent.mkdir(parents=True, exist_ok=True)
                self.download(step, rel, root / rel)
        if verify:
            for rel, entry in wanted.items():
                if describe_file(root / rel).sha256 != entry["sha256"]:
                    raise OSError(f"{self.url}/{step_name(step)}/{rel}: sha256 mismatch")
        return root


class FilesystemStorage(CheckpointStorage):
    """A directory, typically a PVC mounted on every node (writers write in place)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.url = str(self.root)

    def _dir(self, step: int) -> Path:
        return self.root / step_name(step)

    def local_dir(self, step: int) -> Path:
        return self._dir(step)

    def list_steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.root.iterdir() if (m := _STEP_RE.match(p.name)))

    def list_files(self, step: int) -> dict[str, int]:
        base = self._dir(step)
        if not base.is_dir():
            return {}
        return {
            p.relative_to(base).as_posix(): p.stat().st_size
            for p in base.rglob("*")
            if p.is_file() and p.name != MARKER
        }

    def read_bytes(self, step: int, rel: str) -> bytes | None:
        path = self._dir(step) / rel
        return path.read_bytes() if path.is_file() else None

    def write_bytes(self, step: int, rel: str, data: bytes) -> None:
        path = self._dir(step) / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic: a reader sees the old file or the whole new one
        _fsync_dir(path.parent)

    def write_marker(self, step: int, data: bytes) -> None:
        path = self._dir(step) / MARKER
        tmp = path.with_name(f".{MARKER}.tmp-{os.getpid()}")
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # exclusive: fails when a marker exists
        finally:
            tmp.unlink()
        _fsync_dir(path.parent)

    def read_root(self, name: str) -> bytes | None:
        path = self.root / name
        return path.read_bytes() if path.is_file() else None

    def swap_root(self, name: str, update: Callable[[bytes | None], bytes]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        with _locked(self.root / f".{name}.lock"):
            new = update(self.read_root(name))
            tmp = self.root / f".{name}.tmp-{os.getpid()}"
            tmp.write_bytes(new)
            os.replace(tmp, self.root / name)
            _fsync_dir(self.root)

    def upload(self, step: int, rel: str, local: Path) -> None:
        dest = self._dir(step) / rel
        if dest.resolve() != local.resolve():
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(local, dest)

    def download(self, step: int, rel: str, local: Path) -> None:
        shutil.copyfile(self._dir(step) / rel, local)

    def delete_step(self, step: int) -> None:
        base = self._dir(step)
        (base / MARKER).unlink(missing_ok=True)
        shutil.rmtree(base, ignore_errors=True)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive advisory lock (flock) held for the block."""
    import fcntl

    with path.open("a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class S3Storage(CheckpointStorage):
    """``s3://bucket/prefix`` through boto3.

    Credentials come from the standard chain (env vars from a Secret, web identity, instance
    profile) and are never logged; ``AWS_ENDPOINT_URL`` selects a non-AWS endpoint. Large files
    go up in parallel multipart uploads (an aborted upload leaves no object); throttling and
    transient errors are retried with exponential backoff by botocore.
    """

    def __init__(
        self,
        url: str,
        *,
        client: Any | None = None,
        multipart_threshold: int = 64 << 20,
        multipart_chunksize: int = 64 << 20,
        max_concurrency: int = 8,
        max_attempts: int = 8,
    ) -> None:
        from boto3.s3.transfer import TransferConfig

        if not is_s3(url):
            raise ValueError(f"not an S3 URL: {url!r}")
        bucket, prefix = split_s3(url)
        self.url = url.rstrip("/")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.client = client or s3_client(
            max_attempts=max_attempts, retry_mode="adaptive", read_timeout=120
        )
        self.transfer = TransferConfig(
            multipart_threshold=multipart_threshold,
            multipart_chunksize=multipart_chunksize,
            max_concurrency=max_concurrency,
        )
        # First, so it sees every attempt (the retry handler answers failed ones, and the
        # first answer ends the event).
        self.client.meta.events.register_first("needs-retry.s3", self._on_attempt)

    def _on_attempt(self, caught_exception: Exception | None = None,
                    response: Any = None, **_: Any) -> None:  # fmt: skip
        """Note a failed request (a connection error, a 5xx or a throttle) before its retry."""
        status = response[0].status_code if response else 0
        if caught_exception is not None or status >= 500 or status == 429:
            self.failing_since = time.monotonic()

    def _key(self, step: int, rel: str = "") -> str:
        parts = [p for p in (self.prefix, step_name(step), rel) if p]
        return "/".join(parts)

    def _list(self, **kwargs: Any) -> list[dict[str, Any]]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, **kwargs)
        return list(pages)

    def list_steps(self) -> list[int]:
        root = f"{self.prefix}/" if self.prefix else ""
        steps = []
        for page in self._list(Prefix=root, Delimiter="/"):
            for common in page.get("CommonPrefixes", []):
                name = common["Prefix"][len(root) :].rstrip("/")
                if m := _STEP_RE.match(name):
                    steps.append(int(m.group(1)))
        return sorted(steps)

    def list_files(self, step: int) -> dict[str, int]:
        base = self._key(step) + "/"
        files = {}
        for page in self._list(Prefix=base):
            for obj in page.get("Contents", []):
                rel = obj["Key"][len(base) :]
                if rel != MARKER:
                    files[rel] = obj["Size"]
        return files

    def read_bytes(self, step: int, rel: str) -> bytes | None:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(step, rel))[
                "Body"
            ].read()
        except self.client.exceptions.NoSuchKey:
            return None

    def open_file(self, step: int, rel: str) -> BinaryIO:
        """The object's body, streamed (never held whole in memory)."""
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self._key(step, rel))["Body"]
        except self.client.exceptions.NoSuchKey as exc:
            raise FileNotFoundError(f"{self.url}/{step_name(step)}/{rel}") from exc
        return body

    def write_bytes(self, step: int, rel: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(step, rel), Body=data)

    def write_marker(self, step: int, data: bytes) -> None:
        """Conditional write (If-None-Match: *): an existing marker is never replaced."""
        self.client.put_object(
            Bucket=self.bucket, Key=self._key(step, MARKER), Body=data, IfNoneMatch="*"
        )

    def _root_key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def read_root(self, name: str) -> bytes | None:
        try:
            obj = self.client.get_object(Bucket=self.bucket, Key=self._root_key(name))
        except self.client.exceptions.NoSuchKey:
            return None
        return obj["Body"].read()

    def swap_root(self, name: str, update: Callable[[bytes | None], bytes]) -> None:
        """Compare-and-swap with S3 conditional writes (If-Match on the ETag read, or
        If-None-Match when there was none); a lost race re-reads and runs ``update`` again."""
        from botocore.exceptions import ClientError

        key = self._root_key(name)
        for _ in range(20):
            try:
                obj = self.client.get_object(Bucket=self.bucket, Key=key)
                current, cond = obj["Body"].read(), {"IfMatch": obj["ETag"]}
            except self.client.exceptions.NoSuchKey:
                current, cond = None, {"IfNoneMatch": "*"}
            try:
                self.client.put_object(Bucket=self.bucket, Key=key, Body=update(current), **cond)
                return
            except ClientError as err:
                if err.response.get("Error", {}).get("Code") not in (
                    "PreconditionFailed",
                    "ConditionalRequestConflict",
                ):
                    raise
        raise OSError(f"{self.url}/{name}: too many concurrent writers")

    def upload(self, step: int, rel: str, local: Path) -> None:
        self.client.upload_file(str(local), self.bucket, self._key(step, rel), Config=self.transfer)

    def download(self, step: int, rel: str, local: Path) -> None:
        self.client.download_file(
            self.bucket, self._key(step, rel), str(local), Config=self.transfer
        )

    def delete_step(self, step: int) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(step, MARKER))
        keys = [
            obj["Key"]
            for page in self._list(Prefix=self._key(step) + "/")
            for obj in page.get("Contents", [])
        ]
        for i in range(0, len(keys), 1000):
            batch = [{"Key": k} for k in keys[i : i + 1000]]
            self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch})


def open_storage(path: str) -> CheckpointStorage:
    """The storage for a manifest's ``checkpoint.path``."""
    return S3Storage(path) if path.startswith("s3://") else FilesystemStorage(path)
