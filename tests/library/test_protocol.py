"""Bucket protocol: bootstrap, late joiners, gaps, corruption, crashes, policies, retention, resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch

from rlsync.bucket import LocalBucket
from rlsync.errors import ChainError, FencedError, FormatError, HashMismatchError, SyncError
from rlsync.delta_format import encode_delta
from rlsync.hashing import state_hash
from rlsync.layout import CONTROL_KEY, POINTER_KEY, delta_key
from rlsync.protocol import Adaptive, FixedInterval, Publisher, Subscriber, policy_to_json, read_manifest
from rlsync.protocol.verify import verify_bucket
from rlsync.spaces.anchor_policy import ControlledPolicy
from tests.helpers import bf16, files_under, master_state, rl_step


def run(pub: Publisher, master, steps, start=0, sub: Subscriber | None = None):
    records = []
    for step in range(start, start + steps):
        if step:
            rl_step(master, step)
        records.append(pub.publish(step, master))
        if sub is not None:
            sub.sync()
            assert sub.state_hash == records[-1].state_hash == state_hash(bf16(master))
    return records


def test_follower_is_bit_exact_and_anchors_follow_interval(bucket):
    master = master_state()
    sub = Subscriber(bucket)
    records = run(Publisher(bucket, policy=FixedInterval(3)), master, 8, sub=sub)
    assert [r.kind for r in records] == ["anchor", "delta", "delta"] * 2 + ["anchor", "delta"]
    assert all(0 < r.changed < r.total for r in records if r.kind == "delta")
    assert state_hash(sub.state) == state_hash(bf16(master))
    # anchors 3 and 6 come with a companion delta: a replica that keeps up downloads one anchor only
    assert sub.stats.anchors_applied == 1 and sub.stats.deltas_applied == 7


def test_late_joiner_downloads_newest_anchor_and_following_deltas(bucket):
    master = master_state()
    run(Publisher(bucket, policy=FixedInterval(4)), master, 7)  # anchors 0, 4; deltas 5, 6
    late = Subscriber(bucket)
    applied = late.sync()
    assert [(u.kind, u.step) for u in applied] == [("anchor", 4), ("delta", 5), ("delta", 6)]
    assert late.state_hash == state_hash(bf16(master))


def test_publishing_every_k_optimizer_steps_stays_exact(bucket):
    """Sub-threshold updates accumulate in fp32 until they flip bf16 bits; deltas are
    relative to the last *published* state, so skipping steps loses nothing."""
    master = master_state()
    pub, sub = Publisher(bucket, policy=FixedInterval(100)), Subscriber(bucket)
    pub.publish(0, master)
    for step in range(1, 13):
        rl_step(master, step, scale=3e-5)
        if step % 3 == 0:
            pub.publish(step, master)
            sub.sync()
            assert sub.state_hash == state_hash(bf16(master))


def test_missing_delta_keeps_state_and_resyncs_from_next_anchor(bucket):
    master = master_state()
    pub, sub = Publisher(bucket, policy=FixedInterval(4)), Subscriber(bucket)
    run(pub, master, 2, sub=sub)
    run(pub, master, 2, start=2)
    bucket.delete([delta_key(2, 1)])
    good = (sub.step, sub.state_hash, {n: t.clone() for n, t in sub.state.items()})
    with pytest.raises(ChainError, match="missing"):
        sub.fetch()
    assert (sub.step, sub.state_hash) == good[:2] and state_hash(sub.state) == state_hash(good[2])
    assert sub.needs_resync and sub.fetch() is None  # waits: no newer anchor yet
    run(pub, master, 2, start=4)  # step 4 is an anchor
    applied = sub.sync()
    assert applied[0].kind == "anchor" and sub.step == 5
    assert sub.state_hash == state_hash(bf16(master)) and not sub.needs_resync


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_damaged_delta_is_refused_without_touching_state(bucket, damage):
    master = master_state()
    pub, sub = Publisher(bucket, policy=FixedInterval(3)), Subscriber(bucket)
    run(pub, master, 1, sub=sub)
    run(pub, master, 1, start=1)
    path = bucket.root / delta_key(1, 1)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        for i in range(len(data) - 40, len(data), 7):
            data[i] ^= 0x5A
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data = bytearray(b"\x00" * len(data))
    path.write_bytes(bytes(data))
    before = state_hash(sub.state)
    with pytest.raises(SyncError):
        sub.fetch()
    assert state_hash(sub.state) == before == sub.state_hash and sub.step == 0
    run(pub, master, 2, start=2)  # step 3 is the next anchor
    sub.sync()
    assert sub.step == 3 and sub.state_hash == state_hash(bf16(master))


def test_hash_mismatch_is_refused_before_apply(bucket):
    """A well-formed delta whose values do not produce the promised state is refused by fetch, before
    any write: the state hash updated with its changes (old bits from the state) differs."""
    master = master_state()
    pub, sub = Publisher(bucket, policy=FixedInterval(10)), Subscriber(bucket)
    run(pub, master, 1, sub=sub)
    rec = run(pub, master, 1, start=1)[0]
    # forge: same hashes and steps, but values from another update
    forged_master = master_state()
    rl_step(forged_master, 99)
    pub2 = Publisher(LocalBucket(bucket.root.parent / "other"), policy=FixedInterval(10))
    pub2.publish(0, master_state())
    changes = pub2.detector.diff(forged_master)
    data = encode_delta(
        changes, step=1, base_step=0, base_hash=read_manifest(bucket).anchors[0].state_hash,
        state_hash=rec.state_hash, total=rec.total,
    )  # fmt: skip
    bucket.put(delta_key(1, 1), data)
    pointer = json.loads(bucket.get(POINTER_KEY))
    pointer["deltas"][0]["file"]["size"] = len(data)
    bucket.put(POINTER_KEY, json.dumps(pointer).encode())
    before = {n: t.clone() for n, t in sub.state.items()}
    with pytest.raises(HashMismatchError, match="^delta 1: the state it makes from step 0 does not match its hash"):
        sub.fetch()
    assert state_hash(sub.state) == state_hash(before) == sub.state_hash and sub.step == 0
    assert sub.needs_resync and sub.stats.refused == 1


def test_same_delta_twice_is_refused(bucket):
    master = master_state()
    pub, sub = Publisher(bucket), Subscriber(bucket)
    run(pub, master, 1, sub=sub)
    run(pub, master, 1, start=1)
    update = sub.fetch()
    sub.apply(update)
    after = state_hash(sub.state)
    with pytest.raises(ChainError, match="^delta 0->1 does not apply to step 1$"):
        sub.apply(update)
    assert state_hash(sub.state) == after == sub.state_hash


def test_out_of_order_delta_is_refused(bucket):
    master = master_state()
    pub, sub = Publisher(bucket), Subscriber(bucket)
    run(pub, master, 1, sub=sub)
    run(pub, master, 2, start=1)
    first = sub.fetch()
    sub.apply(first)
    second = sub.fetch()
    sub2 = Subscriber(bucket)
    sub2.apply(Subscriber(bucket).fetch())  # an anchor-only replica at step 0
    before = sub2.state_hash
    with pytest.raises(ChainError):
        sub2.apply(second)
    assert sub2.state_hash == before == state_hash(sub2.state)


class _FailOnce(LocalBucket):
    def __init__(self, root, fail_key):
        super().__init__(root)
        self.fail_key = fail_key

    def put(self, key, data):
        if key == self.fail_key:
            self.fail_key = None
            raise OSError("simulated crash before the pointer was written")
        super().put(key, data)


def test_crash_between_data_and_pointer_leaves_bucket_readable(tmp_path):
    bucket = _FailOnce(tmp_path / "b", fail_key=None)
    master = master_state()
    pub, sub = Publisher(bucket, policy=FixedInterval(5)), Subscriber(bucket)
    run(pub, master, 2, sub=sub)
    rl_step(master, 2)
    bucket.fail_key = POINTER_KEY
    with pytest.raises(OSError):
        pub.publish(2, master)
    assert bucket.exists(delta_key(2, 1))  # data landed, pointer did not
    assert sub.fetch() is None and sub.step == 1
    assert verify_bucket(bucket).ok
    pub.publish(2, master)  # the publisher state was not advanced: retry works
    sub.sync()
    assert sub.step == 2 and sub.state_hash == state_hash(bf16(master))


def test_anchor_interval_changed_through_control_object(bucket):
    master = master_state()
    policy = ControlledPolicy(bucket, FixedInterval(5))
    pub = Publisher(bucket, policy=policy)
    kinds = [r.kind for r in run(pub, master, 6)]
    assert kinds == ["anchor"] + ["delta"] * 4 + ["anchor"]
    bucket.put(CONTROL_KEY, policy_to_json(FixedInterval(2)))
    kinds = [r.kind for r in run(pub, master, 4, start=6)]
    assert kinds == ["delta", "anchor", "delta", "anchor"]
    assert policy.policy == FixedInterval(2) and pub.policy.settings() == FixedInterval(2).settings()
    bucket.put(CONTROL_KEY, b'{"policy": "fixed", "interval": 0}')  # invalid: ignored, old policy kept
    run(pub, master, 1, start=10)
    assert policy.policy == FixedInterval(2) and policy.refused[CONTROL_KEY] == 1


def test_a_plain_publisher_keeps_its_own_policy_whatever_the_control_object_says(bucket):
    """Following the panels' control object is the Space's choice (ControlledPolicy), not the library's."""
    master = master_state()
    pub = Publisher(bucket, policy=FixedInterval(5))
    bucket.put(CONTROL_KEY, policy_to_json(FixedInterval(1)))
    assert [r.kind for r in run(pub, master, 3)] == ["anchor", "delta", "delta"]


