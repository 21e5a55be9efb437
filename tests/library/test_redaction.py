"""The panels' own redaction: errors that still carry the token are scrubbed before they are shown or logged.

``tests/library/test_secrets.py`` runs everything through the Hub backend, which already
scrubs its errors; here the bucket is a local folder whose failures carry the token
raw (as a third-party backend, a proxy or a future bug could), so only the panels'
:func:`~rlsync.spaces.snapshots.redact` stands between the token and the page or the
logs. Every log record of a short run is captured, from every logger, and scanned.
"""

from __future__ import annotations

import json
import logging
import traceback
import types

import pytest

from rlsync.roles import Role
from rlsync.bucket import LocalBucket
from rlsync.errors import BucketError
from rlsync.layout import POINTER_KEY
from rlsync.protocol import FixedInterval, Publisher, Subscriber
from rlsync.spaces import role_control, snapshots
from tests.helpers import master_state, rl_step

TOKEN = "hf_RedactionTestToken0123456789abcdef"
OTHER_TOKEN = "hf_SecondVariableToken9876543210"


@pytest.fixture(autouse=True)
def token(monkeypatch) -> str:
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HUGGING_FACE_HUB_TOKEN", OTHER_TOKEN)
    return TOKEN


class LeakyBucket(LocalBucket):
    """A local bucket whose failing operations raise errors with the token in them, unscrubbed."""

    def __init__(self, root, failing: set[str] | None = None) -> None:
        super().__init__(root)
        self.failing = set(failing or ())
        self.raised = 0

    def _maybe_fail(self, op: str) -> None:
        if op in self.failing:
            self.raised += 1
            raise BucketError(f"{op} failed: 401 Unauthorized, Authorization: Bearer {TOKEN} (or {OTHER_TOKEN})")

    def get(self, key):
        self._maybe_fail("get")
        return super().get(key)

    def list(self, prefix=""):
        self._maybe_fail("list")
        return super().list(prefix)


def shows_no_token(text: str) -> bool:
    return TOKEN not in text and OTHER_TOKEN not in text


# -- redact() -----------------------------------------------------------------------------------


def test_redact_replaces_every_occurrence_of_either_token() -> None:
    text = f"a {TOKEN} b {OTHER_TOKEN} c {TOKEN}"
    assert snapshots.redact(text) == "a *** b *** c ***"
    assert snapshots.redact("nothing secret here") == "nothing secret here"


def test_redact_leaves_text_alone_without_a_token(monkeypatch) -> None:
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN")
    assert snapshots.redact(f"x {TOKEN} y") == f"x {TOKEN} y"
    monkeypatch.setenv("HF_TOKEN", "ab")  # too short to be a token: redacting it would garble every text
    assert snapshots.redact("abc ab") == "abc ab"


# -- what the panels show -----------------------------------------------------------------------


def test_read_snapshot_error_with_the_token_is_redacted(tmp_path) -> None:
    bucket = LeakyBucket(tmp_path / "b", failing={"list"})
    snap = snapshots.read_snapshot(bucket)
    assert bucket.raised == 1
    assert snap.error.startswith("bucket read failed: list failed: 401") and "***" in snap.error
    assert shows_no_token(snap.error)


def test_read_snapshot_of_an_invalid_pointer_naming_the_token_is_redacted(tmp_path) -> None:
    bucket = LocalBucket(tmp_path / "b")
    Publisher(bucket).publish(0, master_state())
    doc = json.loads(bucket.get(POINTER_KEY))
    doc["anchors"][0]["files"][0]["key"] = f"../{TOKEN}"
    bucket.put(POINTER_KEY, json.dumps(doc).encode())
    snap = snapshots.read_snapshot(bucket)
    assert snap.manifest is None and snap.error.startswith("invalid latest.json") and "***" in snap.error
    assert shows_no_token(snap.error)


