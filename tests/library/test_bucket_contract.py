"""The bucket contract: what the sync protocol relies on from every backend, run against each one as
``open_bucket`` opens it from a URL (a local folder; the Hub stand-in, testing/hub/server.py; moto's S3 server).
A new backend joins by adding its scheme to ``BACKENDS`` and its URL to ``backend``."""

from __future__ import annotations

import uuid

import pytest

from rlsync.bucket import Bucket, Capability, ObjectInfo, backend_of, open_bucket
from rlsync.errors import InvalidKeyError, ObjectNotFoundError, ObjectTooLargeError

BACKENDS = ["file", "hf", "s3"]
HF_TOKEN = "hf_CONTRACTtoken0123456789abcdefXYZ"


@pytest.fixture(params=BACKENDS)
def backend(request, tmp_path):
    """Opens buckets of one backend, as a role opens them from a URL: ``backend("run")`` is the folder ``run`` of a
    store of this test's own (a folder, a Hub bucket, an S3 bucket); each is closed after the test."""
    store = f"contract-{uuid.uuid4().hex[:12]}"
    settings = None
    if request.param == "hf":
        hub = request.getfixturevalue("hub")
        hub.add_token(HF_TOKEN, "write")
        hub.create_bucket(f"someone/{store}")
        request.getfixturevalue("monkeypatch").setenv("HF_TOKEN", HF_TOKEN)
    elif request.param == "s3":
        settings = request.getfixturevalue("s3")
    urls = {"file": (tmp_path / store).as_uri(), "hf": f"hf://buckets/someone/{store}", "s3": f"s3://{store}"}
    url = urls[request.param]
    buckets = []

    def open_named(name: str = "run") -> Bucket:
        buckets.append(open_bucket(f"{url}/{name}", settings=settings))
        return buckets[-1]

    yield open_named
    for bucket in buckets:
        bucket.close()


def test_put_get_overwrite_exists(backend):
    bucket = backend()
    payload = bytes(range(256)) * 300
    bucket.put("deltas/000001.safetensors", payload)
    bucket.put("empty", b"")
    assert bucket.get("deltas/000001.safetensors") == payload and bucket.get("empty") == b""
    bucket.put("empty", b"now full")
    assert bucket.get("empty") == b"now full"
    assert bucket.exists("empty") and not bucket.exists("deltas") and not bucket.exists("missing")
    with pytest.raises(ObjectNotFoundError, match="missing"):
        bucket.get("missing")


def test_list_is_sorted_with_sizes_under_a_prefix(backend):
    bucket = backend()
    for key, data in [("deltas/000003", b"333"), ("anchors/000001", b"1"), ("deltas/000002", b"22"), ("head", b"")]:
        bucket.put(key, data)
    assert [(o.key, o.size) for o in bucket.list()] == [
        ("anchors/000001", 1), ("deltas/000002", 2), ("deltas/000003", 3), ("head", 0)
    ]  # fmt: skip
    assert [o.key for o in bucket.list("deltas/")] == ["deltas/000002", "deltas/000003"]
    assert [o.key for o in bucket.list("deltas/000003")] == ["deltas/000003"]
    assert bucket.list("nothing/") == []
    assert bucket.list_limited("deltas/", 1) == ([ObjectInfo("deltas/000002", 2)], False)
    assert bucket.list_limited("deltas/", 2) == (bucket.list("deltas/"), True)


def test_delete_removes_and_ignores_missing_keys(backend):
    bucket = backend()
    bucket.put("a/b/c", b"1")
    bucket.put("a/d", b"2")
    bucket.delete(["a/b/c", "never/existed"])
    bucket.delete([])
    assert bucket.list() == [ObjectInfo("a/d", 1)]
    with pytest.raises(ObjectNotFoundError):
        bucket.get("a/b/c")


def test_files_in_and_out_through_a_part_file(backend, tmp_path):
    bucket = backend()
    source = tmp_path / "source.bin"
    source.write_bytes(bytes(range(256)) * 1000)
    bucket.put_file("anchors/a.safetensors", source)
    out = tmp_path / "out" / "a.bin"
    out.parent.mkdir()
    bucket.get_file("anchors/a.safetensors", out)
    assert out.read_bytes() == source.read_bytes()
    with pytest.raises(ObjectNotFoundError):
        bucket.get_file("missing", out)
    assert out.read_bytes() == source.read_bytes() and [p.name for p in out.parent.iterdir()] == ["a.bin"]


def test_limited_reads_refuse_an_object_over_the_limit_and_leave_no_file(backend, tmp_path):
    bucket = backend()
    bucket.put("pointer.json", b"x" * 100)
    assert bucket.get_limited("pointer.json", 100) == b"x" * 100
    out = tmp_path / "pointer.json"
    with pytest.raises(ObjectTooLargeError, match="pointer.json"):
        bucket.get_limited("pointer.json", 99)
    with pytest.raises(ObjectTooLargeError):
        bucket.get_file_limited("pointer.json", out, 99)
    assert list(tmp_path.glob("pointer.json*")) == []
    with pytest.raises(ObjectNotFoundError):
        bucket.get_limited("missing", 10)
    assert Capability.SIZE_LIMITED_READS in backend_of(bucket).capabilities


@pytest.mark.parametrize("key", ["../escape", "/abs", "a//b", "a/", "", "a b", "a\\b"])
def test_unsafe_keys_are_refused_by_every_operation(backend, key, tmp_path):
    bucket = backend()
    for op in (
        lambda: bucket.put(key, b"x"), lambda: bucket.get(key), lambda: bucket.get_limited(key, 10),
        lambda: bucket.get_file(key, tmp_path / "out"), lambda: bucket.delete([key]), lambda: bucket.exists(key),
    ):  # fmt: skip
        with pytest.raises(InvalidKeyError):
            op()
    assert bucket.list() == []


def test_buckets_at_sibling_urls_never_see_each_others_objects(backend):
    run, other = backend("run"), backend("other")
    run.put("latest.json", b"run")
    other.put("latest.json", b"other")
    assert run.get("latest.json") == b"run" and run.list() == [ObjectInfo("latest.json", 3)]
    other.delete(["latest.json"])
    assert run.get("latest.json") == b"run" and other.list() == []
