"""A local folder used as a bucket: the embedded default, and what a Space sees
when a bucket is mounted as a volume.

Writes go to a temporary file in the same folder, are flushed to disk, then
renamed over the final name, so readers never see a partial object.

Anyone who can write the folder may plant things in it, so every access walks
the key's folders one by one with ``O_NOFOLLOW`` (a symlinked folder or object
is refused, never followed, on read, write and delete), reads only regular files
(a FIFO or device is refused without blocking) and no more than their size.
New files and folders get ``0o666``/``0o777`` less the umask.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import time
from pathlib import Path
from typing import Iterable, Iterator

from ..errors import (
    BucketError,
    FileTooLargeError,
    InvalidKeyError,
    NotRegularFileError,
    ObjectNotFoundError,
    ObjectTooLargeError,
)
from ..files import TMP_MARK, TMP_TOKEN_CHARS, copy_regular, create_new, open_regular
from ..registry import Kind, register
from ..retry import RetryPolicy, call_with_retries
from .base import Bucket, Capability, ObjectInfo, part_path, validate_key, validate_prefix

register(
    Kind.BUCKET, "file", "rlsync.bucket.local:open_local", capabilities=("size_limited_reads",),
    summary="a local folder (a path or file://PATH): the embedded default, or a Space's mounted volume",
)  # fmt: skip

#: A write whose folder a concurrent delete removed (once it was empty) is tried again at once, this often.
_WRITE_RETRIES = RetryPolicy.at_once(5)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class _MissingFolder(Exception):
    """A folder on the key's path does not exist (reads: no such object)."""


