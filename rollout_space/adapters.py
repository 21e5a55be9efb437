"""A replica's side of a LoRA run: follow the adapter chain and serve its versions.

The replica's weights :class:`~rlsync.protocol.Subscriber` holds the base model (the weights
chain's one anchor); :class:`AdapterFollower` follows the adapter chain under ``adapters/``
with a second subscriber, bound to that base's hash, so a chain published for another base is
refused. Each verified version goes to the engine as an adapter of its own (a new id per version);
the engine reports the hash of what it will serve, and a version whose hash is not the verified
one is dropped and counted, never served. Versions more than ``window`` behind the newest are
dropped: the trainer discards samples that stale anyway.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from rlsync.adapters import AdapterChain, AdapterMetadata, adapter_subscriber
from rlsync.bucket import Bucket
from rlsync.errors import BucketError, FormatError, SyncError
from rlsync.protocol import Manifest, Update

from .engine import Engine
from .update_slot import UpdateSlot

logger = logging.getLogger(__name__)


class AdapterFollower:
    """Follows a bucket's adapter chain for one engine.

    Args:
        bucket: The run's bucket.
        engine: The engine serving the adapters.
        base_hash: Returns the state hash of the base the engine serves (``None`` until it has one).
        window: Adapter versions served at once (the newest and ``window - 1`` before it).
        poll_s: Seconds between pointer reads when up to date.
        max_state_bytes: The largest adapter accepted as the first version (e.g. the base model's size).
    """

    def __init__(
        self, bucket: Bucket, engine: Engine, base_hash: Callable[[], str | None], *, window: int = 3, poll_s: float = 0.5,
        max_state_bytes: int | None = None,
    ) -> None:  # fmt: skip
        if window < 1:
            raise ValueError(f"the adapter window must be at least 1, got {window}")
        self.engine = engine
        self.base_hash = base_hash
        self.window = window
        self.poll_s = poll_s
        self.subscriber = adapter_subscriber(bucket, "", max_state_bytes=max_state_bytes)
        self.served: dict[int, str] = {}  # version -> served hash
        self.refused = 0
        self.engine_hash: str | None = None
        self.slot = UpdateSlot()
        self._last_error = ""
        self._chain: tuple[str, AdapterChain] | None = None  # (run, chain) of the versions served

    @property
    def step(self) -> int | None:
        """The newest adapter version served (``None`` before the first)."""
        return max(self.served) if self.served else None

    def fetch_loop(self, stop: threading.Event) -> None:
        """Background thread: download and validate the next adapter version until ``stop`` is set."""
        while not stop.is_set():
            self.slot.wait_empty(stop)
            base = self.base_hash()
            if base is None:
                stop.wait(self.poll_s)
                continue
            self.subscriber.expect_metadata = {AdapterMetadata.BASE_HASH.value: base}
            try:
                update = self.subscriber.fetch()
            except (SyncError, BucketError) as exc:
                if str(exc) != self._last_error:  # once per cause, not at every poll
                    logger.warning("adapter update refused or unavailable: %s", exc)
                self._last_error = str(exc)
                update = None
            if update is None:
                stop.wait(self.poll_s)
                continue
            self._last_error = ""
            self.slot.put(update)

    def apply_pending(self) -> bool:
        """Verify and serve a downloaded version, dropping the ones out of the window; returns whether one was served."""
        return self.slot.apply(self._serve)

    def _serve(self, update: Update) -> bool:
        try:
            self.subscriber.apply(update)
        except SyncError as exc:  # counted by the subscriber
            logger.error("refused adapter %s %d: %s", update.kind, update.step, exc)
            return False
        try:
            assert self.subscriber.manifest is not None
            chain = self._chain_of(self.subscriber.manifest)
        except FormatError as exc:
            self.refused += 1
            logger.error("refused adapter %s %d: %s", update.kind, update.step, exc)
            return False
        version, expected = update.step, self.subscriber.state_hash
        try:
            served = self.engine.load_adapter(version, self.subscriber.state, chain)
        except (ValueError, RuntimeError) as exc:
            self.engine.drop_adapter(version)  # whatever the engine loaded before it failed
            self.refused += 1
            logger.error("the engine refused adapter %d: %s", version, exc)
            return False
        self.engine_hash = served
        if served != expected:
            self.engine.drop_adapter(version)
            self.refused += 1
            logger.error("adapter %d as the engine holds it hashes %s, not %s: dropped", version, served[:12], (expected or "")[:12])
            return False
        self.served[version] = served
        self._chain = (self.subscriber.manifest.run_id, chain)
        for old in [v for v in self.served if v <= version - self.window]:
            self.engine.drop_adapter(old)
            del self.served[old]
        logger.info("serving adapter %d (%s), %d version(s) loaded", version, update.kind, len(self.served))
        return True

    def _chain_of(self, manifest: Manifest) -> AdapterChain:
        """The chain the pointer describes, checked against the verified tensors and, within a run,
        against the settings of the versions already served (set at the chain's first publish).

        Raises:
            FormatError: invalid settings, settings the tensors disagree with, or settings changed within the run.
        """
        chain = AdapterChain.from_manifest(manifest)
        chain.check_tensors(self.subscriber.state)
        if self._chain is not None and self._chain[0] == manifest.run_id and self._chain[1] != chain:
            raise FormatError(f"the pointer's adapter settings changed within run {manifest.run_id!r}: {chain.lora} after {self._chain[1].lora}")
        return chain

    def wake(self) -> None:
        """Wake a fetch loop waiting for its pending update to be served (on stop)."""
        self.slot.wake()

    def status(self) -> dict:
        """The adapter part of the replica's status object."""
        return {
            "adapter_step": self.step,
            "adapter_hash": self.subscriber.state_hash,
            "engine_adapter_hash": self.engine_hash,
            "adapters_served": sorted(self.served),
            "adapter_refused": self.subscriber.stats.refused + self.refused,
            "adapter_bytes_downloaded": self.subscriber.stats.bytes_downloaded,
        }