def test_adaptive_policy_bounds_catchup_bytes(bucket):
    master = master_state()
    pub = Publisher(bucket, policy=Adaptive(max_catchup_ratio=1.5))
    records = run(pub, master, 12)
    anchors = [r.step for r in records if r.kind == "anchor"]
    assert len(anchors) >= 2
    manifest = read_manifest(bucket)
    assert manifest.catchup_bytes() <= 1.5 * manifest.newest_anchor.nbytes
    assert all(r.catchup_bytes <= 1.5 * manifest.newest_anchor.nbytes for r in records)


def test_retention_keeps_last_anchors_and_following_deltas(bucket):
    master = master_state()
    pub = Publisher(bucket, policy=FixedInterval(3), keep_anchors=2)
    run(pub, master, 11)  # anchors 0, 3, 6, 9
    manifest = read_manifest(bucket)
    assert [a.step for a in manifest.anchors] == [6, 9]
    assert [d.step for d in manifest.deltas] == [7, 8, 9, 10]  # 9: the companion delta of anchor 9
    named = {f.key for a in manifest.anchors for f in a.files} | {d.file.key for d in manifest.deltas}
    stored = {o.key for o in bucket.list() if o.key.startswith(("anchors/", "deltas/"))}
    assert stored == named
    late = Subscriber(bucket)
    late.sync()
    assert late.state_hash == state_hash(bf16(master))


