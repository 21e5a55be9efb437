"""RetryingBucket (backoff, retry_after, giving up, no retry on permanent errors) and FaultyBucket
(determinism, injected errors/throttling, truncated uploads, lagging listings, latency)."""

from __future__ import annotations

import logging
import time

import pytest

from rlsync.bucket import Bucket, LocalBucket, ObjectInfo, RetryingBucket
from rlsync.errors import BucketError, InvalidKeyError, ObjectNotFoundError, TransientBucketError
from testing.faulty import FaultyBucket


class Sleeps(list):
    """Records the waits a RetryingBucket asks for instead of sleeping."""

    def __call__(self, seconds: float) -> None:
        self.append(seconds)


class Scripted(Bucket):
    """A bucket whose operations raise the scripted errors first, then delegate; counts calls."""

    def __init__(self, inner: Bucket, errors: list[BaseException]) -> None:
        self.inner, self.errors, self.calls, self.url = inner, list(errors), 0, inner.url

    def _step(self):
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)

    def put(self, key, data):
        self._step()
        self.inner.put(key, data)

    def get(self, key):
        self._step()
        return self.inner.get(key)

    def list(self, prefix=""):
        self._step()
        return self.inner.list(prefix)

    def delete(self, keys):
        self._step()
        self.inner.delete(keys)


@pytest.fixture
def local(tmp_path) -> LocalBucket:
    return LocalBucket(tmp_path / "bucket")


# -- RetryingBucket ------------------------------------------------------------------------------


def test_retry_succeeds_through_injected_faults(local):
    faulty = FaultyBucket(local, seed=3, error_rate=0.3, throttle_rate=0.2, retry_after=0.01)
    sleeps = Sleeps()
    bucket = RetryingBucket(faulty, max_attempts=30, sleep=sleeps)
    for i in range(40):
        bucket.put(f"k/{i:03d}", bytes([i]) * (i + 1))
    assert [o.key for o in bucket.list("k/")] == [f"k/{i:03d}" for i in range(40)]
    assert all(bucket.get(f"k/{i:03d}") == bytes([i]) * (i + 1) for i in range(40))
    bucket.delete([f"k/{i:03d}" for i in range(40)])
    assert bucket.list() == []
    assert faulty.injected["error"] > 5 and faulty.injected["throttle"] > 5
    assert len(sleeps) == faulty.injected["error"] + faulty.injected["throttle"]  # one wait per retried fault


def test_retry_gives_up_with_clear_chained_error(local, caplog):
    sleeps = Sleeps()
    bucket = RetryingBucket(FaultyBucket(local, error_rate=1.0), max_attempts=4, sleep=sleeps)
    caplog.set_level(logging.WARNING, logger="rlsync.bucket.retry")
    with pytest.raises(BucketError) as info:
        bucket.get("anchors/000010")
    err = info.value
    assert not isinstance(err, TransientBucketError)  # callers further up must not retry again
    assert "get 'anchors/000010'" in str(err) and "after 4 attempts" in str(err) and local.url in str(err)
    assert "503" in str(err)  # the last error is named
    assert isinstance(err.__cause__, TransientBucketError)
    assert len(sleeps) == 3
    retries = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(retries) == 3 and "attempt 1/4" in retries[0].getMessage()


def test_retry_backoff_is_exponential_with_jitter_and_capped(local):
    sleeps = Sleeps()
    bucket = RetryingBucket(
        FaultyBucket(local, error_rate=1.0), max_attempts=8, base_delay=0.1, max_delay=1.0, sleep=sleeps
    )
    with pytest.raises(BucketError):
        bucket.list()
    assert len(sleeps) == 7
    for retry, slept in enumerate(sleeps, start=1):
        full = min(1.0, 0.1 * 2 ** (retry - 1))
        assert 0.5 * full <= slept <= full
    assert len(set(sleeps)) == len(sleeps)  # jittered, not a fixed schedule


