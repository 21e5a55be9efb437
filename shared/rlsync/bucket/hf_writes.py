"""Writing a Hub bucket for :class:`~rlsync.bucket.hf.HfBucket` (:class:`HubWriter`): creating the bucket when
missing, uploads (one ``batch_bucket_files`` call each) and deletes of the objects that exist."""

from __future__ import annotations

import logging
from typing import Iterable

from huggingface_hub.errors import BucketNotFoundError

from ..errors import BucketError, TransientBucketError
from .base import validate_key
from .hf_errors import HubCalls
from .hf_reads import HubReader

logger = logging.getLogger(__name__)


class HubWriter:
    """Creates, writes and deletes the objects of one bucket (under its prefix).

    Args:
        calls: Makes the Hub calls and maps their errors (its client, token and bucket id are used).
        reader: Names the Hub paths of keys and says which exist.
    """

    def __init__(self, calls: HubCalls, reader: HubReader) -> None:
        self.calls = calls
        self.reader = reader

    def create_if_missing(self) -> None:
        """Create the bucket when the Hub has none of this id (a read-only token never tries to write)."""
        api, bucket_id, token = self.calls.api, self.calls.bucket_id, self.calls.token

        def exists() -> bool:
            try:
                api.bucket_info(bucket_id, token=token)
                return True
            except BucketNotFoundError:
                return False

        if self.calls.call("bucket info", None, exists):
            return
        try:
            self.calls.call("create bucket", None, lambda: api.create_bucket(bucket_id, exist_ok=True, token=token))
        except TransientBucketError:
            raise
        except BucketError as err:
            raise BucketError(
                f"bucket {bucket_id!r} does not exist and this token cannot create it ({err}). Create it "
                f"with a token that can write to {bucket_id.split('/')[0]!r}: `hf buckets create {bucket_id}`, "
                "or `python -m rlsync.spaces.deploy`, or on the Hub's website; then start again"
            ) from None
        logger.info("created bucket %s", bucket_id)

    def upload(self, key: str, source: bytes | str) -> None:
        """Upload ``source`` (bytes, or a local file's path) under ``key``, in one ``/batch`` call."""
        remote = self.reader.remote(key)
        logger.debug("put %s to %s", remote, self.calls.bucket_id)
        batch = lambda: self.calls.api.batch_bucket_files(self.calls.bucket_id, add=[(source, remote)], token=self.calls.token)  # noqa: E731
        self.calls.transfer("put", key, batch)

    def delete(self, keys: Iterable[str]) -> None:
        """Delete the objects of ``keys`` that exist (per ``get_bucket_paths_info``; a missing key never makes the
        batch fail, nor does one a concurrent delete removed first)."""
        keys = [validate_key(key) for key in keys]
        if not keys:
            return
        existing = self.reader.existing("delete", keys)
        remotes = [self.reader.remote(key) for key in keys if self.reader.remote(key) in existing]
        if not remotes:
            return
        logger.debug("delete %d objects from %s", len(remotes), self.calls.url)
        what = keys[0] if len(keys) == 1 else f"{len(keys)} keys"
        try:
            self.calls.call(
                "delete",
                what,
                lambda: self.calls.api.batch_bucket_files(self.calls.bucket_id, delete=remotes, token=self.calls.token),
            )
        except BucketError as err:
            if isinstance(err, TransientBucketError):
                raise
            # A concurrent delete may have removed some paths first: fine if none is left.
            left = self.reader.existing("delete", [self.reader.local_key(r) or r for r in remotes])
            if left:
                raise