def test_resume_continues_versions(bucket):
    master = master_state()
    run(Publisher(bucket, policy=FixedInterval(4)), master, 6)
    with pytest.raises(SyncError, match="already holds"):
        Publisher(bucket).publish(6, master)
    pub = Publisher(bucket, policy=FixedInterval(4))
    state = pub.resume()
    assert pub.step == 5 and state_hash(state) == state_hash(bf16(master))
    with pytest.raises(SyncError, match="does not advance"):
        pub.publish(5, master)
    rl_step(master, 6)
    rec = pub.publish(6, master)
    assert rec.kind == "delta"
    sub = Subscriber(bucket)
    sub.sync()
    assert sub.step == 6 and sub.state_hash == state_hash(bf16(master))


@pytest.mark.parametrize(
    "pointer",
    [
        b"not json",
        b'{"format": "rlsync", "format_version": 99}',
        None,  # key with '..', built below
    ],
)
def test_hostile_pointer_is_refused(bucket, tmp_path, pointer):
    master = master_state()
    sub = Subscriber(bucket)
    run(Publisher(bucket), master, 1, sub=sub)
    if pointer is None:
        doc = json.loads(bucket.get(POINTER_KEY))
        doc["anchors"][0]["files"][0]["key"] = "../../etc/passwd"
        pointer = json.dumps(doc).encode()
    bucket.put(POINTER_KEY, pointer)
    held = (sub.step, sub.state_hash, {n: t.clone() for n, t in sub.state.items()})
    files = files_under(tmp_path)
    for reader in (Subscriber(bucket), sub):
        downloaded = reader.stats.bytes_downloaded
        with pytest.raises(FormatError):
            reader.fetch()
        assert reader.stats.bytes_downloaded - downloaded == len(pointer)  # nothing read past the pointer
    assert files_under(tmp_path) == files  # and nothing written anywhere
    assert (sub.step, sub.state_hash) == held[:2] == (0, state_hash(held[2])) and state_hash(sub.state) == held[1]