class LocalBucket(Bucket):
    """A bucket stored in a local directory.

    Args:
        root: The directory holding the objects.
        create: Create ``root`` if missing; ``False`` (read-only use) raises
            :class:`BucketError` instead.
    """

    capabilities = Capability.declared("file")

    def __init__(self, root: str | Path, *, create: bool = True) -> None:
        self.root = Path(root).expanduser().resolve()
        if create:
            self.root.mkdir(parents=True, exist_ok=True)
        elif not self.root.is_dir():
            raise BucketError(f"{self.root}: no such bucket folder")
        self.url = self.root.as_uri()

    # -- walking folders without following links -----------------------------

    @contextlib.contextmanager
    def _folder(self, key: str, *, create: bool) -> Iterator[tuple[int, str]]:
        """``(dir_fd, name)`` of ``key``'s folder and last segment; every folder opened with O_NOFOLLOW.

        Raises:
            _MissingFolder: a folder is missing and ``create`` is false.
            BucketError: a folder on the path is a symlink or not a folder.
        """
        *folders, name = validate_key(key).split("/")
        fd = os.open(self.root, _DIR_FLAGS)
        try:
            for segment in folders:
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(segment, 0o777, dir_fd=fd)
                try:
                    child = os.open(segment, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if create:  # removed between our mkdir and open by a concurrent delete
                        raise
                    raise _MissingFolder(key) from None
                except OSError:  # ELOOP: a symlink; ENOTDIR: a file
                    raise BucketError(f"{key}: {segment!r} in {self.url} is not a folder (symlinks are not followed)") from None
                os.close(fd)
                fd = child
            yield fd, name
        finally:
            os.close(fd)

    def _open_object(self, key: str, max_bytes: int | None) -> tuple[int, int]:
        try:
            with self._folder(key, create=False) as (dir_fd, name):
                return open_regular(name, dir_fd=dir_fd, follow_symlinks=False, max_bytes=max_bytes)
        except (_MissingFolder, FileNotFoundError):
            raise ObjectNotFoundError(f"{key}: no such object in {self.url}") from None
        except FileTooLargeError as exc:
            raise ObjectTooLargeError(f"{key}: {exc}") from None
        except NotRegularFileError:
            if self._is_folder(key):
                raise ObjectNotFoundError(f"{key}: no such object in {self.url}") from None
            raise BucketError(f"{key}: not a regular file in {self.url} (symlinks, FIFOs and devices are refused)") from None

    def _is_folder(self, key: str) -> bool:
        try:
            with self._folder(key, create=False) as (dir_fd, name):
                return stat.S_ISDIR(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
        except (_MissingFolder, OSError, BucketError):
            return False

    # -- the interface ---------------------------------------------------------

    def _write_atomic(self, key: str, write) -> None:
        def give_up(err: BaseException, attempts: int, _elapsed: float, _why: str) -> FileNotFoundError:
            assert isinstance(err, FileNotFoundError)
            return FileNotFoundError(err.errno, f"{err.strerror} (writing {key!r}, {attempts} attempts)", err.filename)

        call_with_retries(
            lambda: self._write_once(key, write), policy=_WRITE_RETRIES, retryable=FileNotFoundError, give_up=give_up,
            describe=f"put {key!r} in {self.url} (a concurrent delete removed its folder)",
        )  # fmt: skip

    def _write_once(self, key: str, write) -> None:
        with self._folder(key, create=True) as (dir_fd, name):
            fd, tmp = create_new("", TMP_MARK, dir_fd=dir_fd)
            try:
                with os.fdopen(fd, "wb") as f:
                    write(f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dir_fd)
                raise

    def put(self, key: str, data: bytes) -> None:
        self._write_atomic(key, lambda f: f.write(data))

    def put_file(self, key: str, path: str | Path) -> None:
        fd, size = open_regular(path)
        try:
            self._write_atomic(key, lambda f: (os.lseek(fd, 0, os.SEEK_SET), copy_regular(fd, size, f)))  # a retry starts over
        finally:
            os.close(fd)

    def get(self, key: str) -> bytes:
        return self._read(key, None)

    def get_limited(self, key: str, max_bytes: int) -> bytes:
        return self._read(key, max_bytes)

    def _read(self, key: str, max_bytes: int | None) -> bytes:
        fd, size = self._open_object(key, max_bytes)
        with os.fdopen(fd, "rb") as f:
            return f.read(size)

    def get_file(self, key: str, path: str | Path) -> None:
        self._copy_out(key, path, None)

    def get_file_limited(self, key: str, path: str | Path, max_bytes: int) -> None:
        self._copy_out(key, path, max_bytes)

    def _copy_out(self, key: str, path: str | Path, max_bytes: int | None) -> None:
        fd, size = self._open_object(key, max_bytes)
        tmp = part_path(path)
        try:
            with open(tmp, "wb") as dst:
                copy_regular(fd, size, dst)
            tmp.replace(path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        validate_prefix(prefix)
        out = []
        for dirpath, _dirs, files in os.walk(self.root):  # never descends into symlinked folders
            for name in files:
                if name.startswith(TMP_MARK):
                    continue
                full = Path(dirpath, name)
                key = full.relative_to(self.root).as_posix()
                if not key.startswith(prefix):
                    continue
                try:
                    validate_key(key)
                    st = full.lstat()
                except InvalidKeyError:  # put there by another tool; no get() could read it (as HfBucket.list)
                    continue
                except FileNotFoundError:  # deleted while listing
                    continue
                if stat.S_ISREG(st.st_mode):  # symlinks, FIFOs and devices are no objects
                    out.append(ObjectInfo(key, st.st_size))
        return sorted(out, key=lambda o: o.key)

    def delete(self, keys: Iterable[str]) -> None:
        for key in keys:
            parts = validate_key(key).split("/")
            try:
                with self._folder(key, create=False) as (dir_fd, name):
                    with contextlib.suppress(FileNotFoundError, IsADirectoryError, PermissionError):
                        os.unlink(name, dir_fd=dir_fd)  # removes a planted symlink itself, never its target
            except (_MissingFolder, BucketError):  # behind a symlinked folder: not an object of this bucket
                continue
            for depth in range(len(parts) - 1, 0, -1):  # remove folders left empty
                try:
                    with self._folder("/".join(parts[:depth]), create=False) as (dir_fd, name):
                        os.rmdir(name, dir_fd=dir_fd)
                except (_MissingFolder, OSError, BucketError):
                    break

    def exists(self, key: str) -> bool:
        validate_key(key)
        try:
            with self._folder(key, create=False) as (dir_fd, name):
                return stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
        except (_MissingFolder, FileNotFoundError, BucketError):
            return False

    def sweep_temporary(self, max_age_s: float, prefixes: Iterable[str]) -> int:
        """Delete the temporary files this class writes through (``.tmp-`` and 12 hex digits,
        regular files only) older than ``max_age_s``, in the folders ``prefixes`` cover (see
        :meth:`Bucket.sweep_temporary`); nothing else, and no symlink is followed.

        Returns:
            The number of files removed.
        """
        removed = 0
        now = time.time()
        for prefix in prefixes:
            folder = prefix.rstrip("/") if prefix.endswith("/") else prefix.rpartition("/")[0]
            top = self.root.joinpath(*folder.split("/")) if folder else self.root
            if not top.is_dir() or top.is_symlink():
                continue
            walk = os.walk(top) if prefix.endswith("/") else [(str(top), [], os.listdir(top))]
            for dirpath, _dirs, names in walk:
                for name in names:
                    if _TMP_NAME.fullmatch(name):
                        removed += _unlink_if_old(Path(dirpath, name), now - max_age_s)
        return removed


_TMP_NAME = re.compile(re.escape(TMP_MARK) + f"[{TMP_TOKEN_CHARS}]{{12}}")


def _unlink_if_old(path: Path, cutoff: float) -> int:
    """Remove ``path`` if it is a regular file last written before ``cutoff``; 1 if removed."""
    try:
        st = path.lstat()
        if not stat.S_ISREG(st.st_mode) or st.st_mtime >= cutoff:
            return 0
        path.unlink()
        return 1
    except OSError:
        return 0


def open_local(url: str, *, create: bool = True, settings: None = None) -> LocalBucket:
    """The folder a path or ``file://`` URL names (a local folder has no settings).

    Raises:
        BucketError: a ``file://`` URL with a remote host.
    """
    from urllib.parse import unquote, urlparse

    if url.startswith("file://"):
        parsed = urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise BucketError(f"file URL with a remote host is not supported: {url}")
        return LocalBucket(unquote(parsed.path), create=create)
    return LocalBucket(url, create=create)