def test_bucket_view_that_cannot_open_its_bucket_shows_a_redacted_error(monkeypatch, tmp_path) -> None:
    def refuse(url, **_options):
        raise BucketError(f"cannot reach {url} with token {TOKEN}")

    monkeypatch.setattr(snapshots, "open_bucket", refuse)
    snap = snapshots.BucketView(str(tmp_path / "b")).snapshot()
    assert snap.error.startswith("cannot open the bucket") and "cannot reach" in snap.error and "***" in snap.error
    assert shows_no_token(snap.error)


def test_role_runner_status_of_a_failed_start_is_redacted() -> None:
    def build(config):
        raise RuntimeError(f"Space start refused for Bearer {TOKEN}")

    runner = role_control.RoleRunner(Role.TRAINER, build)
    line = runner.start(types.SimpleNamespace(), wait=True)
    assert runner.state == "failed"
    for text in (line, runner.status(), runner.error):
        assert "RuntimeError: Space start refused for Bearer ***" in text and shows_no_token(text)


# -- every log record of a run ----------------------------------------------------------------


@pytest.fixture
def every_record(monkeypatch) -> list[logging.LogRecord]:
    """Every record any logger handles at DEBUG and above, whatever its handlers or propagation."""
    records: list[logging.LogRecord] = []
    original = logging.Logger.handle

    def handle(self, record):
        records.append(record)
        return original(self, record)

    monkeypatch.setattr(logging.Logger, "handle", handle)
    root = logging.getLogger()
    monkeypatch.setattr(root, "level", logging.DEBUG)
    for name in ("rlsync", "rollout_space", "trainer_space", "env_space"):
        monkeypatch.setattr(logging.getLogger(name), "level", logging.NOTSET)
    return records


def record_text(record: logging.LogRecord) -> str:
    text = record.getMessage() + (record.stack_info or "")
    if record.exc_info:
        text += "".join(traceback.format_exception(*record.exc_info))
    return text


def test_no_log_record_of_a_panel_run_carries_the_token(tmp_path, every_record) -> None:
    """Publish and follow a few versions, then the panels read a bucket whose reads fail with the token,
    a view cannot open its bucket, and a role fails to start: every record is scanned."""
    bucket = LeakyBucket(tmp_path / "b")
    master = master_state()
    pub, sub = Publisher(bucket, policy=FixedInterval(2)), Subscriber(bucket)
    for step in range(3):
        if step:
            rl_step(master, step)
        pub.publish(step, master)
        sub.sync()
    assert not snapshots.read_snapshot(bucket).error
    bucket.failing = {"list"}
    assert snapshots.read_snapshot(bucket).error

    def open_leaky(url):
        return LeakyBucket(tmp_path / "b", failing={"list"})

    view = snapshots.BucketView(str(tmp_path / "b"))
    view._bucket = open_leaky(view.url)
    assert view.snapshot().error
    runner = role_control.RoleRunner(Role.ENV, lambda config: open_leaky("x").list("tasks/"))
    runner.start(types.SimpleNamespace(), wait=True)
    assert runner.state == "failed"

    texts = [record_text(r) for r in every_record]
    assert sum("failed" in t for t in texts) >= 3  # the failures were logged: the scan saw them
    assert {"rlsync.spaces.snapshots", "rlsync.spaces.role_control"} <= {r.name for r in every_record}
    leaking = [t for t in texts if not shows_no_token(t)]
    assert not leaking, leaking[:3]


def test_a_failing_panel_render_is_logged_without_the_token(tmp_path, every_record) -> None:
    """A figure whose render raises an error naming the token: the panel logs the failure, redacted."""
    import gradio as gr

    from rlsync.spaces.live import Live

    def broken(view, snap):
        raise BucketError(f"render failed: Authorization: Bearer {TOKEN}")

    with gr.Blocks():
        live = Live(str(tmp_path / "b"), timer=gr.Timer(60))
        live.add(gr.Markdown(), broken)
    assert len(live.values()) == 1
    texts = [record_text(r) for r in every_record if r.name == "rlsync.spaces.live"]
    assert any("render failed" in t for t in texts) and all(shows_no_token(t) for t in texts)
