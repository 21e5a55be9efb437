"""BucketSyncClient (drives ``vllm serve --weight-transfer-config '{"backend": "bucket"}'``) against a
stand-in for vLLM's dev-mode HTTP routes and the worker extension's ``sync_*`` methods: the order of the
calls (prepare before the pause, the re-hash after it), and vLLM's and the workers' answers honoured."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed")

from rlsync.vllm.client import BucketSyncClient, PauseMode  # noqa: E402
from rlsync.vllm.status import Prepared, Rehash, TransferStatus  # noqa: E402
from rlsync.vllm.versions import completion_versions  # noqa: E402
from rlsync.bucket import LocalBucket  # noqa: E402
from rlsync.protocol import Publisher  # noqa: E402


class FakeVllm:
    """Records the routes called (``collective_rpc`` as ``rpc:METHOD``); answers like vLLM's dev-mode API
    server whose workers run the bucket backend: a prepare is ready at the second status poll, a
    re-hash at the first."""

    def __init__(self, state_hash: str, reset_success: bool = True, served_hash: str | None = None, error: str = "") -> None:
        self.calls: list[str] = []
        self.queries: dict[str, str] = {}  # route -> its last query string
        self.reset_success = reset_success
        self.status = {
            "step": None, "state_hash": None, "preparing": False, "error": "", "prepared": None,
            "rehashing": False, "rehash": None, "rehash_error": "",
        }  # fmt: skip
        fake = self

        def rpc(method: str, args: list) -> dict:
            status = fake.status
            if method == "sync_prepare":
                status.update(preparing=True, polls=0)
            elif method == "sync_transfer_status" and status["preparing"]:
                status["polls"] += 1
                if status["polls"] == 2:
                    ready = status["step"] is None  # one update: step 0
                    prepared = Prepared(0, "anchor", state_hash) if ready and not error else None
                    status.update(preparing=False, error=error, prepared=prepared)
            elif method == "sync_verify":
                status.update(rehash=Rehash(status["step"], status["state_hash"], served_hash or state_hash))
            return TransferStatus(**{k: v for k, v in status.items() if k != "polls"}).to_wire()  # as a worker sends it

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                route, _, query = self.path.partition("?")
                fake.queries[route] = query
                body = {}
                if route == "/reset_prefix_cache":
                    body = {"success": fake.reset_success}
                elif route == "/update_weights":
                    assert json.loads(raw)["update_info"] == {"step": 0, "prepared_only": True}
                    fake.status.update(step=0, state_hash=state_hash, prepared=None)
                elif route == "/collective_rpc":
                    request = json.loads(raw)
                    route = f"rpc:{request['method']}"
                    body = {"results": [rpc(request["method"], request.get("args", []))]}
                fake.calls.append(route)
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def published(tmp_path):
    bucket = LocalBucket(tmp_path / "bucket")
    record = Publisher(bucket).publish(0, {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)})
    return bucket, record.state_hash


def test_sync_prepares_before_the_pause_and_rehashes_after_it(published):
    bucket, state_hash = published
    vllm = FakeVllm(state_hash)
    try:
        client = BucketSyncClient(vllm.url, bucket.url)
        assert client.sync() == 0
    finally:
        vllm.close()
    assert vllm.calls == [
        "/init_weight_transfer_engine", "rpc:sync_prepare", "rpc:sync_transfer_status", "rpc:sync_transfer_status",
        "/pause", "/start_weight_update", "/update_weights", "/finish_weight_update", "/reset_prefix_cache", "/resume",
        "rpc:sync_transfer_status", "rpc:sync_verify",
    ]  # fmt: skip
    assert len(client.pauses) == 1


@pytest.mark.parametrize(
    ("pause_mode", "pause", "reset"),
    [
        # the default: in-flight requests frozen for the apply; their KV (old weights) dropped with the prefix cache
        (None, "mode=keep", "reset_running_requests=true"),
        (PauseMode.WAIT, "mode=wait", ""),  # the drain: no request in flight, so none holds KV
        ("wait", "mode=wait", ""),
    ],
)
def test_the_pause_keeps_requests_in_flight_by_default_and_waits_for_them_on_request(published, pause_mode, pause, reset):
    bucket, state_hash = published
    vllm = FakeVllm(state_hash)
    try:
        options = {} if pause_mode is None else {"pause_mode": pause_mode}
        client = BucketSyncClient(vllm.url, bucket.url, **options)
        assert client.sync() == 0
    finally:
        vllm.close()
    assert vllm.queries["/pause"] == pause and vllm.queries["/reset_prefix_cache"] == reset
    assert client.pause_mode is PauseMode(pause.removeprefix("mode="))


def test_a_completion_spanning_an_update_gives_its_first_and_last_version():
    spans = [{"version": "3", "start": 0, "end": 40}, {"version": "4", "start": 40, "end": 128}]
    versions = completion_versions(spans)
    assert (versions.first, versions.last, versions.spans_update) == (3, 4, True)
    one = completion_versions(spans[1:])
    assert (one.first, one.last, one.spans_update) == (4, 4, False)
    for hostile in (None, [], ["3"], [{"version": "default"}], [{"version": 3}], [{"version": "-1"}], [{"version": "9" * 20}],
                    [{"version": "٣"}], spans[::-1]):  # fmt: skip
        with pytest.raises(ValueError):
            completion_versions(hostile)


def _failed_sync(published, match: str, **fake: object) -> list[str]:
    """A sync against a stand-in answering with ``fake``: raises ``RuntimeError`` matching ``match``; returns the calls."""
    bucket, state_hash = published
    vllm = FakeVllm(state_hash, **fake)
    try:
        with pytest.raises(RuntimeError, match=match):
            BucketSyncClient(vllm.url, bucket.url, reset_attempts=2).sync()
    finally:
        vllm.close()
    return vllm.calls


def test_an_update_refused_while_preparing_fails_the_sync_without_pausing(published):
    calls = _failed_sync(published, "before pausing.*refused before applying", error="HashMismatchError: delta 1: refused before applying")
    assert "/pause" not in calls and "/update_weights" not in calls


def test_refused_prefix_cache_reset_fails_the_sync_and_still_resumes(published):
    calls = _failed_sync(published, "prefix cache", reset_success=False)
    assert calls.count("/reset_prefix_cache") == 2
    assert "rpc:sync_verify" not in calls and calls[-1] == "/resume"


def test_hash_mismatch_is_reported(published):
    calls = _failed_sync(published, "do not hash equal", served_hash="not-the-hash")
    assert calls[-1] == "rpc:sync_verify"  # after the resume: the re-hash runs while the server generates


class NoExtensionVllm(FakeVllm):
    """A server started without ``--worker-extension-cls``: vLLM's worker raises
    ``AttributeError: sync_prepare`` and the connection is reset without an answer."""

    def __init__(self, state_hash: str) -> None:
        super().__init__(state_hash)
        handler = self.httpd.RequestHandlerClass
        answer = handler.do_POST

        def do_post(request) -> None:
            if request.path.split("?")[0] == "/collective_rpc":
                self.calls.append("/collective_rpc")
                request.rfile.read(int(request.headers.get("Content-Length") or 0))
                request.connection.shutdown(2)  # the "Connection reset by peer" of the real server
                request.close_connection = True
                return
            answer(request)

        handler.do_POST = do_post


def test_a_server_without_the_worker_extension_says_what_is_missing_before_pausing(published):
    bucket, state_hash = published
    vllm = NoExtensionVllm(state_hash)
    try:
        with pytest.raises(RuntimeError, match="--worker-extension-cls rlsync.vllm.worker.SyncWorkerExtension"):
            BucketSyncClient(vllm.url, bucket.url).sync()
    finally:
        vllm.close()
    assert vllm.calls == ["/init_weight_transfer_engine", "/collective_rpc"]  # nothing paused
