"""Reading a Hub bucket for :class:`~rlsync.bucket.hf.HfBucket` (:class:`HubReader`): objects, bounded
before any byte is downloaded, and listings, bounded in pages.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from huggingface_hub import BucketFile

from ..errors import BucketError, ObjectNotFoundError, ObjectTooLargeError
from .base import ObjectInfo, part_path, validate_key, validate_prefix
from .hf_errors import HubCalls

__all__ = ["HubReader"]

logger = logging.getLogger(__name__)


class HubReader:
    """Downloads and lists the objects of one bucket (under its prefix).

    Args:
        calls: Makes the Hub calls and maps their errors.
        path_prefix: The bucket's folder with its trailing ``/`` (``""``: none).
    """

    def __init__(self, calls: HubCalls, path_prefix: str) -> None:
        self.calls = calls
        self.path_prefix = path_prefix
        self._warned_skipped = False
        #: Reads refused because the object is larger than the reader allows.
        self.refused_too_large = 0

    def remote(self, key: str) -> str:
        """The Hub path of ``key``.

        Raises:
            InvalidKeyError: ``key`` is not a valid key.
        """
        return self.path_prefix + validate_key(key)

    def local_key(self, remote_path: str) -> str | None:
        """The key of a Hub path (``None``: outside this bucket's prefix)."""
        if not remote_path.startswith(self.path_prefix):
            return None
        return remote_path[len(self.path_prefix) :]

    def _fetch(self, source: str | BucketFile, dest: Path) -> None:
        self.calls.api.download_bucket_files(
            self.calls.bucket_id, [(source, str(dest))], raise_on_missing_files=True, token=self.calls.token
        )

    def _download(self, key: str, source: str | BucketFile, dest: Path) -> None:
        self.calls.transfer("get", key, lambda: self._fetch(source, dest))
        if not dest.is_file():  # the client skipped it: treat as missing rather than return garbage
            raise ObjectNotFoundError(f"get {key!r} in {self.calls.url} failed: no such object")

    def _limited_source(self, key: str, max_bytes: int | None) -> str | BucketFile:
        """What to download for `key`: its path, or, under a limit, the version `paths-info` lists (the
        request the download would make anyway), refused from its listed size before any byte is read.

        Raises:
            [`ObjectTooLargeError`]: the listed size is over `max_bytes` (counted in :attr:`refused_too_large`).
            [`ObjectNotFoundError`]: no object has that key.
        """
        remote = self.remote(key)
        if max_bytes is None:
            return remote
        api, bucket_id, token = self.calls.api, self.calls.bucket_id, self.calls.token
        infos = self.calls.call("get", key, lambda: list(api.get_bucket_paths_info(bucket_id, [remote], token=token)))
        info = next((i for i in infos if isinstance(i, BucketFile) and i.path == remote), None)
        if info is None:
            raise ObjectNotFoundError(f"get {key!r} in {self.calls.url} failed: no such object")
        self._check_size(key, int(info.size), max_bytes)
        return info

    def _check_size(self, key: str, size: int, max_bytes: int | None) -> None:
        if max_bytes is not None and size > max_bytes:
            self.refused_too_large += 1
            raise ObjectTooLargeError(f"{key}: {size:,} bytes, more than the {max_bytes:,} allowed")

    def read(self, key: str, max_bytes: int | None) -> bytes:
        """The bytes of ``key`` (via a temporary file), refused over ``max_bytes`` (``None``: no limit).

        Raises:
            ObjectTooLargeError, ObjectNotFoundError, InvalidKeyError, TransientBucketError, BucketError
        """
        source = self._limited_source(key, max_bytes)
        logger.debug("get %s from %s", key, self.calls.url)
        with tempfile.TemporaryDirectory(prefix="hfbucket-") as tmp:
            dest = Path(tmp, "object")
            self._download(key, source, dest)
            self._check_size(key, dest.stat().st_size, max_bytes)  # what came is what was listed, or refused
            return dest.read_bytes()

    def read_file(self, key: str, path: str | Path, max_bytes: int | None) -> None:
        """Download ``key`` into ``path`` through a ``.part`` file of this call's own, renamed at the end.

        Raises:
            ObjectTooLargeError, ObjectNotFoundError, InvalidKeyError, TransientBucketError, BucketError
        """
        source = self._limited_source(key, max_bytes)
        target = Path(path)
        tmp = part_path(target)
        logger.debug("get_file %s from %s -> %s", key, self.calls.url, path)
        try:
            self._download(key, source, tmp)
            self._check_size(key, tmp.stat().st_size, max_bytes)
            tmp.replace(target)
        finally:
            tmp.unlink(missing_ok=True)

    def list(self, prefix: str, max_keys: int | None) -> tuple[list[ObjectInfo], bool]:
        """The objects under ``prefix`` (sorted, at most ``max_keys`` when given) and whether that is all.

        Raises:
            InvalidKeyError, TransientBucketError, BucketError
        """
        validate_prefix(prefix)
        full = self.path_prefix + prefix
        api, bucket_id, token = self.calls.api, self.calls.bucket_id, self.calls.token

        def fetch() -> tuple[list[BucketFile], bool]:
            # The server matches the prefix lexically; filter again below to be safe.
            tree = api.list_bucket_tree(bucket_id, prefix=full or None, recursive=True, token=token)
            files = []
            for item in tree:  # pages are fetched as the iteration reaches them
                if isinstance(item, BucketFile):
                    if max_keys is not None and len(files) == max_keys:
                        return files, False
                    files.append(item)
            return files, True

        try:
            files, complete = self.calls.call("list", prefix, fetch)
        except ObjectNotFoundError:  # the Hub's EntryNotFound 404 for a folder that does not exist: nothing there
            return [], True
        out = []
        skipped = 0
        for item in files:
            if not item.path.startswith(full):
                continue
            key = self.local_key(item.path)
            try:
                validate_key(key or "")
            except BucketError:
                skipped += 1
                continue
            out.append(ObjectInfo(key, int(item.size), item.xet_hash or None))
        if skipped:
            log = logger.debug if self._warned_skipped else logger.warning
            self._warned_skipped = True
            log("list %s: skipped %d remote files whose names are not valid keys", self.calls.url, skipped)
        return sorted(out, key=lambda o: o.key), complete

    def existing(self, op: str, keys: list[str]) -> set[str]:
        """The Hub paths of those of ``keys`` that exist (one ``paths-info`` call)."""
        remotes = [self.remote(key) for key in keys]
        api, bucket_id, token = self.calls.api, self.calls.bucket_id, self.calls.token
        infos = self.calls.call(
            op,
            keys[0] if len(keys) == 1 else f"{len(keys)} keys",
            lambda: list(api.get_bucket_paths_info(bucket_id, remotes, token=token)),
        )
        return {info.path for info in infos}
