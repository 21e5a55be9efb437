"""Reading a Hub bucket for :class:`~rlsync.bucket.hf.HfBucket` (:class:`HubReader`): objects, bounded
before any byte is downloaded, and listings, bounded in pages.

A read costs one resolver request (``HEAD /buckets/{id}/resolve/{path}``: the object's Xet hash, its size
and the Xet token route) and the Xet transfer; the size limit is checked on that answer's headers, so it
costs no request of its own. (``download_bucket_files`` would ask ``paths-info``, an API request, then
make that resolve request itself.)
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from hf_xet import XetFileInfo
from huggingface_hub import BucketFile, BucketFileMetadata
from huggingface_hub.utils import _xet, build_hf_headers

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

    def _resolve(self, key: str, max_bytes: int | None) -> BucketFileMetadata:
        """The version of `key` the Hub serves now (its Xet hash and size), from the one resolve request
        a download needs anyway (its Xet token route); refused from the size in that answer's headers,
        before any byte is read or any Xet token asked for.

        Raises:
            [`ObjectTooLargeError`]: the size is over `max_bytes` (counted in :attr:`refused_too_large`).
            [`ObjectNotFoundError`]: no object has that key.
        """
        remote = self.remote(key)
        api, bucket_id, token = self.calls.api, self.calls.bucket_id, self.calls.token
        metadata = self.calls.call("get", key, lambda: api.get_bucket_file_metadata(bucket_id, remote, token=token))
        if metadata.size < 0:
            raise BucketError(f"get {key!r} in {self.calls.url} failed: the Hub answered a negative size")
        self._check_size(key, metadata.size, max_bytes)
        return metadata

    def _fetch(self, metadata: BucketFileMetadata, dest: Path) -> None:
        """Download the version `metadata` names into `dest`: what ``download_bucket_files`` does once it
        has the file's metadata, without asking for it again (a second resolve request)."""
        if metadata.size == 0:
            dest.write_bytes(b"")
            return
        headers = build_hf_headers(token=self.calls.token)
        with _xet.get_xet_session().new_file_download_group(
            token_refresh_url=metadata.xet_file_data.refresh_route,
            token_refresh_headers=headers,
            custom_headers=_xet.xet_headers_without_auth(headers),
        ) as group:
            group.start_download_file(XetFileInfo(metadata.xet_file_data.file_hash, metadata.size), str(dest))

    def _download(self, key: str, metadata: BucketFileMetadata, dest: Path) -> None:
        self.calls.transfer("get", key, lambda: self._fetch(metadata, dest))
        if not dest.is_file():  # the client skipped it: treat as missing rather than return garbage
            raise ObjectNotFoundError(f"get {key!r} in {self.calls.url} failed: no such object")

    def _check_size(self, key: str, size: int, max_bytes: int | None) -> None:
        if max_bytes is not None and size > max_bytes:
            self.refused_too_large += 1
            raise ObjectTooLargeError(f"{key}: {size:,} bytes, more than the {max_bytes:,} allowed")

    def read(self, key: str, max_bytes: int | None) -> bytes:
        """The bytes of ``key`` (via a temporary file), refused over ``max_bytes`` (``None``: no limit).

        Raises:
            ObjectTooLargeError, ObjectNotFoundError, InvalidKeyError, TransientBucketError, BucketError
        """
        metadata = self._resolve(key, max_bytes)
        logger.debug("get %s from %s", key, self.calls.url)
        with tempfile.TemporaryDirectory(prefix="hfbucket-") as tmp:
            dest = Path(tmp, "object")
            self._download(key, metadata, dest)
            self._check_size(key, dest.stat().st_size, max_bytes)  # what came is what was listed, or refused
            return dest.read_bytes()

    def read_file(self, key: str, path: str | Path, max_bytes: int | None) -> None:
        """Download ``key`` into ``path`` through a ``.part`` file of this call's own, renamed at the end.

        Raises:
            ObjectTooLargeError, ObjectNotFoundError, InvalidKeyError, TransientBucketError, BucketError
        """
        metadata = self._resolve(key, max_bytes)
        target = Path(path)
        tmp = part_path(target)
        logger.debug("get_file %s from %s -> %s", key, self.calls.url, path)
        try:
            self._download(key, metadata, tmp)
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
