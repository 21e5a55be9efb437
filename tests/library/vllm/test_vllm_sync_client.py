"""BucketSyncClient (drives ``vllm serve --weight-transfer-config '{"backend": "bucket"}'``) against a
stand-in for vLLM's dev-mode HTTP routes: the order of the calls, and vLLM's answers honoured."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed")

from rlsync.vllm.transfer import BucketSyncClient  # noqa: E402
from rlsync.bucket import LocalBucket  # noqa: E402
from rlsync.protocol import Publisher  # noqa: E402


class FakeVllm:
    """Records the routes called; answers like vLLM's dev-mode API server."""

    def __init__(self, state_hash: str, reset_success: bool = True) -> None:
        self.calls: list[str] = []
        self.state_hash = state_hash
        self.reset_success = reset_success
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                route = self.path.split("?")[0]
                fake.calls.append(route)
                body = {}
                if route == "/reset_prefix_cache":
                    body = {"success": fake.reset_success}
                elif route == "/collective_rpc":
                    body = {"results": [fake.state_hash]}
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


def test_sync_verifies_the_hash_before_resuming(published):
    bucket, state_hash = published
    vllm = FakeVllm(state_hash)
    try:
        client = BucketSyncClient(vllm.url, bucket.url)
        assert client.sync() == 0
    finally:
        vllm.close()
    assert vllm.calls == [
        "/init_weight_transfer_engine", "/pause", "/start_weight_update", "/update_weights",
        "/finish_weight_update", "/reset_prefix_cache", "/collective_rpc", "/resume",
    ]  # fmt: skip


def test_refused_prefix_cache_reset_fails_the_sync_and_still_resumes(published):
    bucket, state_hash = published
    vllm = FakeVllm(state_hash, reset_success=False)
    try:
        client = BucketSyncClient(vllm.url, bucket.url, reset_attempts=2)
        with pytest.raises(RuntimeError, match="prefix cache"):
            client.sync()
    finally:
        vllm.close()
    assert vllm.calls.count("/reset_prefix_cache") == 2
    assert "/collective_rpc" not in vllm.calls and vllm.calls[-1] == "/resume"


def test_hash_mismatch_is_reported(published):
    bucket, _ = published
    vllm = FakeVllm("not-the-hash")
    try:
        with pytest.raises(RuntimeError, match="do not hash equal"):
            BucketSyncClient(vllm.url, bucket.url).sync()
    finally:
        vllm.close()
    assert vllm.calls[-1] == "/resume"


class NoExtensionVllm(FakeVllm):
    """A server started without ``--worker-extension-cls``: vLLM's worker raises
    ``AttributeError: sync_state_hash`` and the connection is reset without an answer."""

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


def test_verify_without_the_worker_extension_says_what_is_missing(published):
    bucket, state_hash = published
    vllm = NoExtensionVllm(state_hash)
    try:
        with pytest.raises(RuntimeError, match="--worker-extension-cls rlsync.vllm.worker.SyncWorkerExtension"):
            BucketSyncClient(vllm.url, bucket.url).sync()
    finally:
        vllm.close()
    assert vllm.calls[-2:] == ["/collective_rpc", "/resume"]
