"""Issue 11, findings 6, 9 and 11: things planted in a local bucket folder, oversized
objects, and what killed writers leave behind."""

from __future__ import annotations

import os
import stat
import threading
import time
from pathlib import Path

import pytest

from rlsync.bucket import LocalBucket, open_bucket
from rlsync.errors import BucketError, FormatError, ObjectNotFoundError, ObjectTooLargeError, SyncError
from rlsync.files import age_out, write_atomic
from rlsync.layout import delta_key
from rlsync.protocol import FixedInterval, Publisher, Subscriber
from rlsync.protocol.subscriber import SCRATCH_PREFIX
from tests.helpers import master_state, rl_step


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A folder outside the bucket that nothing may reach."""
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "victim.json").write_text("precious")
    return folder


def run_bounded(fn, timeout: float = 10.0):
    """Run ``fn`` in a thread; fail if it blocks longer than ``timeout``."""
    result: dict = {}

    def target():
        try:
            result["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            result["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"blocked for more than {timeout}s"
    if "error" in result:
        raise result["error"]
    return result.get("value")


def synced_then_delta(bucket, interval: int) -> tuple[Publisher, Subscriber, dict]:
    """Version 0 published and synced by a subscriber, then delta 1 published (not fetched yet)."""
    master = master_state()
    pub = Publisher(bucket, policy=FixedInterval(interval))
    pub.publish(0, master)
    sub = Subscriber(bucket)
    sub.sync()
    rl_step(master, 1)
    pub.publish(1, master)
    return pub, sub, master


def test_symlinked_folder_is_never_followed(bucket, outside: Path) -> None:
    """Finding 9: a symlinked ``status/`` let a write and a delete reach outside the bucket."""
    (bucket.root / "status").symlink_to(outside)
    with pytest.raises(BucketError, match="not a folder"):
        bucket.put("status/victim.json", b"overwritten")
    with pytest.raises(BucketError, match="not a folder"):
        bucket.put("status/new.json", b"planted")
    bucket.delete(["status/victim.json"])
    with pytest.raises(BucketError):
        bucket.get("status/victim.json")
    assert not bucket.exists("status/victim.json")
    assert bucket.list("status/") == []
    assert sorted(p.name for p in outside.iterdir()) == ["victim.json"] and (outside / "victim.json").read_text() == "precious"


def test_symlinked_object_is_never_followed(bucket, outside: Path) -> None:
    (bucket.root / "status").mkdir()
    (bucket.root / "status" / "r1.json").symlink_to(outside / "victim.json")
    with pytest.raises(BucketError, match="not a regular file"):
        bucket.get("status/r1.json")
    assert bucket.list() == [] and not bucket.exists("status/r1.json")
    bucket.put("status/r1.json", b"mine")  # replaces the link itself
    assert (outside / "victim.json").read_text() == "precious" and bucket.get("status/r1.json") == b"mine"
    (bucket.root / "status" / "r2.json").symlink_to(outside / "victim.json")
    bucket.delete(["status/r2.json"])  # removes the link, never its target
    assert (outside / "victim.json").read_text() == "precious" and not (bucket.root / "status" / "r2.json").is_symlink()


def test_shard_symlinked_to_dev_zero_is_refused(bucket, tmp_path: Path) -> None:
    """Finding 9: a shard symlinked to /dev/zero was copied without limit."""
    (bucket.root / "anchors").mkdir()
    (bucket.root / "anchors" / "model.safetensors").symlink_to("/dev/zero")
    for read in (lambda: bucket.get("anchors/model.safetensors"),
                 lambda: bucket.get_file_limited("anchors/model.safetensors", tmp_path / "out", 1000)):  # fmt: skip
        with pytest.raises(BucketError, match="not a regular file"):
            run_bounded(read)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out*.part"))


@pytest.mark.parametrize("key", ["latest.json", "deltas/000000000001.safetensors"])
def test_fifo_is_refused_without_blocking(bucket, key: str) -> None:
    """Finding 9: a FIFO at latest.json blocked fetch forever."""
    path = bucket.root.joinpath(*key.split("/"))
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    with pytest.raises(BucketError, match="not a regular file"):
        run_bounded(lambda: bucket.get(key))
    with pytest.raises(BucketError):
        run_bounded(lambda: bucket.get_limited(key, 100))
    if key == "latest.json":
        with pytest.raises((BucketError, SyncError)):
            run_bounded(lambda: Subscriber(bucket).fetch())
    assert bucket.list() == []


def test_oversized_objects_refused_before_reading(bucket, tmp_path: Path, monkeypatch) -> None:
    """Finding 6: sizes are checked before reading, reads bounded by the declared size."""
    bucket.put("big.bin", b"x" * 10_000)
    monkeypatch.setattr(os, "read", lambda *a: pytest.fail("read before the size check"))
    with pytest.raises(ObjectTooLargeError):
        bucket.get_limited("big.bin", 9_999)
    with pytest.raises(ObjectTooLargeError):
        bucket.get_file_limited("big.bin", tmp_path / "big", 9_999)
    monkeypatch.undo()
    assert bucket.get_limited("big.bin", 10_000) == b"x" * 10_000
    assert not (tmp_path / "big").exists()


def test_subscriber_refuses_a_delta_or_shard_larger_than_the_pointer_says(bucket) -> None:
    """Finding 6: a 6 GB pointer or delta raised MemoryError; a 300 MB shard whose pointer
    says 20 KB was copied in full. Now refused by size before any read, the replica keeps its state."""
    pub, sub, _ = synced_then_delta(bucket, interval=100)
    path = bucket.root.joinpath(*delta_key(1, 1).split("/"))
    with open(path, "ab") as f:
        f.truncate(path.stat().st_size + (1 << 30))  # sparse: 1 GiB larger, no disk used
    with pytest.raises(FormatError, match="more than the"):
        sub.fetch()
    assert sub.step == 0
    fresh = Subscriber(bucket)
    shard = next(bucket.root.glob("anchors/*/model.safetensors"))
    with open(shard, "ab") as f:
        f.truncate(shard.stat().st_size + (1 << 30))
    with pytest.raises(FormatError, match="more than the"):
        fresh.fetch()
    pointer = bucket.root / "latest.json"
    with open(pointer, "ab") as f:
        f.truncate(1 << 31)
    with pytest.raises(FormatError, match="more than the"):
        Subscriber(bucket).fetch()


def test_new_files_respect_the_umask(tmp_path: Path) -> None:
    """Finding 9: objects and CLI outputs were created 0600 whatever the umask."""
    old = os.umask(0o022)
    try:
        bucket = LocalBucket(tmp_path / "b")
        bucket.put("a/b/c.json", b"{}")
        src = tmp_path / "src"
        src.write_bytes(b"data")
        bucket.put_file("a/d.bin", src)
        write_atomic(tmp_path / "out.bin", lambda f: f.write(b"x"))
        for path in (bucket.root / "a/b/c.json", bucket.root / "a/d.bin", tmp_path / "out.bin"):
            assert stat.S_IMODE(path.stat().st_mode) == 0o644, path
        assert stat.S_IMODE((bucket.root / "a/b").stat().st_mode) == 0o755
        os.umask(0o077)
        bucket.put("e.json", b"{}")
        assert stat.S_IMODE((bucket.root / "e.json").stat().st_mode) == 0o600
    finally:
        os.umask(old)


def test_read_only_open_creates_nothing(tmp_path: Path) -> None:
    """Finding 9: ``ls`` on a mistyped path created the directory."""
    with pytest.raises(BucketError, match="no such bucket folder"):
        open_bucket(str(tmp_path / "typo"), create=False)
    with pytest.raises(BucketError):
        open_bucket((tmp_path / "typo").as_uri(), create=False)
    assert not (tmp_path / "typo").exists()
    bucket = LocalBucket(tmp_path / "b")
    with pytest.raises(ObjectNotFoundError):
        bucket.get("no/such/key.json")
    bucket.delete(["no/such/key.json"])
    assert list(bucket.root.iterdir()) == []


def test_killed_writers_leftovers_are_aged_out(bucket, tmp_path: Path) -> None:
    """Finding 11: killed writers leave ``.tmp-*`` files and scratch folders."""
    (bucket.root / "deltas").mkdir()
    old_tmp = bucket.root / "deltas" / ".tmp-00000000dead"
    new_tmp = bucket.root / "deltas" / ".tmp-00000000beef"
    old_tmp.write_bytes(b"partial")
    new_tmp.write_bytes(b"partial")
    past = time.time() - 7 * 3600
    os.utime(old_tmp, (past, past))
    master = master_state()
    pub = Publisher(bucket, policy=FixedInterval(1))
    pub.publish(0, master)  # every anchor sweeps
    assert not old_tmp.exists() and new_tmp.exists()
    scratch = tmp_path / "scratch"
    (scratch / f"{SCRATCH_PREFIX}dead").mkdir(parents=True)
    (scratch / f"{SCRATCH_PREFIX}dead" / "model.safetensors.part").write_bytes(b"x")
    (scratch / f"{SCRATCH_PREFIX}live").mkdir()
    os.utime(scratch / f"{SCRATCH_PREFIX}dead", (past, past))
    Subscriber(bucket, workdir=scratch)
    assert sorted(p.name for p in scratch.iterdir()) == [f"{SCRATCH_PREFIX}live"]
    link = scratch / f"{SCRATCH_PREFIX}link"
    link.symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "keep").write_text("keep")
    assert age_out(scratch, max_age_s=-1, pattern=f"{SCRATCH_PREFIX}*") == 2  # the link is removed, not followed
    assert (tmp_path / "elsewhere" / "keep").read_text() == "keep"


@pytest.mark.parametrize(
    "tensors", ["[" * 100_000 + "]" * 100_000, '{"x": ' + "9" * 5000 + "}"], ids=["deep_nesting", "5000_digits"]
)
def test_replica_refuses_hostile_delta_metadata_and_syncs_again(bucket, tensors: str) -> None:
    """Finding 4: hostile delta metadata killed a replica's fetch thread; it never synced again."""
    import json

    import safetensors.torch

    from rlsync.format import parse_header

    pub, sub, master = synced_then_delta(bucket, interval=2)
    data = bucket.get(delta_key(1, 1))
    _, metadata = parse_header(data)
    hostile = safetensors.torch.save(safetensors.torch.load(data), metadata={**metadata, "tensors": tensors})
    bucket.put(delta_key(1, 1), hostile)
    pointer = json.loads(bucket.get("latest.json"))
    pointer["deltas"][-1]["file"]["size"] = len(hostile)  # the pointer agrees: only the metadata is hostile
    bucket.put("latest.json", json.dumps(pointer).encode())
    with pytest.raises(FormatError):
        sub.fetch()
    assert sub.step == 0 and sub.needs_resync and sub.stats.refused == 1
    rl_step(master, 2)
    pub.publish(2, master)  # an anchor: the replica resynchronises
    sub.sync()
    assert sub.step == 2 and sub.state_hash == pub.manifest.state_hash