def test_retry_honours_retry_after(local):
    sleeps = Sleeps()
    bucket = RetryingBucket(
        FaultyBucket(local, throttle_rate=1.0, retry_after=5.0),
        max_attempts=3,
        base_delay=0.01,
        max_delay=0.1,
        sleep=sleeps,
    )
    with pytest.raises(BucketError, match="after 3 attempts"):
        bucket.put("k", b"v")
    assert sleeps == [5.0, 5.0]  # the server's wait, even beyond max_delay


def test_retry_after_then_success(local):
    sleeps = Sleeps()
    inner = Scripted(local, [TransientBucketError("429 slow down", retry_after=2.5)])
    RetryingBucket(inner, base_delay=0.01, sleep=sleeps).put("k", b"v")
    assert sleeps == [2.5] and inner.calls == 2 and local.get("k") == b"v"


@pytest.mark.parametrize(
    "error", [ObjectNotFoundError("k: no such object"), InvalidKeyError("bad key"), BucketError("403 forbidden")]
)
def test_no_retry_on_permanent_errors(local, error):
    sleeps = Sleeps()
    inner = Scripted(local, [error])
    with pytest.raises(type(error)) as info:
        RetryingBucket(inner, sleep=sleeps).get("k")
    assert info.value is error
    assert inner.calls == 1 and sleeps == []


def test_no_retry_on_real_not_found(local):
    sleeps = Sleeps()
    inner = Scripted(local, [])
    with pytest.raises(ObjectNotFoundError):
        RetryingBucket(inner, sleep=sleeps).get("missing")
    assert inner.calls == 1 and sleeps == []


def test_retrying_bucket_delegates_everything(local, tmp_path):
    bucket = RetryingBucket(local, sleep=Sleeps())
    assert bucket.url == local.url
    src = tmp_path / "src"
    src.write_bytes(b"file")
    bucket.put_file("f", src)
    bucket.get_file("f", tmp_path / "out")
    assert (tmp_path / "out").read_bytes() == b"file"
    assert bucket.exists("f") and not bucket.exists("g")
    assert bucket.list() == [ObjectInfo("f", 4)]


def test_retrying_bucket_rejects_bad_settings(local):
    with pytest.raises(ValueError):
        RetryingBucket(local, max_attempts=0)
    with pytest.raises(ValueError):
        RetryingBucket(local, base_delay=-1)


# -- FaultyBucket ----------------------------------------------------------------------------------


def _run_script(bucket: Bucket) -> list[str]:
    """A fixed sequence of operations; returns each outcome."""
    outcomes = []
    for i in range(60):
        op = ("put", "get", "list", "exists", "delete")[i % 5]
        try:
            if op == "put":
                bucket.put(f"k{i % 7}", bytes(range(50)))
            elif op == "get":
                bucket.get(f"k{i % 7}")
            elif op == "list":
                bucket.list()
            elif op == "exists":
                bucket.exists(f"k{i % 7}")
            else:
                bucket.delete([f"k{(i + 3) % 7}"])
            outcomes.append(f"{op}:ok")
        except BucketError as err:
            outcomes.append(f"{op}:{type(err).__name__}:{str(err)[:3]}")
    return outcomes


FAULTS = dict(error_rate=0.2, throttle_rate=0.2, truncate_rate=0.3, list_lag=1)


def test_faulty_bucket_is_deterministic_given_seed(tmp_path):
    runs = []
    for name in ("a", "b"):
        bucket = FaultyBucket(LocalBucket(tmp_path / name), seed=7, **FAULTS)
        runs.append((_run_script(bucket), dict(bucket.injected), LocalBucket(tmp_path / name).list()))
    assert runs[0] == runs[1]
    other = FaultyBucket(LocalBucket(tmp_path / "c"), seed=8, **FAULTS)
    assert _run_script(other) != runs[0][0]
    injected = runs[0][1]
    assert injected["error"] > 0 and injected["throttle"] > 0 and injected["truncate"] > 0


def test_injected_error_and_throttle_are_transient_with_status(local):
    with pytest.raises(TransientBucketError, match=r"^503 Service Unavailable") as info:
        FaultyBucket(local, error_rate=1.0).get("k")
    assert info.value.retry_after is None
    with pytest.raises(TransientBucketError, match=r"^429 Too Many Requests") as info:
        FaultyBucket(local, throttle_rate=1.0, retry_after=0.25).list()
    assert info.value.retry_after == 0.25


