"""The fault wrapper: :class:`HookBucket`, a local bucket that kills its process (SIGKILL) at a
chosen point of a publish or a sync."""

from __future__ import annotations

import collections
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Iterable

from rlsync.bucket import LocalBucket
from rlsync.layout import POINTER_KEY


def die() -> None:
    """SIGKILL this process (what ``kill -9`` does)."""
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # pragma: no cover


def _key_kind(key: str) -> str:
    if key == POINTER_KEY:
        return "pointer"
    if key == "lock.json":
        return "lock"
    return key.split("/", 1)[0] if "/" in key else "other"


class HookBucket(LocalBucket):
    """A local bucket that kills its own process at a chosen point.

    ``kill=(event, n)`` fires at the n-th occurrence of ``event``:

    * ``lock``: before writing the run lock;
    * ``mid-delta``: halfway through writing a delta (a partial temporary file is left);
    * ``before-pointer``: after the data of a publish, before the pointer;
    * ``mid-shard``: halfway through writing an anchor shard;
    * ``after-shard``: after an anchor shard, before the next shard or the pointer;
    * ``after-pointer``: after the pointer, before retention deletes anything;
    * ``mid-delete``: after deleting half of what retention drops;
    * ``mid-download``: halfway through downloading an anchor shard, or before a delta arrives (subscriber).
    """

    def __init__(self, root: str | Path, kill: tuple[str, int] | None = None) -> None:
        super().__init__(root)
        self.kill_event, self.kill_nth = kill if kill else (None, 0)
        self.counts: collections.Counter = collections.Counter()

    def hit(self, event: str) -> None:
        """Count an occurrence of ``event``; die if it is the chosen one."""
        self.counts[event] += 1
        if event == self.kill_event and self.counts[event] == self.kill_nth:
            die()

    def _due(self, event: str) -> bool:
        """Whether the next occurrence of ``event`` is the one to die at."""
        return event == self.kill_event and self.counts[event] + 1 == self.kill_nth

    def _partial_write(self, key: str, data: bytes) -> None:
        """What a writer killed mid-upload leaves: a partial temporary file next to the target."""
        path = self.root.joinpath(*key.split("/"))
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, _ = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
        os.write(fd, data[: len(data) // 2])

    def put(self, key: str, data: bytes) -> None:
        kind = _key_kind(key)
        if kind == "deltas":
            if self._due("mid-delta"):
                self._partial_write(key, data)
            self.hit("mid-delta")
        elif kind == "lock":
            self.hit("lock")
        elif kind == "pointer":
            self.hit("before-pointer")
        super().put(key, data)
        if kind == "pointer":
            self.hit("after-pointer")

    def put_file(self, key: str, path: str | Path) -> None:
        if self._due("mid-shard"):
            self._partial_write(key, Path(path).read_bytes())
        self.hit("mid-shard")
        super().put_file(key, path)
        self.hit("after-shard")

    def delete(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        if self._due("mid-delete"):
            super().delete(keys[: len(keys) // 2])
        self.hit("mid-delete")
        super().delete(keys)

    def get_limited(self, key: str, max_bytes: int) -> bytes:
        if _key_kind(key) == "deltas":
            self.hit("mid-download")
        return super().get_limited(key, max_bytes)

    def get_file_limited(self, key: str, path: str | Path, max_bytes: int) -> None:
        if self._due("mid-download"):
            data = super().get(key)
            Path(f"{path}.part").write_bytes(data[: len(data) // 2])
        self.hit("mid-download")
        super().get_file_limited(key, path, max_bytes)
