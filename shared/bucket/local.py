"""A local folder used as a bucket: the embedded default, and what a Space sees
when a bucket is mounted as a volume.

Writes go to a temporary file in the same folder, are flushed to disk, then
renamed over the final name, so readers never see a partial object.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable

from .base import Bucket, InvalidKeyError, ObjectInfo, ObjectNotFoundError, validate_key, validate_prefix

_TMP_MARK = ".tmp-"


class LocalBucket(Bucket):
    """A bucket stored in a local directory.

    Args:
        root: The directory holding the objects; created if missing.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser().resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.url = self.root.as_uri()

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*validate_key(key).split("/"))

    def _write_atomic(self, key: str, write) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=_TMP_MARK, dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def put(self, key: str, data: bytes) -> None:
        self._write_atomic(key, lambda f: f.write(data))

    def put_file(self, key: str, path: str | Path) -> None:
        with open(path, "rb") as src:
            self._write_atomic(key, lambda f: shutil.copyfileobj(src, f, 1 << 20))  # 1 MiB: memory stays flat

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFoundError(f"{key}: no such object in {self.url}") from None

    def get_file(self, key: str, path: str | Path) -> None:
        src = self._path(key)
        tmp = Path(f"{path}.part")
        try:
            shutil.copyfile(src, tmp)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            tmp.unlink(missing_ok=True)
            raise ObjectNotFoundError(f"{key}: no such object in {self.url}") from None
        tmp.replace(path)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        validate_prefix(prefix)
        out = []
        for dirpath, _dirs, files in os.walk(self.root):
            for name in files:
                if name.startswith(_TMP_MARK):
                    continue
                full = Path(dirpath, name)
                key = full.relative_to(self.root).as_posix()
                try:
                    validate_key(key)
                except InvalidKeyError:  # put there by another tool; no get() could read it (as HfBucket.list)
                    continue
                if key.startswith(prefix):
                    try:
                        out.append(ObjectInfo(key, full.stat().st_size))
                    except FileNotFoundError:  # deleted while listing
                        continue
        return sorted(out, key=lambda o: o.key)

    def delete(self, keys: Iterable[str]) -> None:
        for key in keys:
            path = self._path(key)
            path.unlink(missing_ok=True)
            parent = path.parent
            while parent != self.root:
                try:
                    parent.rmdir()
                except OSError:
                    break
                parent = parent.parent

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()
