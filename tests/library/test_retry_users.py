"""Every retrying caller uses the one policy of :mod:`rlsync.retry`: a local bucket's write that lost its folder
to a concurrent delete, a verify replay that lost its files to retention (``tests/library/test_local_bucket_hostile.py``)
and a refused prefix-cache reset of a vLLM server (``tests/library/vllm/test_vllm_sync_client.py``)."""

from __future__ import annotations

import errno
import math

import pytest

from rlsync.bucket import LocalBucket
from rlsync.retry import RetryPolicy, call_with_retries


def test_at_once_retries_without_waiting_or_a_time_bound():
    policy = RetryPolicy.at_once(3)
    assert policy.max_attempts == 3 and policy.max_total == math.inf
    assert [policy.backoff(n) for n in (1, 2, 10)] == [0.0, 0.0, 0.0]
    waits: list[float] = []
    calls = iter([KeyError("a"), KeyError("b"), "done"])

    def flaky() -> str:
        result = next(calls)
        if isinstance(result, Exception):
            raise result
        return result

    assert call_with_retries(flaky, policy=policy, retryable=KeyError, give_up=lambda e, *_: e, sleep=waits.append) == "done"
    assert waits == [0.0, 0.0]
    with pytest.raises(ValueError):
        RetryPolicy.at_once(0)


def test_a_local_write_whose_folder_a_delete_removed_is_tried_again_then_given_up(tmp_path, monkeypatch):
    bucket = LocalBucket(tmp_path / "bucket")
    real = bucket._write_once
    calls: list[str] = []

    def vanishing(key, write, fail_times):
        calls.append(key)
        if len(calls) <= fail_times:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", "tasks")
        return real(key, write)

    monkeypatch.setattr(bucket, "_write_once", lambda key, write: vanishing(key, write, 2))
    bucket.put("tasks/a.json", b"{}")
    assert len(calls) == 3 and bucket.get("tasks/a.json") == b"{}"

    calls.clear()
    monkeypatch.setattr(bucket, "_write_once", lambda key, write: vanishing(key, write, 10**6))
    with pytest.raises(FileNotFoundError, match="5 attempts"):
        bucket.put("tasks/b.json", b"{}")
    assert len(calls) == 5 and not bucket.exists("tasks/b.json")
