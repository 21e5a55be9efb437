"""LocalBucket (atomic writes, key validation, list/delete/get_file) and open_bucket URL parsing."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

import rlsync.bucket.local as local_module
from rlsync.bucket import LocalBucket, ObjectInfo, open_bucket, validate_key
from rlsync.bucket.base import MAX_KEY_LENGTH, validate_prefix
from rlsync.errors import BucketError, InvalidKeyError, ObjectNotFoundError

BAD_KEYS = [
    "../escape",
    "a/../../escape",
    "..",
    "/etc/passwd",
    "/abs",
    "a\\b",
    "..\\escape",
    "a//b",
    "a/",
    "/",
    "",
    "./a",
    "a/./b",
    "C:/x",
    "a b",
]


def _files_under(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


# -- atomic put ------------------------------------------------------------------------------------


def test_put_is_atomic_no_partial_object_visible_while_writing(tmp_path, monkeypatch):
    bucket = LocalBucket(tmp_path / "b")
    bucket.put("w/obj.bin", b"old" * 10)
    seen = {}
    real_fsync = os.fsync

    def observe_then_fail(fd):
        # The new bytes have been written to disk but not yet published under the final name.
        real_fsync(fd)
        seen["during"] = bucket.get("w/obj.bin")
        seen["listing"] = bucket.list()
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(local_module.os, "fsync", observe_then_fail)
    with pytest.raises(OSError, match="disk full"):
        bucket.put("w/obj.bin", b"NEW" * 1000)
    monkeypatch.undo()

    assert seen["during"] == b"old" * 10  # readers kept seeing the old object, never a partial new one
    assert seen["listing"] == [ObjectInfo("w/obj.bin", 30)]  # the temporary file is not listed
    assert bucket.get("w/obj.bin") == b"old" * 10
    assert _files_under(bucket.root) == ["w/obj.bin"]  # the failed temporary file was removed


def test_put_new_key_invisible_until_complete(tmp_path, monkeypatch):
    bucket = LocalBucket(tmp_path / "b")
    seen = {}
    real_fsync = os.fsync

    def observe(fd):
        real_fsync(fd)
        seen["exists"] = bucket.exists("k")
        seen["listing"] = bucket.list()

    monkeypatch.setattr(local_module.os, "fsync", observe)
    bucket.put("k", b"x" * 100)
    assert seen == {"exists": False, "listing": []}
    assert bucket.get("k") == b"x" * 100


def test_put_file_is_atomic_and_copies_bytes(tmp_path, monkeypatch):
    bucket = LocalBucket(tmp_path / "b")
    src = tmp_path / "src.bin"
    src.write_bytes(bytes(range(256)) * 64)
    bucket.put_file("f/data.bin", src)
    assert bucket.get("f/data.bin") == src.read_bytes()

    def fail(fd):
        raise OSError("io error (simulated)")

    monkeypatch.setattr(local_module.os, "fsync", fail)
    with pytest.raises(OSError):
        bucket.put_file("f/data.bin", tmp_path / "src.bin")
    monkeypatch.undo()
    assert bucket.get("f/data.bin") == src.read_bytes()
    assert _files_under(bucket.root) == ["f/data.bin"]


def test_tmp_files_are_not_listed(tmp_path):
    bucket = LocalBucket(tmp_path / "b")
    bucket.put("a/one", b"1")
    (bucket.root / ".tmp-abandoned").write_bytes(b"partial")
    (bucket.root / "a" / ".tmp-xyz").write_bytes(b"partial")
    assert bucket.list() == [ObjectInfo("a/one", 1)]
    assert bucket.list("a/") == [ObjectInfo("a/one", 1)]


# -- key validation --------------------------------------------------------------------------------


@pytest.mark.parametrize("key", BAD_KEYS)
def test_validate_key_rejects_unsafe_keys(key):
    with pytest.raises(InvalidKeyError):
        validate_key(key)


@pytest.mark.parametrize(
    ("key", "reason"),
    [
        ("", "must be a non-empty string"),
        (None, "must be a non-empty string"),
        ("a" * (MAX_KEY_LENGTH + 1), f"longer than {MAX_KEY_LENGTH} characters"),
        ("/abs", "relative '/'-separated path"),
        ("a\\b", "relative '/'-separated path"),
        ("c:/x", "relative '/'-separated path"),
        ("a//b", "empty, '.' or '..' segment"),
        ("a/", "empty, '.' or '..' segment"),
        ("a/../b", "empty, '.' or '..' segment"),
        ("a b", "unsupported characters"),
        ("a\n", "unsupported characters"),
    ],
)
def test_validate_key_names_why_a_key_is_refused(key, reason):
    """The error a user sees says which rule the key broke (a hostile pointer's key, a typo in a prefix)."""
    with pytest.raises(InvalidKeyError, match=re.escape(reason)):
        validate_key(key)


@pytest.mark.parametrize(
    "key", ["a", "anchors/step-000010.safetensors", "x/y/z=1+2@v.json", "A_b.c-d", "k" * MAX_KEY_LENGTH]
)
def test_validate_key_accepts_relative_keys(key):
    assert validate_key(key) == key


@pytest.mark.parametrize(
    ("prefix", "bad"), [("", False), ("anchors/", False), ("a/b", False), ("/", True), ("a/../", True), ("/abs/", True)]
)
def test_validate_prefix_accepts_keys_with_a_trailing_slash(prefix, bad):
    if bad:
        with pytest.raises(InvalidKeyError):
            validate_prefix(prefix)
    else:
        assert validate_prefix(prefix) == prefix


@pytest.mark.parametrize("key", BAD_KEYS)
def test_bucket_operations_reject_unsafe_keys_without_touching_disk(tmp_path, key):
    bucket = LocalBucket(tmp_path / "inside" / "b")
    for op in (
        lambda: bucket.put(key, b"x"),
        lambda: bucket.get(key),
        lambda: bucket.get_file(key, tmp_path / "out"),
        lambda: bucket.delete([key]),
        lambda: bucket.exists(key),
    ):
        with pytest.raises(InvalidKeyError):
            op()
    assert _files_under(tmp_path) == []  # nothing written inside or outside the bucket


def test_invalid_key_error_is_a_bucket_error_and_value_error():
    with pytest.raises(BucketError):
        validate_key("../x")
    with pytest.raises(ValueError):
        validate_key("../x")


def test_list_rejects_unsafe_prefix(tmp_path):
    bucket = LocalBucket(tmp_path / "b")
    with pytest.raises(InvalidKeyError):
        bucket.list("../")


# -- list / delete / get / get_file ----------------------------------------------------------------


def test_list_sorted_with_sizes_and_prefix(tmp_path):
    bucket = LocalBucket(tmp_path / "b")
    for key, data in [("deltas/000003", b"333"), ("anchors/000001", b"1"), ("deltas/000002", b"22"), ("head", b"")]:
        bucket.put(key, data)
    assert bucket.list() == [
        ObjectInfo("anchors/000001", 1),
        ObjectInfo("deltas/000002", 2),
        ObjectInfo("deltas/000003", 3),
        ObjectInfo("head", 0),
    ]
    assert [o.key for o in bucket.list("deltas/")] == ["deltas/000002", "deltas/000003"]
    assert [o.key for o in bucket.list("deltas/000003")] == ["deltas/000003"]
    assert bucket.list("nothing/") == []


def test_delete_removes_objects_prunes_empty_dirs_and_ignores_missing(tmp_path):
    bucket = LocalBucket(tmp_path / "b")
    bucket.put("a/b/c", b"1")
    bucket.put("a/d", b"2")
    bucket.delete(["a/b/c", "never/existed"])
    assert bucket.list() == [ObjectInfo("a/d", 1)]
    assert not (bucket.root / "a" / "b").exists()  # empty folder pruned
    assert (bucket.root / "a").is_dir()  # non-empty folder kept
    bucket.delete(["a/d"])
    assert bucket.list() == []
    assert bucket.root.is_dir()  # the root itself is never removed
    with pytest.raises(ObjectNotFoundError):
        bucket.get("a/d")


def test_get_missing_raises_object_not_found(tmp_path):
    bucket = LocalBucket(tmp_path / "b")
    bucket.put("dir/x", b"1")
    for key in ("missing", "dir"):  # a folder is not an object
        with pytest.raises(ObjectNotFoundError, match=key):
            bucket.get(key)
        assert not bucket.exists(key)
    assert bucket.exists("dir/x")


def test_get_file_writes_object_and_leaves_no_part_file(tmp_path):
    bucket = LocalBucket(tmp_path / "b")
    bucket.put("obj", b"payload")
    out = tmp_path / "out.bin"
    out.write_bytes(b"previous")
    bucket.get_file("obj", out)
    assert out.read_bytes() == b"payload"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "out.bin"]  # no .part file left

    with pytest.raises(ObjectNotFoundError):
        bucket.get_file("missing", out)
    assert out.read_bytes() == b"payload"  # untouched on failure
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "out.bin"]  # no .part file left