def test_verify_detects_corruption(bucket):
    master = master_state()
    run(Publisher(bucket, policy=FixedInterval(3)), master, 5)
    report = verify_bucket(bucket)
    assert report.ok and report.anchors_checked == 2 and report.deltas_checked == 4  # incl. the companion of anchor 3
    path = bucket.root / delta_key(4, 1)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    assert not verify_bucket(bucket).ok


def test_non_bf16_tensors_are_shipped_in_their_own_dtype(bucket):
    """With ``dtype=None`` each tensor is compared and shipped by the bits of its own dtype."""
    sub = Subscriber(bucket)
    pub = Publisher(bucket, dtype=None, allow_non_finite=True)  # NaN published on purpose: bits, not values
    state = bf16(master_state())
    state["router.bias"] = torch.zeros(16, dtype=torch.float32)
    for step in range(3):
        state["router.bias"][step] = float("nan") if step == 2 else -0.0
        state["model.step_counter"] += 1
        pub.publish(step, state)
        sub.sync()
        assert sub.state_hash == state_hash(state)
    assert sub.state["router.bias"].dtype == torch.float32
    assert sub.state["model.step_counter"].dtype == torch.int64 and int(sub.state["model.step_counter"]) == 3
    assert torch.isnan(sub.state["router.bias"][2]) and torch.signbit(sub.state["router.bias"][1])


def test_second_trainer_is_refused_and_a_taken_over_one_is_fenced(bucket):
    from rlsync.errors import FencedError, RunLockedError

    master = master_state()
    first = Publisher(bucket, owner="trainer-a")
    run(first, master, 2)
    other = Publisher(bucket, owner="trainer-b")
    with pytest.raises(RunLockedError, match="trainer-a"):
        other.resume()
    # the same trainer restarted (e.g. after kill -9) takes over at once ...
    restarted = Publisher(bucket, owner="trainer-a")
    restarted.resume()
    rl_step(master, 2)
    restarted.publish(2, master)
    # ... and the old process, still running, can no longer write into the chain
    before = bucket.get(POINTER_KEY)
    with pytest.raises(FencedError):
        first.publish(3, master)
    assert bucket.get(POINTER_KEY) == before and not bucket.exists(delta_key(3, 1))
    # a stale lock (no heartbeat for longer than the TTL) can be taken over
    late = Publisher(bucket, owner="trainer-b", lock_ttl_s=0.0)
    late.resume()
    rl_step(master, 3)
    assert late.publish(3, master).step == 3


