"""Exceptions raised by the sync library."""

from __future__ import annotations


class SyncError(Exception):
    """Base class for errors of the sync library."""


class FormatError(SyncError, ValueError):
    """A file is not a valid anchor or delta: bad header, metadata, names, shapes or indices."""


class HashMismatchError(SyncError):
    """A state's hash differs from the hash a file or the pointer promised."""


class ChainError(SyncError):
    """A delta does not follow the state it would be applied to (gap, replay, out of order)."""
