"""Careful local file access for untrusted folders: regular files only, bounded
reads, no blocking on FIFOs, optional refusal of symlinks, atomic writes whose
modes respect the umask, and ageing out of files left by killed writers.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import shutil
import stat
import time
from pathlib import Path
from typing import BinaryIO, Callable

from .errors import FileTooLargeError, NotRegularFileError

logger = logging.getLogger(__name__)

TMP_MARK = ".tmp-"
TMP_TOKEN_CHARS = "0-9a-f"  # create_new's names: TMP_MARK, then 12 of these (secrets.token_hex(6))
_CHUNK = 1 << 20  # 1 MiB per read: copying a large anchor keeps memory flat


def open_regular(
    name: str | Path, *, dir_fd: int | None = None, follow_symlinks: bool = True, max_bytes: int | None = None
) -> tuple[int, int]:
    """Open a regular file for reading without blocking on FIFOs.

    Args:
        name: Path, relative to ``dir_fd`` when given.
        dir_fd: Directory descriptor ``name`` is relative to.
        follow_symlinks: ``False`` refuses a symlink as the last component.
        max_bytes: Refuse a file larger than this (checked before reading).

    Returns:
        ``(fd, size)``; the caller closes ``fd``.

    Raises:
        FileNotFoundError: no such file.
        NotRegularFileError: not a regular file (or a refused symlink).
        FileTooLargeError: larger than ``max_bytes``.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):  # a symlink under O_NOFOLLOW; a socket
            raise NotRegularFileError(f"{name}: not a regular file") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFileError(f"{name}: not a regular file")
        if max_bytes is not None and st.st_size > max_bytes:
            raise FileTooLargeError(f"{st.st_size:,} bytes, more than the {max_bytes:,} allowed")
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def read_regular(
    name: str | Path, *, dir_fd: int | None = None, follow_symlinks: bool = True, max_bytes: int | None = None
) -> bytes:
    """The bytes of a regular file, reading no more than its size at open (see :func:`open_regular`)."""
    fd, size = open_regular(name, dir_fd=dir_fd, follow_symlinks=follow_symlinks, max_bytes=max_bytes)
    with os.fdopen(fd, "rb") as f:
        return f.read(size)


def copy_regular(src_fd: int, size: int, dst: BinaryIO) -> None:
    """Copy at most ``size`` bytes from an open file to ``dst`` (a file growing meanwhile is cut at ``size``)."""
    left = size
    while left > 0:
        chunk = os.read(src_fd, min(_CHUNK, left))
        if not chunk:
            break
        dst.write(chunk)
        left -= len(chunk)


def create_new(directory: str | Path, prefix: str = TMP_MARK, *, dir_fd: int | None = None) -> tuple[int, str]:
    """Create a new, empty file with a random name, mode ``0o666`` less the umask.

    Returns:
        ``(fd, name)``: an open write descriptor and the name inside ``directory``
        (or inside ``dir_fd`` when given).
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    while True:
        name = f"{prefix}{secrets.token_hex(6)}"
        try:
            return os.open(name if dir_fd is not None else Path(directory, name), flags, 0o666, dir_fd=dir_fd), name
        except FileExistsError:
            continue


def write_atomic(path: str | Path, write: Callable[[BinaryIO], None]) -> None:
    """Write ``path`` through a temporary file in its folder, renamed at the end; nothing is
    left behind on failure. The mode respects the umask."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = create_new(path.parent, f".{path.name}{TMP_MARK}")
    tmp = path.parent / name
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def age_out(folder: str | Path, *, max_age_s: float, pattern: str, now: float | None = None) -> int:
    """Delete entries of ``folder`` matching ``pattern`` (glob) older than ``max_age_s``:
    temporary files and scratch folders left behind by killed writers.

    Symlinks are removed, never followed. Returns the number of entries removed.
    """
    now = time.time() if now is None else now
    removed = 0
    try:
        candidates = list(Path(folder).glob(pattern))
    except OSError:
        return 0
    for entry in candidates:
        try:
            st = entry.lstat()
            if now - st.st_mtime < max_age_s:
                continue
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(entry)
            else:
                entry.unlink()
            removed += 1
        except OSError as exc:
            logger.debug("could not age out %s: %s", entry, exc)
    if removed:
        logger.info("removed %d stale %s entries from %s", removed, pattern, folder)
    return removed