def test_trainer_taken_over_mid_upload_cannot_overwrite_the_new_trainers_files(bucket, tmp_path):
    """Trainer A stalls uploading step 2; trainer B takes over and publishes step 2; A's upload then lands."""
    master = master_state()
    a = Publisher(bucket, owner="trainer-a")
    run(a, master, 2)
    taken_over: list[Publisher] = []

    class Stalling(LocalBucket):
        def put(self, key, data):
            if key.startswith("deltas/000000000002") and not taken_over:  # B takes over before A's bytes land
                b = Publisher(bucket, owner="trainer-a")
                b.resume()
                other = {n: t.clone() for n, t in master.items()}
                rl_step(other, 99)
                b.publish(2, other)
                taken_over.append(b)
            return super().put(key, data)

    a.writer.bucket = Stalling(bucket.root)  # its uploads (the run lock is read from the bucket itself)
    rl_step(master, 2)
    with pytest.raises(FencedError):
        a.publish(2, master)
    b_manifest = read_manifest(bucket)
    b_files = {f.key: bucket.get(f.key) for f in b_manifest.delta_after(1).files}
    assert b_manifest.step == 2 and all("-e0002" in k for k in b_files)
    sub = Subscriber(bucket)
    sub.sync()
    assert sub.state_hash == b_manifest.state_hash == taken_over[0].manifest.state_hash
    assert verify_bucket(bucket).ok
    assert any("-e0001" in o.key for o in bucket.list("deltas/"))  # A's bytes landed under its own epoch


@pytest.mark.parametrize("version", [1, 2])
def test_an_older_format_chain_is_refused_clearly_and_a_new_run_replaces_it(bucket, tmp_path, version):
    """Versions 1 and 2 hashed states with SHA-256 trees, which this reader cannot check: the
    subscriber refuses the chain before any download, naming the version and what to do; the
    publisher does not extend it; a new run replaces it."""
    from rlsync.anchor_format import anchor_metadata
    from rlsync.protocol import AnchorEntry, FileEntry, Manifest

    master = master_state()
    old_hash = "0" * 64
    metadata = {**anchor_metadata(step=0, state_hash=old_hash, total=1), "format_version": str(version)}
    safetensors.torch.save_file(bf16(master), tmp_path / "model.safetensors", metadata=metadata)
    key = "anchors/000000000000/model.safetensors"
    bucket.put_file(key, tmp_path / "model.safetensors")
    anchor = AnchorEntry(0, old_hash, (FileEntry(key, (tmp_path / "model.safetensors").stat().st_size),))
    bucket.put(POINTER_KEY, Manifest(0, old_hash, (anchor,), (), format_version=version).to_json())
    sub = Subscriber(bucket)
    with pytest.raises(FormatError, match=f"^unsupported rlsync chain format version '{version}': .*re-publish an anchor .*new run"):
        sub.fetch()
    assert sub.stats.refused == 1 and sub.step is None and sub.stats.bytes_downloaded == len(bucket.get(POINTER_KEY))
    with pytest.raises(SyncError, match=f"format version {version}"):
        Publisher(bucket).resume()
    Publisher(bucket, new_run=True).publish(1, master)
    sub = Subscriber(bucket)
    sub.sync()
    assert sub.step == 1 and sub.state_hash == state_hash(bf16(master))


# -- subscriber details (each found unchecked by mutation testing) ------------------------------


