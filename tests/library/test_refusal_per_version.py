"""Issue 33 item 3: a size-limited read of the Hub bucket refuses an oversized object from its listed size,
never downloading it, at every repeated read of that version; a new, smaller version of the key is read.

``HfBucket`` learns the version and its size with the one resolve request a read makes anyway (no
Xet token, no download); a watched bucket holds the version (size and Xet hash) in its view and refuses a
repeated read with no request at all. Issue 41 item 5b: the size check costs no request of its own, a read
within the limit is one resolve request and no API request. Against the Hub stand-in with the real huggingface_hub +
hf_xet client.
"""

from __future__ import annotations

import time

import pytest

from rlsync.bucket.budget import RequestClass, classify
from rlsync.bucket.watch import WatchedBucket
from rlsync.errors import ObjectNotFoundError, ObjectTooLargeError
from rlsync.layout import CONTROL_KEY
from tests.helpers import hub_buckets

BUCKET = "me/refusals"
TOKEN = "hf_refusal_token"
LIMIT = 64 << 10


@pytest.fixture
def hf(hub):
    """Opens an unpaced HfBucket on the test's bucket of the Hub stand-in."""
    return hub_buckets(hub, BUCKET, TOKEN)


def requests_since(hub, since: float) -> list[str]:
    """Every request of the token since `since`, API and resolver (Xet downloads go through the resolver)."""
    return [f"{cls.value} {classify(r.method, r.path)[1]}"
            for cls in RequestClass for r in hub.usage(cls, TOKEN, since)]  # fmt: skip


def test_hub_bucket_refuses_each_repeated_read_of_an_oversized_version_from_its_size_alone(hub, hf, tmp_path):
    writer = hf()
    writer.put(CONTROL_KEY, b"\0" * (4 * LIMIT))
    reader = hf()
    since = time.time()
    for _ in range(5):
        with pytest.raises(ObjectTooLargeError):
            reader.get_limited(CONTROL_KEY, LIMIT)
        with pytest.raises(ObjectTooLargeError):
            reader.get_file_limited(CONTROL_KEY, tmp_path / "out", LIMIT)
    assert requests_since(hub, since) == ["resolver HEAD resolve"] * 10  # no Xet token, no byte of the object
    assert reader.refused_too_large == 10 and list(tmp_path.iterdir()) == []
    writer.put(CONTROL_KEY, b'{"policy": "fixed"}')  # a new version of the key, within the limit: read
    assert reader.get_limited(CONTROL_KEY, LIMIT) == b'{"policy": "fixed"}'


def test_watched_bucket_remembers_the_refused_version_and_reads_the_next_one(hub, hf):
    writer = hf()
    writer.put(CONTROL_KEY, b"\0" * (4 * LIMIT))
    watched = WatchedBucket(hf())
    try:
        deadline = time.monotonic() + 30
        while not (watched.ready and watched.list(CONTROL_KEY) and watched.list(CONTROL_KEY)[0].etag):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        refused = watched.list(CONTROL_KEY)[0].etag
        since = time.time()
        for _ in range(5):
            with pytest.raises(ObjectTooLargeError):
                watched.get_limited(CONTROL_KEY, LIMIT)
        assert [r for r in requests_since(hub, since) if "events" not in r] == []  # remembered: not even a resolve
        writer.put(CONTROL_KEY, b'{"policy": "fixed"}')
        while watched.list(CONTROL_KEY)[0].etag in (refused, None):  # the feed announces the new version
            assert time.monotonic() < deadline + 30
            time.sleep(0.05)
        assert watched.get_limited(CONTROL_KEY, LIMIT) == b'{"policy": "fixed"}'
        assert watched.refused_too_large == 5
    finally:
        watched.close()


def test_a_size_limited_read_costs_one_resolve_request_and_no_api_request(hub, hf, tmp_path):
    writer = hf()
    for i in range(5):
        writer.put(f"deltas/{i:012d}-e0001.safetensors", bytes([i]) * 1000)
    reader = hf()
    with pytest.raises(ObjectNotFoundError):  # a missing object: the same one request
        reader.get_limited("deltas/missing.safetensors", LIMIT)
    reader.get_limited("deltas/000000000000-e0001.safetensors", LIMIT)  # the Xet token, once per process
    since = time.time()
    for i in range(1, 5):
        key = f"deltas/{i:012d}-e0001.safetensors"
        assert reader.get_limited(key, 1000) == bytes([i]) * 1000
        reader.get_file_limited(key, tmp_path / "out", 1000)
        assert (tmp_path / "out").read_bytes() == bytes([i]) * 1000
    # The size check reads the resolve's own headers: no paths-info, no second resolve per read.
    assert requests_since(hub, since) == ["resolver HEAD resolve"] * 8
