"""``BucketRolloutWorker`` as the README constructs it (issue 26): a sample claiming a version newer than
any published skips TRL's staleness check for good, and over-long samples reach the model, unless the
library's defaults refuse them."""

from __future__ import annotations

from rlsync.layout import score_key
from rlsync.protocol import Publisher
from rlsync.spaces.exchange import Sample, read_samples, write_samples
from rlsync.trl import BucketRolloutWorker
from rlsync.trl.rollout_worker import DEFAULT_MAX_TOKENS
from tests.helpers import bf16, master_state


def _sample(task: str, version: int, tokens: int = 2) -> Sample:
    return Sample(task, "p", "c", [1, 5], [7] * tokens, [-0.5] * tokens, version, reward=1.0)


def test_future_versions_and_long_samples_are_refused_by_default(bucket):
    publisher = Publisher(bucket)
    publisher.publish(3, bf16(master_state()))
    long = DEFAULT_MAX_TOKENS  # with the 2 prompt tokens: over the default
    write_samples(bucket, score_key(0, "future"), [_sample("a", 10**12), _sample("a", 4)])
    write_samples(bucket, score_key(0, "long"), [_sample("b", 3, tokens=long)])
    write_samples(bucket, score_key(0, "good"), [_sample("c", 3), _sample("c", 2)])
    worker = BucketRolloutWorker(bucket, read_samples, vocab_size=32)  # as README.md constructs it
    worker.align_versions()
    assert worker.poll() == 2
    assert worker.counts["invalid"] == 3
    queued = [worker.rollout_buffer.get_nowait() for _ in range(2)]
    assert all(len(s.input_ids) == 4 for s in queued)
    publisher.publish(4, bf16(master_state()))  # once published, version 4 is fine
    write_samples(bucket, score_key(1, "next"), [_sample("d", 4), _sample("d", 4)])  # a group of 2 (one alone is degenerate)
    assert worker.poll() == 2