def test_pointer_going_back_is_refused_counted_and_logged(bucket, caplog):
    master = master_state()
    pub, sub = Publisher(bucket, policy=FixedInterval(10)), Subscriber(bucket)
    run(pub, master, 2, sub=sub)
    older = bucket.get(POINTER_KEY)
    run(pub, master, 1, start=2, sub=sub)
    bucket.put(POINTER_KEY, older)  # a stale pointer (a cache, a lagging replica of the store)
    with pytest.raises(ChainError, match="^pointer went back from 2 to 1$"):
        sub.fetch()
    assert sub.stats.refused == 1 and sub.needs_resync and sub.stats.last_error == "pointer went back from 2 to 1"
    with pytest.raises(ChainError):
        sub.fetch()
    assert sub.stats.refused == 2  # every refusal counts
    assert [r.getMessage() for r in caplog.records if r.name == "rlsync.protocol.chooser"][-1] == (
        "refused update: pointer went back from 2 to 1; keeping step 2 until a pointer it can verify"
    )


def _following(bucket, followed: int, published: int, interval: int = 10):
    """A subscriber that followed the first ``followed`` versions of ``published`` ones."""
    master = master_state()
    pub, sub = Publisher(bucket, policy=FixedInterval(interval)), Subscriber(bucket)
    run(pub, master, followed, sub=sub)
    run(pub, master, published - followed, start=followed)
    return master, pub, sub


def _edit_pointer(bucket, edit) -> None:
    doc = json.loads(bucket.get(POINTER_KEY))
    edit(doc)
    bucket.put(POINTER_KEY, json.dumps(doc).encode())


def test_delta_disagreeing_with_its_pointer_entry_is_refused(bucket):
    _, _, sub = _following(bucket, 1, 2)
    _edit_pointer(bucket, lambda doc: doc.update(state_hash="0" * 64, deltas=[dict(doc["deltas"][-1], state_hash="0" * 64)]))
    with pytest.raises(FormatError, match=f"^{delta_key(1, 1)}: metadata disagrees with the pointer$"):
        sub.fetch()
    assert sub.stats.refused == 1 and sub.step == 0


def test_fetched_delta_reports_its_size_changes_and_times(bucket):
    import time

    _, _, sub = _following(bucket, 1, 2)
    t0 = time.perf_counter()
    update = sub.fetch()
    elapsed = time.perf_counter() - t0
    entry = read_manifest(bucket).deltas[-1]
    assert (update.kind, update.step, update.base_step) == ("delta", 1, 0)
    assert update.nbytes == entry.file.size == len(bucket.get(delta_key(1, 1)))
    assert update.changed == entry.changed == sum(p.numel for p in update.patches.values()) > 0
    assert 0 < update.download_s and 0 < update.decode_s and update.download_s + update.decode_s <= elapsed


@pytest.mark.parametrize("change", ["shape", "dtype"])
def test_anchor_of_another_schema_is_refused(tmp_path, change):
    """A replica never swaps its model for one of other shapes or dtypes under the same names."""
    ours, theirs = LocalBucket(tmp_path / "ours"), LocalBucket(tmp_path / "theirs")
    Publisher(ours).publish(0, master_state())
    sub = Subscriber(ours)
    sub.sync()
    other = master_state()
    name = "model.norm.weight" if change == "shape" else "model.step_counter"
    other[name] = other[name][:-1] if change == "shape" else other[name].to(torch.int32)
    Publisher(theirs).publish(5, other)
    sub.bucket = theirs
    with pytest.raises(FormatError, match="^anchor 5: tensor names, shapes or dtypes differ from the model$"):
        sub.fetch()
    assert sub.step == 0 and sub.state_hash == state_hash(sub.state) == state_hash(bf16(master_state()))


