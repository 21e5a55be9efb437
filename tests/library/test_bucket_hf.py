"""HfBucket with the real huggingface_hub + hf_xet client against the local Hub stand-in server.

The ``hub`` fixture (conftest.py, testing/hub/server.py) is a local HTTP server implementing the Hub's
bucket API, Xet token endpoint and Xet storage (the CAS protocol hf_xet speaks to the Hub's), and
injected storage faults are real HTTP answers from the server. So every request below goes through
the real client code: ``HfApi`` bucket methods, ``http_backoff``, hf_xet's chunking, upload,
reconstruction and token refresh. No fault in the issue needed the old recording ``HfApi`` stand-in.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime
from pathlib import Path

import pytest

from rlsync.bucket import ObjectInfo, RetryingBucket, open_bucket
from rlsync.bucket.hf import HfBucket
from rlsync.errors import BucketError, InvalidKeyError, ObjectNotFoundError, TransientBucketError
from testing.hub.faults import Fault
from tests.conftest import HUB_TIMEOUT_SECONDS

TOKEN = "hf_TESTsecretTOKEN0123456789abcdefXYZ"
READ_ONLY = "hf_READonlyTOKEN0123456789abcdefXYZ"
BUCKET = "someone/rl-sync"


@pytest.fixture
def server(hub):
    hub.add_token(TOKEN, "write")
    hub.add_token(READ_ONLY, "read")
    hub.create_bucket(BUCKET)
    return hub


@pytest.fixture
def bucket(server) -> HfBucket:
    return HfBucket(BUCKET, prefix="runs/a", token=TOKEN)


def retrying(inner: HfBucket, **kwargs) -> RetryingBucket:
    kwargs = {"base_delay": 0.01, "max_delay": 0.05, "max_total": 20.0, **kwargs}
    return RetryingBucket(inner, **kwargs)


def test_package_import_does_not_import_huggingface_hub():
    code = (
        "import sys, rlsync.bucket as b\n"
        "assert 'huggingface_hub' not in sys.modules\n"
        "b.HfBucket\n"
        "assert 'huggingface_hub' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


# -- every operation through the real client ---------------------------------------------------------


def test_put_get_roundtrip_through_xet_storage(bucket, server):
    payload = bytes(range(256)) * 2000
    bucket.put("step-1/delta.safetensors", payload)
    bucket.put("empty", b"")
    assert bucket.get("step-1/delta.safetensors") == payload
    assert bucket.get("empty") == b""
    stored = server.buckets[BUCKET]["runs/a/step-1/delta.safetensors"]
    assert stored["size"] == len(payload)  # the server read the size from the shard hf_xet uploaded
    assert server.count("token", "xet-write-token") >= 1 and server.count("token", "xet-read-token") >= 1


def test_put_file_and_get_file_stream_through_a_part_file(bucket, tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(b"\x07" * 300_000 + b"tail")
    bucket.put_file("big.bin", src)
    dest = tmp_path / "out" / "big.bin"
    dest.parent.mkdir()
    bucket.get_file("big.bin", dest)
    assert dest.read_bytes() == src.read_bytes()
    assert [p.name for p in dest.parent.iterdir()] == ["big.bin"]


def test_concurrent_get_file_to_one_path_use_separate_part_files(bucket, tmp_path):
    a, b = b"A" * 200_000, b"B" * 200_000
    bucket.put("a", a)
    bucket.put("b", b)
    dest = tmp_path / "same.bin"
    errors: list[BaseException] = []

    def fetch(key: str) -> None:
        try:
            for _ in range(3):
                bucket.get_file(key, dest)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=fetch, args=(k,)) for k in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert dest.read_bytes() in (a, b)  # one whole object, never a mix of two downloads
    assert [p.name for p in tmp_path.iterdir()] == ["same.bin"]


def test_list_follows_pagination_strips_prefix_and_skips_foreign_names(bucket, server):
    server.page_size = 3
    for i in range(8):
        bucket.put(f"step-{i}", bytes([i]) * (i + 1))
    bucket.put("other/x", b"x")
    server.buckets[BUCKET]["runs/a/bad name"] = dict(server.buckets[BUCKET]["runs/a/other/x"])
    server.buckets[BUCKET]["runs/ab/not-mine"] = dict(server.buckets[BUCKET]["runs/a/other/x"])
    listing = bucket.list()
    expected = [ObjectInfo(f"step-{i}", i + 1) for i in range(8)] + [ObjectInfo("other/x", 1)]
    assert listing == sorted(expected, key=lambda o: o.key)
    assert server.count("api", "/tree") >= 4  # 11 entries at 3 per page
    assert bucket.list("step-7") == [ObjectInfo("step-7", 8)]


def test_list_of_missing_folder_is_empty(bucket):
    assert bucket.list("nothing/") == []


def test_exists_and_delete(bucket, server):
    bucket.put("k1", b"1")
    bucket.put("k2", b"2")
    assert bucket.exists("k1") and not bucket.exists("k3")
    bucket.delete(["k1", "k3"])  # k3 does not exist: ignored
    assert [o.key for o in bucket.list()] == ["k2"]
    with pytest.raises(ObjectNotFoundError):
        bucket.get("k1")


def test_delete_over_1000_keys_is_split_into_batches(bucket, server):
    bucket.put("seed", b"s")
    entry = server.buckets[BUCKET]["runs/a/seed"]
    keys = [f"old/{i:05d}" for i in range(1500)]
    for key in keys:
        server.buckets[BUCKET][f"runs/a/{key}"] = dict(entry)
    before = server.count("api", "/batch$")
    bucket.delete(keys)
    assert server.count("api", "/batch$") - before == 2  # the Hub takes at most 1000 operations per call
    assert [o.key for o in bucket.list()] == ["seed"]


def test_create_true_creates_the_bucket_and_a_missing_bucket_is_a_configuration_error(server):
    with pytest.raises(BucketError, match="not found") as info:
        HfBucket("someone/absent", token=TOKEN).list()
    assert not isinstance(info.value, ObjectNotFoundError)
    created = HfBucket("someone/new", token=TOKEN, create=True)
    created.put("x", b"1")
    assert created.get("x") == b"1"


# -- a role's bucket that does not exist yet: created with a writing token, else the way to create it --


def test_a_writing_token_creates_the_missing_bucket_once(server, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    bucket = open_bucket("hf://buckets/someone/fresh")
    assert "someone/fresh" in server.buckets
    bucket.put("x", b"1")
    created = server.count("api", "/api/buckets/someone/fresh$")
    open_bucket("hf://buckets/someone/fresh")  # exists now: looked up, not created again
    assert server.count("api", "/api/buckets/someone/fresh$") == created + 1
    assert open_bucket("hf://buckets/someone/fresh").get("x") == b"1"


def test_a_read_only_token_is_told_how_to_create_the_bucket(server, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", READ_ONLY)
    with pytest.raises(BucketError, match=r"does not exist and this token cannot create it.*hf buckets create someone/absent") as info:
        open_bucket("hf://buckets/someone/absent")
    assert READ_ONLY not in str(info.value)
    assert "someone/absent" not in server.buckets


def test_a_read_only_token_opens_an_existing_bucket_without_writing(server, monkeypatch):
    server.create_bucket("someone/there")
    monkeypatch.setenv("HF_TOKEN", READ_ONLY)
    assert open_bucket("hf://buckets/someone/there").list() == []


def test_a_role_started_on_a_missing_bucket_creates_it(server, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    from env_space.simulator import EnvConfig, EnvSimulator

    EnvSimulator(EnvConfig(bucket="hf://buckets/someone/role-run")).close()
    assert "someone/role-run" in server.buckets


def test_invalid_keys_rejected_before_any_request(bucket, server):
    before = len(server.requests)
    for key in ["../x", "/abs", "a//b", "a\\b"]:
        with pytest.raises(InvalidKeyError):
            bucket.put(key, b"")
    assert len(server.requests) == before


def test_open_bucket_hf_url_uses_hf_token_and_retries(server, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    bucket = open_bucket(f"hf://buckets/{BUCKET}/runs/b")
    assert isinstance(bucket, RetryingBucket)
    server.inject("api", Fault(503, path="/batch$"))
    bucket.put("k", b"v")
    assert bucket.get("k") == b"v"


# -- faults on the Hub API -----------------------------------------------------------------------------


def test_429_with_retry_after_is_retried_once_per_layer_within_a_bounded_total(bucket, server):
    bucket.put("k", b"value")
    server.inject("api", Fault(429, {"Retry-After": "1"}, path="/resolve/"))
    before = server.count("api", "/resolve/")
    started = time.monotonic()
    assert retrying(bucket).get("k") == b"value"
    elapsed = time.monotonic() - started
    assert server.count("api", "/resolve/") - before == 2  # one refusal, one retry (a read's one request)
    assert 1.0 <= elapsed < 1.0 + 2 * HUB_TIMEOUT_SECONDS


def test_retry_after_beyond_the_total_budget_fails_at_once(bucket, server):
    bucket.put("k", b"value")
    server.inject("api", Fault(429, {"Retry-After": "30"}, path="/resolve/"))
    before = server.count("api", "/resolve/")
    started = time.monotonic()
    with pytest.raises(BucketError, match="would pass the 5s limit"):
        retrying(bucket, max_total=5.0).get("k")
    assert time.monotonic() - started < 2.0
    assert server.count("api", "/resolve/") - before == 1  # refused once, and not retried by any layer


def test_retry_after_as_http_date_is_understood(bucket, server):
    when = format_datetime(datetime.now(timezone.utc) + timedelta(seconds=40), usegmt=True)
    server.inject("api", Fault(429, {"Retry-After": when}))
    with pytest.raises(TransientBucketError) as info:
        bucket.list()
    assert 30 < info.value.retry_after <= 40


@pytest.mark.parametrize("fault", [Fault(503), Fault(500), Fault(drop=True)], ids=["503", "500", "dropped"])
def test_transient_api_failures_are_retried_by_one_layer(bucket, server, fault):
    bucket.put("k", b"v")
    server.inject("api", dataclass_replace(fault, path="/paths-info"))
    with pytest.raises(TransientBucketError):
        bucket.exists("k")
    server.inject("api", dataclass_replace(fault, path="/paths-info"))
    before = server.count("api", "/paths-info")
    assert retrying(bucket).exists("k")
    assert server.count("api", "/paths-info") - before == 2


def test_stalled_api_fails_within_the_timeout(bucket, server):
    bucket.put("k", b"v")
    server.inject("api", Fault(stall=20, path="/resolve/"))
    started = time.monotonic()
    with pytest.raises(TransientBucketError):
        bucket.get("k")
    assert time.monotonic() - started < HUB_TIMEOUT_SECONDS + 1.5


@pytest.mark.parametrize("status", [401, 403])
def test_api_permission_errors_are_permanent_and_say_so(bucket, server, status):
    server.inject("api", Fault(status, path="/tree"))
    before = server.count("api", "/tree")
    with pytest.raises(BucketError, match=f"HTTP {status}: permission denied.*read access") as info:
        retrying(bucket).list()
    assert not isinstance(info.value, TransientBucketError)
    assert server.count("api", "/tree") - before == 1


def test_bare_404_is_not_an_empty_listing(bucket, server):
    server.inject("api", Fault(404, path="/tree"))  # a 404 without X-Error-Code: not the Hub answering
    with pytest.raises(BucketError, match="without a Hub error code") as info:
        bucket.list()
    assert not isinstance(info.value, ObjectNotFoundError)


# -- faults on the Xet token endpoint and Xet storage -------------------------------------------------


def test_read_only_token_put_is_a_permission_error(server):
    reader = HfBucket(BUCKET, token=READ_ONLY)
    before = server.count("token")
    with pytest.raises(BucketError, match="HTTP 403: permission denied.*write access") as info:
        retrying(reader).put("k", b"v")
    assert not isinstance(info.value, TransientBucketError)
    assert server.count("token") - before == 1


@pytest.mark.parametrize("status", [401, 403])
def test_revoked_token_at_the_xet_token_endpoint_is_a_permission_error(bucket, server, status):
    bucket.put("k", b"v")
    server.inject("token", Fault(status))
    with pytest.raises(BucketError, match=f"HTTP {status}: permission denied") as info:
        retrying(bucket).get("k")
    assert not isinstance(info.value, TransientBucketError)


def test_token_endpoint_503_is_transient(bucket, server):
    bucket.put("k", b"v")
    server.inject("token", Fault(503))
    assert retrying(bucket).get("k") == b"v"


@pytest.mark.parametrize(
    "fault",
    [Fault(503), Fault(429, {"Retry-After": "1"}), Fault(drop=True), Fault(stall=20)],
    ids=["503", "429", "dropped", "stall"],
)
def test_storage_failures_are_transient_and_retried(bucket, server, fault, tmp_path):
    payload = b"\x01\x02" * 100_000
    bucket.put("k", payload)
    server.inject("storage", fault)
    started, before = time.monotonic(), server.count("storage")
    with pytest.raises(TransientBucketError):
        bucket.get("k")
    assert time.monotonic() - started < HUB_TIMEOUT_SECONDS + 1.5
    storage_requests = server.count("storage") - before
    assert 1 <= storage_requests <= 2  # hf_xet made one attempt (a v2 reconstruction may fall back to v1)
    server.inject("storage", fault)
    assert retrying(bucket).get("k") == payload
    server.inject("storage", fault)
    retrying(bucket).get_file("k", tmp_path / "k")
    assert (tmp_path / "k").read_bytes() == payload


def test_storage_404_is_a_missing_object(bucket, server):
    bucket.put("k", b"\x05" * 1000)
    server.inject("storage", Fault(404))
    with pytest.raises(ObjectNotFoundError):
        retrying(bucket).get("k")


# -- tokens never leak ---------------------------------------------------------------------------------


def test_token_never_in_repr(bucket):
    assert TOKEN not in repr(bucket) and TOKEN not in repr(RetryingBucket(bucket))


@pytest.mark.parametrize("status", [401, 403, 429, 500])
def test_token_echoed_by_server_is_scrubbed(bucket, server, caplog, status):
    server.inject("api", Fault(status, message=f"bad token {TOKEN}", path="/tree"))
    with pytest.raises(BucketError) as info:
        bucket.list()
    text = str(info.value) + "".join(str(e) for e in _chain(info.value))
    assert "<redacted>" in text and TOKEN not in text
    assert TOKEN not in caplog.text


def test_saved_login_token_is_scrubbed(server, monkeypatch, tmp_path):
    """A token the library finds itself (no token=, no HF_TOKEN) is redacted too."""
    from huggingface_hub import constants

    monkeypatch.delenv("HF_TOKEN", raising=False)
    saved = tmp_path / "token"
    saved.write_text(TOKEN)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(saved))
    bucket = HfBucket(BUCKET)
    server.inject("api", Fault(403, message=f"token {TOKEN} cannot read", path="/tree"))
    with pytest.raises(BucketError) as info:
        bucket.list()
    assert "<redacted>" in str(info.value) and TOKEN not in str(info.value)
    assert server.requests[-1].authorization == f"Bearer {TOKEN}"  # it really was the token the client sent


def _chain(err: BaseException):
    while err.__cause__ is not None or err.__context__ is not None:
        err = err.__cause__ or err.__context__
        yield err


def dataclass_replace(fault: Fault, **changes) -> Fault:
    import dataclasses

    return dataclasses.replace(fault, **changes)


# -- the soak trial through the stand-in ---------------------------------------------------------------


def test_soak_trial_on_a_faulty_hub_converges_bit_exactly(tmp_path):
    """testing.soak's hub_storage trial: publisher and subscribers through random Hub API, token and
    storage faults; nothing lost, no invariant violated."""
    import random

    from testing.soak.kinds.hub_storage import trial_hub_storage

    result = trial_hub_storage(random.Random(5), tmp_path, final=4)
    assert not result.violations and result.lost == 0
    assert sum(result.faults.values()) > 0 and result.checks > 0
