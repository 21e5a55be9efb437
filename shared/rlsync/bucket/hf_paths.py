"""Where a Hub bucket view's objects live: keys onto remote paths under its prefix, listings back onto
keys, and creating the bucket when the Hub has none."""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

from huggingface_hub import BucketFile, HfApi
from huggingface_hub.errors import BucketNotFoundError

from ..errors import BucketError, TransientBucketError
from .base import ObjectInfo, validate_key

__all__ = ["HfPaths", "create_if_missing"]

logger = logging.getLogger(__name__)


class HfPaths:
    """Keys of one bucket view (a folder ``prefix`` inside the bucket, or its root) as remote paths.

    Args:
        prefix: The folder (already checked as a key), ``""`` for the root.
    """

    def __init__(self, prefix: str) -> None:
        self.path_prefix = f"{prefix}/" if prefix else ""
        self._warned_skipped = False

    def remote(self, key: str) -> str:
        """The remote path of ``key``.

        Raises:
            InvalidKeyError: ``key`` is not a valid key.
        """
        return self.path_prefix + validate_key(key)

    def remote_prefix(self, prefix: str) -> str:
        """The remote path prefix of a (checked) key prefix."""
        return self.path_prefix + prefix

    def local_key(self, remote_path: str) -> str | None:
        """The key of a remote path (``None``: outside this view)."""
        if not remote_path.startswith(self.path_prefix):
            return None
        return remote_path[len(self.path_prefix) :]

    def objects(self, files: Iterable[BucketFile], full: str, url: str) -> list[ObjectInfo]:
        """Listed files under the remote prefix ``full`` as objects, sorted by key; files whose names are
        not valid keys (written by other tools) are skipped, with a warning the first time."""
        out = []
        skipped = 0
        for item in files:
            if not item.path.startswith(full):  # the server matches the prefix lexically: filter again
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
            log("list %s: skipped %d remote files whose names are not valid keys", url, skipped)
        return sorted(out, key=lambda o: o.key)


def create_if_missing(api: HfApi, bucket_id: str, token: str | None, call: Callable[[str, str | None, Callable[[], Any]], Any]) -> None:
    """Create the bucket when the Hub has none of this id (a read-only token never tries to write).

    Args:
        api: The client.
        bucket_id: ``"namespace/name"``.
        token: The token to send (``None``: the client's).
        call: Runs one client call with the bucket's error mapping (``HfBucket._call``).

    Raises:
        BucketError: the bucket does not exist and this token cannot create it (saying how to).
        TransientBucketError: the Hub failed transiently.
    """

    def exists() -> bool:
        try:
            api.bucket_info(bucket_id, token=token)
            return True
        except BucketNotFoundError:
            return False

    if call("bucket info", None, exists):
        return
    try:
        call("create bucket", None, lambda: api.create_bucket(bucket_id, exist_ok=True, token=token))
    except TransientBucketError:
        raise
    except BucketError as err:
        raise BucketError(
            f"bucket {bucket_id!r} does not exist and this token cannot create it ({err}). Create it "
            f"with a token that can write to {bucket_id.split('/')[0]!r}: `hf buckets create {bucket_id}`, "
            "or `python -m rlsync.spaces.deploy`, or on the Hub's website; then start again"
        ) from None
    logger.info("created bucket %s", bucket_id)