def test_apply_counts_times_and_logs_each_update(bucket, caplog):
    import logging
    import time

    caplog.set_level(logging.INFO, logger="rlsync.protocol.subscriber")
    master = master_state()
    pub = Publisher(bucket, policy=FixedInterval(2))
    run(pub, master, 3)  # anchors 0 and 2, deltas 1 and 2
    sub = Subscriber(bucket)
    sub.apply(sub.fetch())  # anchor 2
    assert sub.needs_resync is False and sub.stats.anchors_applied == 1
    run(pub, master, 3, start=3)  # anchor 4, deltas 3..5
    bucket.delete([delta_key(3, 1)])
    with pytest.raises(ChainError):
        sub.fetch()
    assert sub.needs_resync is True
    t0 = time.perf_counter()
    update = sub.fetch()
    sub.apply(update)  # anchor 4
    elapsed = time.perf_counter() - t0
    assert (update.kind, update.step) == ("anchor", 4) and sub.needs_resync is False
    assert sub.stats.anchors_applied == 2 and 0 <= sub.stats.last_apply_s <= elapsed
    sub.apply(delta := sub.fetch())
    assert sub.stats.deltas_applied == 1
    messages = [r.getMessage() for r in caplog.records if r.name == "rlsync.protocol.subscriber"]
    assert messages[-1] == f"applied delta 5 ({delta.nbytes} bytes)" and f"applied anchor 4 ({update.nbytes} bytes)" in messages


def test_refused_subscriber_at_an_anchor_step_waits_instead_of_refetching_it(bucket):
    _, _, sub = _following(bucket, 4, 5, interval=3)  # at step 3, which is also an anchor
    bucket.put(delta_key(4, 1), b"garbage")
    with pytest.raises(SyncError):
        sub.fetch()
    assert sub.fetch() is None and sub.step == 3  # anchor 3 is not newer than the state: nothing to fetch


def test_pointer_without_anything_continuing_the_state_is_refused(bucket):
    _, _, sub = _following(bucket, 2, 3)
    _edit_pointer(bucket, lambda doc: doc.update(deltas=[dict(doc["deltas"][-1], base_step=0)]))  # none from step 1
    with pytest.raises(ChainError, match="^no retained delta or anchor continues step 1$"):
        sub.fetch()
    assert sub.stats.refused == 1 and sub.needs_resync and sub.step == 1


def test_fresh_subscriber_then_anchor_downloaded_in_its_workdir_and_reads_counted(bucket, tmp_path, monkeypatch):
    sub = Subscriber(bucket, workdir=tmp_path / "scratch")
    assert (sub.state, sub.step, sub.state_hash, sub.manifest, sub.needs_resync) == ({}, None, None, None, False)
    (tmp_path / "scratch").mkdir()
    master = master_state()
    pub = Publisher(bucket, policy=FixedInterval(10))
    run(pub, master, 2)
    downloads = []
    get_file = type(bucket).get_file_limited
    monkeypatch.setattr(
        bucket, "get_file_limited", lambda key, path, size: downloads.append(Path(path)) or get_file(bucket, key, path, size)
    )
    sub.apply(sub.fetch())  # pointer + the anchor's one file
    assert sub.stats.reads == 2 and len(downloads) == 1
    folder = downloads[0].parent
    assert folder.parent == tmp_path / "scratch" and folder.name.startswith("rlsync-anchor-") and not folder.exists()
    sub.apply(sub.fetch())  # pointer + delta
    assert sub.stats.reads == 4 and sub.step == 1
    assert sub.stats.bytes_downloaded == 2 * len(bucket.get(POINTER_KEY)) + read_manifest(bucket).anchors[0].nbytes + len(
        bucket.get(delta_key(1, 1))
    )


def test_fetched_anchor_reports_its_size_elements_and_times(bucket):
    import time

    master = master_state()
    run(Publisher(bucket), master, 1)
    sub = Subscriber(bucket)
    t0 = time.perf_counter()
    update = sub.fetch()
    elapsed = time.perf_counter() - t0
    entry = read_manifest(bucket).anchors[0]
    assert (update.kind, update.step, update.nbytes) == ("anchor", 0, entry.nbytes)
    assert update.changed == sum(t.numel() for t in master.values())
    assert 0 < update.download_s and 0 < update.decode_s and update.download_s + update.decode_s <= elapsed