def test_verify_tells_retention_from_missing(bucket) -> None:
    """Finding 10: verify while a trainer publishes reported "delta 13 is missing" when retention
    deleted files mid-replay. It now replays a newer snapshot; a file the pointer still names
    but that is gone is still reported."""
    from rlsync.protocol.verify import verify_bucket

    master = master_state()
    pub = Publisher(bucket, policy=FixedInterval(2), keep_anchors=1)
    for step in range(4):
        rl_step(master, step)
        pub.publish(step, master)

    class PublishingMidReplay(LocalBucket):
        """Publishes four more versions (retention drops everything verify started from) on the first delta read."""

        fired = False

        def _race(self, key: str) -> None:
            if key.startswith("deltas/") and not self.fired:
                self.fired = True
                for step in range(4, 8):
                    rl_step(master, step)
                    pub.publish(step, master)

        def get(self, key: str) -> bytes:
            self._race(key)
            return super().get(key)

        def get_limited(self, key: str, max_bytes: int) -> bytes:
            self._race(key)
            return super().get_limited(key, max_bytes)

    racing = PublishingMidReplay(bucket.root)
    report = verify_bucket(racing)
    assert racing.fired and report.ok, report.errors
    assert report.newest_step == 7
    assert len(report.raced) == 1 and "retention deleted" in report.raced[0]  # says it raced, not just OK
    bucket.delete([delta_key(7, 1)])  # still named by the pointer: missing, not retention
    report = verify_bucket(bucket)
    assert not report.ok and "missing" in " ".join(report.errors)