def test_put_overwrites(tmp_path):
    bucket = LocalBucket(tmp_path / "b")
    bucket.put("k", b"first")
    bucket.put("k", b"second!")
    assert bucket.get("k") == b"second!"
    assert bucket.list() == [ObjectInfo("k", 7)]


# -- open_bucket -----------------------------------------------------------------------------------


def test_open_bucket_plain_path(tmp_path):
    bucket = open_bucket(str(tmp_path / "plain"))
    assert isinstance(bucket, LocalBucket)
    assert bucket.root == (tmp_path / "plain").resolve()
    assert bucket.url == (tmp_path / "plain").resolve().as_uri()


def test_open_bucket_file_url_with_quoting(tmp_path):
    target = tmp_path / "with space"
    bucket = open_bucket(target.as_uri())  # file:///.../with%20space
    assert isinstance(bucket, LocalBucket)
    assert bucket.root == target.resolve()
    bucket.put("k", b"v")
    assert (target / "k").read_bytes() == b"v"
    assert isinstance(open_bucket(f"file://localhost{target}"), LocalBucket)


def test_open_bucket_file_url_with_remote_host_is_rejected(tmp_path):
    with pytest.raises(BucketError, match="remote host"):
        open_bucket("file://otherhost/tmp/x")


def test_open_bucket_hf_url(monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    from rlsync.bucket import RetryingBucket
    from rlsync.bucket.hf import HfBucket

    wrapped = open_bucket("hf://buckets/someone/rl-sync/runs/exp-1", create=False)  # create: one bucket_info call
    assert isinstance(wrapped, RetryingBucket)  # the Hub throttles: hf:// buckets retry by default
    bucket = wrapped.inner
    assert isinstance(bucket, HfBucket)
    assert (bucket.bucket_id, bucket.prefix) == ("someone/rl-sync", "runs/exp-1")
    assert bucket.url == wrapped.url == "hf://buckets/someone/rl-sync/runs/exp-1"

    bare = open_bucket("hf://buckets/someone/rl-sync", create=False).inner
    assert (bare.bucket_id, bare.prefix, bare.url) == ("someone/rl-sync", "", "hf://buckets/someone/rl-sync")


@pytest.mark.parametrize("url", ["hf://someone/a-model", "hf://datasets/someone/data", "hf://buckets/only-owner"])
def test_open_bucket_hf_url_that_is_not_a_bucket_is_rejected(url):
    with pytest.raises(BucketError, match="bucket"):
        open_bucket(url)


def test_open_bucket_unknown_scheme():
    with pytest.raises(BucketError, match="unsupported bucket URL 'gs://b/k': use a local path or one of file://, hf://, s3://"):
        open_bucket("gs://b/k")


def test_object_not_found_reads_as_its_message_not_as_a_quoted_key():
    """KeyError's str() would quote the message (and fail on no argument); a missing object reads plainly."""
    assert str(ObjectNotFoundError("no object 'a/b' in the bucket")) == "no object 'a/b' in the bucket"
    assert str(ObjectNotFoundError()) == "object not found"
