"""Issue 41 item 5: a fleet on the Hub at PRO limits stalled on "delta 7 is missing" right after the pointer
named it. The replicas' reads were held back (pacing, retries) while the trainer published on; its next anchors
made retention delete the delta between a replica's pointer read and its download, and the replica counted a
refusal and lagged. A reader whose update retention dropped meanwhile reads the pointer again and continues
from it; an object the pointer still names and that is missing stays a refusal.
"""

from __future__ import annotations

import pytest
import torch

from rlsync.bucket import BucketWrapper, LocalBucket
from rlsync.errors import ChainError
from rlsync.protocol import FixedInterval, Publisher, Subscriber


class HeldReads(BucketWrapper):
    """A reader's bucket whose first read under `prefix` waits for `meanwhile` (the trainer publishing on)."""

    def __init__(self, inner, prefix: str, meanwhile) -> None:
        super().__init__(inner)
        self.prefix, self.meanwhile = prefix, meanwhile

    def _held(self, key: str) -> None:
        if key.startswith(self.prefix) and self.meanwhile is not None:
            meanwhile, self.meanwhile = self.meanwhile, None
            meanwhile()

    def get_limited(self, key: str, max_bytes: int) -> bytes:
        self._held(key)
        return self.inner.get_limited(key, max_bytes)

    def get_file_limited(self, key: str, path, max_bytes: int) -> None:
        self._held(key)
        self.inner.get_file_limited(key, path, max_bytes)


def _trainer(tmp_path):
    publisher = Publisher(LocalBucket(tmp_path), policy=FixedInterval(3), keep_anchors=1)
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g)}

    def publish(steps: range) -> None:
        for step in steps:
            for t in state.values():
                t += torch.randn(t.shape, generator=g) * 0.05
            publisher.publish(step, state)

    return publisher, publish


@pytest.mark.parametrize("prefix", ["deltas/", "anchors/"])
def test_an_update_retention_drops_while_it_is_read_is_no_refusal(tmp_path, prefix):
    publisher, publish = _trainer(tmp_path)
    publish(range(0, 2))  # anchor 0, delta 1
    sub = Subscriber(LocalBucket(tmp_path))
    sub.sync(max_updates=1)  # at step 0: delta 1 next
    sub.bucket = HeldReads(sub.bucket, prefix, lambda: publish(range(2, 8)))  # anchors 3 and 6: delta 1 is deleted
    if prefix == "anchors/":
        sub.bucket.meanwhile = None
        publish(range(2, 4))  # anchor 3 is what the subscriber reads next; it is dropped by anchor 6
        sub.bucket.meanwhile = lambda: publish(range(4, 8))
    sub.sync()
    assert sub.stats.refused == 0 and not sub.needs_resync
    assert (sub.step, sub.state_hash) == (publisher.step, publisher.manifest.state_hash)


def test_a_missing_delta_the_pointer_still_names_is_refused(tmp_path):
    publisher, publish = _trainer(tmp_path)
    publish(range(0, 2))
    sub = Subscriber(LocalBucket(tmp_path))
    sub.sync(max_updates=1)
    (tmp_path / publisher.manifest.deltas[-1].file.key).unlink()
    with pytest.raises(ChainError, match="delta 1 is missing"):
        sub.sync()
    assert sub.stats.refused == 1 and sub.step == 0