def test_injected_faults_happen_before_the_operation(local):
    bucket = FaultyBucket(local, error_rate=1.0)
    with pytest.raises(TransientBucketError):
        bucket.put("k", b"v")
    assert not local.exists("k")
    local.put("d", b"1")
    with pytest.raises(TransientBucketError):
        bucket.delete(["d"])
    assert local.exists("d")
    assert bucket.injected["error"] == 2


def test_truncated_put_stores_a_strict_prefix_and_raises(local):
    data = bytes(range(256)) * 4
    bucket = FaultyBucket(local, seed=1, truncate_rate=1.0)
    with pytest.raises(TransientBucketError, match="cut short") as info:
        bucket.put("anchors/1", data)
    stored = local.get("anchors/1")
    assert len(stored) < len(data) and data.startswith(stored)
    assert f"after {len(stored)} of {len(data)} bytes" in str(info.value)
    assert bucket.injected["truncate"] == 1


def test_truncated_put_file(local, tmp_path):
    src = tmp_path / "src"
    src.write_bytes(b"x" * 1000)
    bucket = FaultyBucket(local, seed=2, truncate_rate=1.0)
    with pytest.raises(TransientBucketError):
        bucket.put_file("f", src)
    assert len(local.get("f")) < 1000


def test_retry_repairs_truncated_uploads(local):
    faulty = FaultyBucket(local, seed=5, truncate_rate=0.5)
    bucket = RetryingBucket(faulty, max_attempts=50, sleep=Sleeps())
    payloads = {f"o{i}": bytes([i % 251]) * (100 + i) for i in range(30)}
    for key, data in payloads.items():
        bucket.put(key, data)
    assert faulty.injected["truncate"] > 5
    assert all(local.get(key) == data for key, data in payloads.items())


def test_list_lags_behind_writes(local):
    bucket = FaultyBucket(local, list_lag=2)
    local.put("old", b"1")
    bucket.put("new", b"22")
    assert bucket.get("new") == b"22" and bucket.exists("new")  # reads see the write at once
    assert [o.key for o in bucket.list()] == ["old"]
    assert [o.key for o in bucket.list()] == ["old"]
    assert [o.key for o in bucket.list()] == ["new", "old"]  # visible on the third listing
    assert bucket.injected["lag"] == 2

    bucket.put("old", b"333")  # overwriting an existing key does not hide it
    assert bucket.list() == [ObjectInfo("new", 2), ObjectInfo("old", 3)]


def test_list_lag_zero_shows_writes_at_once(local):
    bucket = FaultyBucket(local)
    bucket.put("k", b"v")
    assert [o.key for o in bucket.list()] == ["k"]
    assert bucket.injected["lag"] == 0


def test_recreated_key_lags_again(local):
    bucket = FaultyBucket(local, list_lag=1)
    bucket.put("k", b"v")
    bucket.delete(["k"])
    bucket.put("k", b"w")  # new again: hidden for one listing
    assert bucket.list() == []
    assert [o.key for o in bucket.list()] == ["k"]


def test_latency_is_added(local):
    bucket = FaultyBucket(local, latency=0.03)
    start = time.perf_counter()
    bucket.put("k", b"v")
    bucket.get("k")
    assert time.perf_counter() - start >= 0.06
    assert bucket.injected["latency"] == 2


def test_faulty_bucket_validates_key_before_injecting(local):
    bucket = FaultyBucket(local, error_rate=1.0, latency=0.01)
    with pytest.raises(InvalidKeyError):
        bucket.put("../x", b"v")
    assert not any(bucket.injected.values())  # refused before any fault (or write) was attempted
    assert local.list("") == [] and not (local.root.parent / "x").exists()


@pytest.mark.parametrize(
    "kwargs",
    [dict(error_rate=1.5), dict(throttle_rate=-0.1), dict(error_rate=0.6, throttle_rate=0.6), dict(list_lag=-1)],
)
def test_faulty_bucket_rejects_bad_settings(local, kwargs):
    with pytest.raises(ValueError):
        FaultyBucket(local, **kwargs)