@pytest.mark.parametrize("damage", ["missing", "truncated", "pointer_hash", "content"])
def test_refused_anchor_is_counted_logged_and_its_download_removed(bucket, tmp_path, caplog, damage):
    master = master_state()
    run(Publisher(bucket), master, 1)
    key = read_manifest(bucket).anchors[0].files[0].key
    if damage == "missing":
        bucket.delete([key])
        message = f"^anchor 0 is missing a file: {key}"
    elif damage == "truncated":
        size = len(bucket.get(key))
        bucket.put(key, bucket.get(key)[:-3])
        message = f"^{key}: {size - 3} bytes, the pointer promised {size} \\(truncated\\?\\)$"
    elif damage == "pointer_hash":
        _edit_pointer(bucket, lambda doc: doc.update(state_hash="0" * 64, anchors=[dict(doc["anchors"][0], state_hash="0" * 64)]))
        message = "^anchor 0: metadata disagrees with the pointer$"
    else:  # same size and metadata, other values
        data = bytearray(bucket.get(key))
        data[-1] ^= 0x01
        bucket.put(key, bytes(data))
        message = "^anchor 0: content does not match its hash$"
    (tmp_path / "scratch").mkdir()
    sub = Subscriber(bucket, workdir=tmp_path / "scratch")
    for attempt in (1, 2):
        with pytest.raises(SyncError, match=message) as info:
            sub.fetch()
        assert sub.stats.refused == attempt and sub.stats.last_error == str(info.value)
    assert not any((tmp_path / "scratch").iterdir())  # the download folder is removed
    logged = [r.getMessage() for r in caplog.records if r.name == "rlsync.protocol.chooser"]
    assert logged[-1] == f"refused anchor 0: {info.value}"
    assert sub.step is None and sub.state == {}


def test_fifty_deltas_keep_the_maintained_hash_equal_to_a_full_rehash(bucket):
    """The trainer's hash is updated from each delta's changes, the subscriber's from the same changes
    read against its own state; after 50 deltas both equal a full re-hash of the actual tensors."""
    master = master_state()
    pub, sub = Publisher(bucket, policy=FixedInterval(1000)), Subscriber(bucket)
    records = run(pub, master, 51, sub=sub)
    assert [r.kind for r in records].count("delta") == 50
    assert sub.state_hash == records[-1].state_hash == state_hash(sub.state) == state_hash(bf16(master))
    assert sub.verify_weights() is True and sub.stats.rehash_mismatches == 0


def test_a_rehash_pass_stays_exact_while_deltas_are_applied_between_its_chunks(bucket, monkeypatch):
    """verify_weights reads the state a chunk at a time; a delta applied between two chunks of the
    tensor being read is accounted for (its changes below the read position), so no false alarm."""
    import rlsync.protocol.rehash as rehash_module

    master = master_state()
    pub, sub = Publisher(bucket, policy=FixedInterval(1000)), Subscriber(bucket)
    run(pub, master, 1, sub=sub)
    run(pub, master, 1, start=1)
    update = sub.fetch()
    name = max(update.patches, key=lambda n: update.patches[n].numel)
    middle = int(update.patches[name].index[update.patches[name].numel // 2])
    monkeypatch.setattr(rehash_module, "CHUNK_ELEMENTS", max(1, middle))
    real, applied = rehash_module.slice_lanes, []

    def apply_between_chunks(tensor_name, flat, start, numel):
        if tensor_name == name and start > 0 and not applied:  # the first chunk of this tensor is in
            applied.append(sub.apply(update))
        return real(tensor_name, flat, start, numel)

    monkeypatch.setattr(rehash_module, "slice_lanes", apply_between_chunks)
    assert sub.verify_weights() is True and applied and sub.step == 1
    assert sub.stats.verified_step == 1 and sub.stats.verified_hash == state_hash(sub.state) == sub.state_hash
