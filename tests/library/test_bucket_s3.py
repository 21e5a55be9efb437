"""The S3-compatible backend (rlsync/bucket/s3.py) against moto's S3 server (the ``s3`` fixture, conftest.py),
through boto3 and HTTP as against a real store: a run carried bit-exactly, conditional writes, oversized and
objects refused within one ranged read, errors mapped, hostile listings and answers refused, and opening
``s3://`` without boto3 (the backend is an optional extra). The contract every backend keeps:
test_bucket_contract.py."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
import uuid

import pytest
from botocore.exceptions import ClientError

from rlsync.bucket import Capability, RetryingBucket, backend_of, open_bucket
from rlsync.bucket.s3 import S3Bucket, S3Settings
from rlsync.bucket.watch import watch
from rlsync.errors import (
    BucketError,
    ConfigurationError,
    InvalidKeyError,
    ObjectNotFoundError,
    ObjectTooLargeError,
    TransientBucketError,
)
from rlsync.hashing import state_hash
from rlsync.protocol import FixedInterval, Publisher, Subscriber
from rlsync.registry import Kind, get
from tests.helpers import bf16, master_state, rl_step


def fresh() -> str:
    """A bucket name no other test uses (moto's store lives as long as the session)."""
    return f"rlsync-{uuid.uuid4().hex[:16]}"


class Requests(list):
    """The S3 operations a boto3 client makes, in order (``GetObject``, ``HeadObject``...)."""

    def __init__(self, client) -> None:
        super().__init__()
        client.meta.events.register("before-call.s3.*", lambda model, **_: self.append(model.name))


@pytest.fixture
def client(s3):
    return s3.client()


def test_a_run_published_to_s3_syncs_bit_exactly_and_stays_under_its_prefix(s3, client):
    name = fresh()
    bucket = open_bucket(f"s3://{name}/runs/exp-1", settings=s3)
    master = master_state()
    publisher = Publisher(bucket, policy=FixedInterval(3))
    subscriber = Subscriber(open_bucket(f"s3://{name}/runs/exp-1", settings=s3, create=False))
    for step in range(5):
        record = publisher.publish(step, master)
        assert [u.step for u in subscriber.sync()] == [step]
        assert subscriber.state_hash == state_hash(bf16(master)) == record.state_hash
        rl_step(master, step)
    kinds = {info.key.split("/")[0] for info in bucket.list()}
    assert {"anchors", "deltas"} <= kinds
    every = client.list_objects_v2(Bucket=name)["Contents"]
    assert every and all(item["Key"].startswith("runs/exp-1/") for item in every)  # nothing outside the prefix


def test_opened_by_url_behind_retries_with_its_declared_capabilities(s3):
    bucket = open_bucket(f"s3://{fresh()}/a/b", settings=s3)
    inner = backend_of(bucket)
    assert isinstance(bucket, RetryingBucket) and isinstance(inner, S3Bucket)
    assert (inner.prefix, bucket.url) == ("a/b", inner.url) and inner.url.endswith("/a/b")
    assert inner.capabilities == {Capability.SIZE_LIMITED_READS, Capability.CONDITIONAL_WRITES}
    assert watch(bucket) is bucket  # not metered: nothing to pace or cache


@pytest.mark.parametrize("variable", ["S3_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"])
def test_an_entry_point_passing_the_hubs_settings_reaches_the_store_its_variables_name(variable, s3, monkeypatch):
    """Roles and the CLI open every URL with the Hub's settings (``BucketSettings.from_env``): for an ``s3://``
    bucket, the S3 entry's own settings are read from its variables instead (``S3_ENDPOINT_URL``...), and
    boto3's chain fills what they leave unset (``AWS_ENDPOINT_URL_S3``, ``AWS_REGION``)."""
    from rlsync.bucket.settings import BucketSettings

    monkeypatch.setenv(variable, s3.endpoint_url)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    name = fresh()
    open_bucket(f"s3://{name}/run", settings=BucketSettings()).put("latest.json", b"{}")
    assert s3.client().get_object(Bucket=name, Key="run/latest.json")["Body"].read() == b"{}"


def test_s3_settings_an_entry_point_passes_are_used_as_given(s3, monkeypatch):
    monkeypatch.setenv("S3_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there: the given settings win
    name = fresh()
    open_bucket(f"s3://{name}/run", settings=s3).put("latest.json", b"{}")
    assert s3.client().get_object(Bucket=name, Key="run/latest.json")["Body"].read() == b"{}"


@pytest.mark.parametrize(
    ("url", "error"),
    [
        ("s3://", BucketError), ("s3://ab", BucketError), ("s3://Upper-Case", BucketError), ("s3://a_b_c", BucketError),
        ("s3://bucket/../escape", InvalidKeyError), ("s3://bucket/a//b", InvalidKeyError), ("gs://bucket", BucketError),
    ],
)  # fmt: skip
def test_a_url_that_is_not_an_s3_bucket_is_refused(url, error, s3):
    with pytest.raises(error):
        S3Bucket.from_url(url, settings=s3)


def test_a_missing_bucket_is_an_error_not_an_empty_bucket_unless_created(s3, client):
    name = fresh()
    reader = S3Bucket(name, settings=s3)  # read-only use creates nothing
    with pytest.raises(BucketError, match=f"no bucket '{name}'") as info:
        reader.list()
    assert not isinstance(info.value, ObjectNotFoundError)
    with pytest.raises(BucketError, match="no bucket"):
        reader.get("latest.json")
    S3Bucket(name, settings=s3, create=True).put("k", b"v")
    S3Bucket(name, settings=s3, create=True)  # exists now: opened as it is
    assert reader.get("k") == b"v"
    elsewhere = fresh()
    S3Bucket(elsewhere, settings=dataclasses.replace(s3, region="eu-west-1"), create=True)
    assert client.get_bucket_location(Bucket=elsewhere)["LocationConstraint"] == "eu-west-1"


def test_a_conditional_write_wins_once(s3):
    bucket = S3Bucket(fresh(), settings=s3, create=True)
    assert bucket.put_if_absent("lock.json", b"first") is True
    assert bucket.put_if_absent("lock.json", b"second") is False
    assert bucket.get("lock.json") == b"first"


class Ranges(list):
    """The ``Range`` header of each request a boto3 client sends (``None``: none), in order."""

    def __init__(self, client) -> None:
        super().__init__()
        client.meta.events.register("before-send.s3.*", lambda request, **_: self.append(request.headers.get("Range")))


def test_an_oversized_object_is_refused_in_one_ranged_read_of_one_byte_more_than_allowed(s3, client, tmp_path):
    bucket = S3Bucket(fresh(), settings=s3, create=True, client=client)
    bucket.put("pointer.json", b"x" * 1000)
    requests, ranges = Requests(client), Ranges(client)
    with pytest.raises(ObjectTooLargeError, match="1,000 bytes"):
        bucket.get_limited("pointer.json", 999)
    with pytest.raises(ObjectTooLargeError, match="1,000 bytes"):
        bucket.get_file_limited("pointer.json", tmp_path / "pointer.json", 999)
    assert requests == ["GetObject", "GetObject"] and ranges == [b"bytes=0-999"] * 2
    assert list(tmp_path.iterdir()) == [] and bucket.refused_too_large == 2


@pytest.mark.parametrize("limit", [0, 1, 100])
@pytest.mark.parametrize("size", [0, "limit", "limit+1"])
def test_a_limited_read_is_one_request_at_each_edge_of_its_limit(s3, client, tmp_path, limit, size):
    """Empty (S3 and moto answer a range on it with 416), exactly the limit, one byte over; each one ``GetObject``."""
    size = {0: 0, "limit": limit, "limit+1": limit + 1}[size]
    bucket = S3Bucket(fresh(), settings=s3, create=True, client=client)
    data = bytes(range(256)) * (size // 256) + bytes(range(size % 256))
    bucket.put("k", data)
    requests = Requests(client)
    if size > limit:
        with pytest.raises(ObjectTooLargeError, match=f"{size:,} bytes"):
            bucket.get_limited("k", limit)
        with pytest.raises(ObjectTooLargeError):
            bucket.get_file_limited("k", tmp_path / "k", limit)
        assert list(tmp_path.iterdir()) == [] and bucket.refused_too_large == 2
    else:
        assert bucket.get_limited("k", limit) == data
        bucket.get_file_limited("k", tmp_path / "k", limit)
        assert (tmp_path / "k").read_bytes() == data and bucket.refused_too_large == 0
    assert requests == ["GetObject", "GetObject"]


def test_a_limited_read_of_a_missing_object_is_one_request(s3, client, tmp_path):
    bucket = S3Bucket(fresh(), settings=s3, create=True, client=client)
    requests = Requests(client)
    with pytest.raises(ObjectNotFoundError):
        bucket.get_limited("missing", 10)
    with pytest.raises(ObjectNotFoundError):
        bucket.get_file_limited("missing", tmp_path / "missing", 10)
    assert requests == ["GetObject", "GetObject"] and list(tmp_path.iterdir()) == []


class Stub:
    """A client whose operations answer what the test scripts (a hostile or failing server)."""

    def __init__(self, **answers) -> None:
        self.meta = type("Meta", (), {"region_name": "us-east-1"})()
        for operation, answer in answers.items():
            setattr(self, operation, answer if callable(answer) else (lambda answer=answer, **_: answer))


def failing(code: str, status: int, headers: dict | None = None):
    def fail(**_):
        raise ClientError({"Error": {"Code": code, "Message": "scripted"}, "ResponseMetadata": {
            "HTTPStatusCode": status, "HTTPHeaders": headers or {}}}, "Scripted")  # fmt: skip

    return fail


@pytest.mark.parametrize(
    ("code", "status", "error", "message"),
    [
        ("NoSuchKey", 404, ObjectNotFoundError, "no such object"),
        ("NoSuchBucket", 404, BucketError, "no bucket 'some-bucket'"),
        ("SlowDown", 503, TransientBucketError, "503 SlowDown"),
        ("InternalError", 500, TransientBucketError, "500"),
        ("TooManyRequests", 429, TransientBucketError, "429"),
        ("ConditionalRequestConflict", 409, TransientBucketError, "409"),
        ("AccessDenied", 403, BucketError, "access denied"),
        ("InvalidAccessKeyId", 403, BucketError, "may not"),
        ("InvalidRequest", 400, BucketError, "400 InvalidRequest scripted"),
    ],
)
def test_server_errors_map_onto_the_bucket_errors(code, status, error, message):
    bucket = S3Bucket("some-bucket", client=Stub(get_object=failing(code, status), head_object=failing(code, status)))
    with pytest.raises(error, match=message) as info:
        bucket.get("k")
    assert type(info.value) is error  # a missing bucket is not a missing object, a refusal is not transient
    if error is ObjectNotFoundError:
        assert not bucket.exists("k")
    else:
        with pytest.raises(error):
            bucket.exists("k")


def test_a_throttled_answer_carries_the_servers_wait_and_is_retried():
    stub = Stub(put_object=failing("SlowDown", 503, {"retry-after": "2"}))
    with pytest.raises(TransientBucketError) as info:
        S3Bucket("some-bucket", client=stub).put("k", b"v")
    assert info.value.retry_after == 2.0
    waits = []
    with pytest.raises(BucketError, match="after 3 attempts"):
        RetryingBucket(S3Bucket("some-bucket", client=stub), max_attempts=3, sleep=waits.append).put("k", b"v")
    assert len(waits) == 2 and all(wait >= 2.0 for wait in waits)


def test_an_unreachable_endpoint_is_transient(s3):
    unreachable = S3Settings(endpoint_url="http://127.0.0.1:9", region="us-east-1", connect_timeout=1.0)
    with pytest.raises(TransientBucketError, match="get 'k'"):
        S3Bucket("some-bucket", settings=unreachable).get("k")


def test_no_credentials_is_a_configuration_error_naming_the_variables(s3, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(ConfigurationError, match="AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"):
        S3Bucket(fresh(), settings=s3).list()


class Body:
    """A response body that ends after ``sent`` bytes."""

    def __init__(self, sent: bytes) -> None:
        self.sent, self.closed = sent, False

    def read(self, amount: int) -> bytes:
        out, self.sent = self.sent[:amount], self.sent[amount:]
        return out

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("length", [None, -1, "10"])
def test_an_answer_without_a_valid_size_is_refused(length):
    body = Body(b"0123456789")
    stub = Stub(get_object={"Body": body, "ContentLength": length})
    for read in (lambda b: b.get("k"), lambda b: b.get_limited("k", 100)):
        with pytest.raises(BucketError, match="no valid size"):
            read(S3Bucket("some-bucket", client=stub))


@pytest.mark.parametrize(
    ("answer", "error", "message"),
    [
        ({"ContentLength": 1000}, ObjectTooLargeError, "1,000 bytes"),  # a server that ignores ranges: the whole object
        ({"ContentLength": 101, "ContentRange": "bytes 0-100/*"}, ObjectTooLargeError, "101 bytes"),  # total not said
        ({"ContentLength": 10, "ContentRange": "bytes 0-9/50"}, BucketError, "10 of its 50 bytes"),  # stops short
        ({"ContentLength": 10, "ContentRange": "bytes 5-14/50"}, BucketError, "'bytes 5-14/50' for 10 bytes"),
        ({"ContentLength": 10, "ContentRange": "items 0-9/10"}, BucketError, "answered 'items"),
        ({"ContentLength": 10, "ContentRange": "bytes 0-9/" + "9" * 5000}, BucketError, "answered 'bytes 0-9/999"),
    ],
)
def test_a_ranged_answer_that_is_too_large_or_not_the_range_asked_is_refused_unread(answer, error, message):
    body = Body(b"x" * answer["ContentLength"])
    bucket = S3Bucket("some-bucket", client=Stub(get_object={"Body": body, **answer}))
    with pytest.raises(error, match=message) as info:
        bucket.get_limited("k", 100)
    assert type(info.value) is error and body.closed and len(body.sent) == answer["ContentLength"]  # not one byte read


def test_a_download_cut_short_is_transient_and_leaves_no_file(tmp_path):
    bodies = []

    def get_object(**_):
        bodies.append(Body(b"01234"))
        return {"Body": bodies[-1], "ContentLength": 10}

    bucket = S3Bucket("some-bucket", client=Stub(get_object=get_object))
    with pytest.raises(TransientBucketError, match="5 of 10 bytes came"):
        bucket.get("k")
    with pytest.raises(TransientBucketError, match="5 bytes never came"):
        bucket.get_file("k", tmp_path / "out")
    assert list(tmp_path.iterdir()) == [] and all(body.closed for body in bodies)


def test_a_listing_that_repeats_its_continuation_token_is_refused_not_followed():
    page = {"Contents": [{"Key": "run/a", "Size": 1}], "IsTruncated": True, "NextContinuationToken": "same"}
    calls = []

    def list_objects_v2(**options):
        calls.append(options)
        assert len(calls) < 5, "followed the same token round and round"
        return page

    with pytest.raises(BucketError, match="does not advance"):
        S3Bucket("some-bucket", prefix="run", client=Stub(list_objects_v2=list_objects_v2)).list()
    assert len(calls) == 2


def test_a_listing_skips_names_that_are_no_keys_and_sizes_that_are_no_sizes(s3, client, caplog):
    name = fresh()
    bucket = S3Bucket(name, prefix="run", settings=s3, create=True)
    bucket.put("ok", b"1")
    for key in ("run/folder/", "run/a b", "run/a//b", "runaway", "other/x"):
        client.put_object(Bucket=name, Key=key, Body=b"planted")
    assert [o.key for o in bucket.list()] == ["ok"]
    hostile = Stub(list_objects_v2={"Contents": [
        {"Key": "run/neg", "Size": -1}, {"Key": "run/text", "Size": "9"}, {"Key": None, "Size": 1},
        {"Key": "run/good", "Size": 3, "ETag": '"abc"'}], "IsTruncated": False})  # fmt: skip
    listed = S3Bucket("some-bucket", prefix="run", client=hostile).list()
    assert [(o.key, o.size, o.etag) for o in listed] == [("good", 3, "abc")]
    assert "skipped 3 objects" in caplog.text


def test_a_limited_listing_stops_at_the_page_that_holds_one_more():
    pages = []

    def list_objects_v2(**options):
        pages.append(options.get("ContinuationToken"))
        start = int(options.get("ContinuationToken") or 0)
        keys = [f"run/{i:04d}" for i in range(start, start + 1000)]
        contents = [{"Key": key, "Size": 1} for key in keys]
        return {"Contents": contents, "IsTruncated": True, "NextContinuationToken": str(start + 1000)}

    flooded = S3Bucket("some-bucket", prefix="run", client=Stub(list_objects_v2=list_objects_v2))
    listing, complete = flooded.list_limited("", 1500)
    assert len(listing) == 1500 and not complete and pages == [None, "1000"]


def test_settings_come_from_s3_variables_and_refuse_what_cannot_work():
    entry = get(Kind.BUCKET, "s3")
    variables = {"S3_ENDPOINT_URL": "http://minio:9000", "S3_PATH_STYLE": "1", "S3_READ_TIMEOUT": "5"}
    settings = entry.read_settings(variables)
    assert settings == S3Settings(endpoint_url="http://minio:9000", path_style=True, read_timeout=5.0)
    assert settings.client().meta.config.s3 == {"addressing_style": "path"}
    with pytest.raises(ConfigurationError, match="S3_CONNECT_TIMEOUT=0"):
        entry.read_settings({"S3_CONNECT_TIMEOUT": "0"})


def test_without_boto3_the_library_works_and_opening_an_s3_bucket_says_what_to_install(tmp_path):
    code = textwrap.dedent("""
        import sys
        sys.modules["boto3"] = sys.modules["botocore"] = None  # not installed: importing them raises ImportError
        from rlsync.bucket import open_bucket
        from rlsync.errors import ConfigurationError
        from rlsync.registry import Kind, names
        assert "s3" in names(Kind.BUCKET) and open_bucket(sys.argv[1]).list() == []
        try:
            open_bucket("s3://some-bucket/run")
        except ConfigurationError as err:
            print(err)
    """)  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "b")], capture_output=True, text=True, check=True)
    assert "pip install boto3, or pip install 'rlsync[s3]'" in out.stdout
