"""Xet tokens reused until shortly before they expire (``rlsync.bucket.hf_xet_grants``): one token
request per kind for a role's transfers, counted by the Hub stand-in itself; expired and refused tokens
fetched again once; the seam changes nothing outside a bucket transfer.

Real huggingface_hub + hf_xet against ``testing/hub/server.py``, like ``test_bucket_hf.py``.
"""

from __future__ import annotations

import threading
import time

import pytest

from rlsync.bucket.budget import BudgetConfig, RequestClass, RequestMeter
from rlsync.bucket.hf import HfBucket
from rlsync.bucket.hf_xet_grants import REFRESH_BEFORE_S, XetGrants
from rlsync.errors import BucketError, TransientBucketError
from testing.hub.faults import Fault

TOKEN = "hf_REUSEtoken0123456789abcdefXYZ"
BUCKET = "someone/reuse"


@pytest.fixture
def server(hub):
    hub.add_token(TOKEN, "write")
    hub.create_bucket(BUCKET)
    return hub


def bucket(prefix: str = "") -> HfBucket:
    return HfBucket(BUCKET, prefix=prefix, token=TOKEN, meter=RequestMeter(BudgetConfig(enabled=False)))


def token_requests(server, kind: str) -> int:
    """Requests for a Xet `kind` token, from the stand-in's own log of counted requests."""
    return sum(1 for r in server.usage(RequestClass.API, TOKEN) if r.path.endswith(f"/xet-{kind}-token"))


def test_a_roles_downloads_and_uploads_cost_one_token_request_per_kind(server, tmp_path):
    meters = [RequestMeter(BudgetConfig(enabled=False)) for _ in range(2)]
    a, b = (HfBucket(BUCKET, prefix=p, token=TOKEN, meter=m) for p, m in zip(("a", "b"), meters))
    payloads = {f"k{i}": bytes([i]) * (50_000 + i) for i in range(4)}
    for i, (key, data) in enumerate(payloads.items()):  # 4 uploads, two buckets of the role
        (a if i % 2 else b).put(key, data)
    src = tmp_path / "src.bin"
    src.write_bytes(b"\x09" * 120_000)
    a.put_file("file.bin", src)  # and a fifth
    b.put("shared", b"\x07" * 80_000)
    barrier = threading.Barrier(8)
    got: list[bytes] = []
    errors: list[BaseException] = []

    def read() -> None:  # 8 downloads at once: one token fetch for all of them
        try:
            barrier.wait()
            got.append(b.get("shared"))
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=read) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and got == [b"\x07" * 80_000] * 8
    for i, (key, data) in enumerate(payloads.items()):  # and 6 more, one by one, through both buckets
        assert (a if i % 2 else b).get(key) == data
    a.get_file("file.bin", tmp_path / "out.bin")
    assert (tmp_path / "out.bin").read_bytes() == src.read_bytes()
    assert a.get_limited("file.bin", 1 << 20) == src.read_bytes()
    assert token_requests(server, "write") == 1 and token_requests(server, "read") == 1  # 6 uploads, 14 downloads
    assert server.count("token") == 2
    counted = sum(m.snapshot()["by_kind"].get(f"GET xet-{kind}-token", 0) for m in meters for kind in ("read", "write"))
    assert counted == 2  # the role's own count agrees: nothing bypasses the meter
    api = sum(m.snapshot()["api"] - m.snapshot()["by_kind"].get("GET agent-registry", 0) for m in meters)
    assert api == len(server.usage(RequestClass.API, TOKEN))


def test_an_expiring_token_is_fetched_again_and_the_transfer_succeeds(server):
    server.xet_token_ttl = REFRESH_BEFORE_S + 2  # reusable for 2 s
    hub = bucket()
    hub.put("a", b"\x01" * 10_000)
    hub.put("b", b"\x02" * 10_000)
    assert token_requests(server, "write") == 1
    time.sleep(2.5)  # now less than REFRESH_BEFORE_S is left: fetched again before the next transfer
    hub.put("c", b"\x03" * 10_000)
    assert token_requests(server, "write") == 2
    server.xet_token_ttl = REFRESH_BEFORE_S / 2  # valid, but too short-lived to keep: one fetch per transfer
    for key, byte in (("a", 1), ("b", 2), ("c", 3)):
        assert hub.get(key) == bytes([byte]) * 10_000
    assert token_requests(server, "read") == 3


@pytest.mark.parametrize("status", [401, 403])
def test_a_token_xet_storage_refuses_is_replaced_once_and_the_transfer_succeeds(server, status):
    hub = bucket()
    server.inject("storage", Fault(status))  # the grant handed out next is refused by Xet storage
    hub.put("k", b"\x05" * 20_000)  # no retry layer: the one call fetches a new token and succeeds
    assert token_requests(server, "write") == 2
    server.inject("storage", Fault(status))
    assert hub.get("k") == b"\x05" * 20_000
    assert hub.get("k") == b"\x05" * 20_000  # the replacement is reused
    assert token_requests(server, "read") == 2 and token_requests(server, "write") == 2


def test_a_token_refused_twice_is_a_permission_error_after_two_token_requests(server):
    hub = bucket()
    hub.put("k", b"\x05" * 1000)
    server.inject("storage", Fault(403), Fault(403))
    with pytest.raises(BucketError, match="permission denied") as info:
        hub.get("k")
    assert not isinstance(info.value, TransientBucketError)
    assert token_requests(server, "read") == 2  # replaced once, not again and again
    assert hub.get("k") == b"\x05" * 1000  # the refused token was dropped: the next call fetches a good one
    assert token_requests(server, "read") == 3


def test_a_failed_transfer_drops_its_token_and_a_good_one_keeps_it(server):
    hub = bucket()
    hub.put("a", b"\x06" * 30_000)
    server.inject("api", Fault(503, path="/batch$"))  # the bytes are in Xet storage, the commit fails
    with pytest.raises(TransientBucketError):
        hub.put("b", b"\x07" * 30_000)
    hub.put("b", b"\x07" * 30_000)
    hub.put("c", b"\x08" * 30_000)
    assert token_requests(server, "write") == 2  # one more after the failure, then reused again
    assert hub.get("b") == b"\x07" * 30_000


def test_outside_a_bucket_transfer_huggingface_hub_gets_its_own_session(server):
    from huggingface_hub.utils import _xet

    from rlsync.bucket.hf_xet_grants import seeding

    real = _xet._GLOBAL_XET_HOLDER.get()
    with seeding():
        wrapped = _xet.get_xet_session()
    assert wrapped is not real and wrapped.status() == real.status()  # a bucket transfer: seeded, same session
    assert _xet.get_xet_session() is real  # other code in the process: unchanged
    done = threading.Event()
    with seeding():  # another thread's transfer does not see this thread's block
        threading.Thread(target=lambda: (_xet.get_xet_session() is real) and done.set()).start()
        assert done.wait(5)


def test_grants_are_shared_by_threads_and_fetched_again_near_expiry():
    now = [1_000.0]
    fetched: list[str] = []

    def fetch(url: str, headers: dict[str, str]) -> dict:
        fetched.append(url)
        time.sleep(0.05)  # the others ask meanwhile
        return {"accessToken": f"t{len(fetched)}", "exp": int(now[0]) + 3600, "casUrl": "https://cas"}

    grants = XetGrants(fetch, clock=lambda: now[0])
    url, headers = "https://hub/api/buckets/a/b/xet-read-token", {"authorization": "Bearer x"}
    seen = []
    threads = [threading.Thread(target=lambda: seen.append(grants.get(url, headers))) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(fetched) == 1 and {g.token for g in seen} == {"t1"}
    grants.get(url, {"Authorization": "Bearer other"})  # another Hub token: its own grant
    grants.get(url.replace("read", "write"), headers)  # another kind: its own grant
    assert len(fetched) == 3
    now[0] += 3600 - REFRESH_BEFORE_S - 1
    assert grants.get(url, headers).token == "t1" and len(fetched) == 3
    now[0] += 2
    fresh = grants.get(url, headers)
    assert fresh.token == "t4" and len(fetched) == 4
    grants.drop([seen[0]])  # an older grant's failure does not drop the newer one
    assert grants.get(url, headers) is fresh and len(fetched) == 4
    grants.drop([fresh])
    assert grants.get(url, headers).token == "t5"
    assert "t5" not in repr(grants.get(url, headers))


def test_a_malformed_token_answer_is_a_bucket_error(server):
    hub = bucket()
    server.inject("token", Fault(200, message="not a grant"))
    with pytest.raises(BucketError, match="put 'k'.*no accessToken") as info:
        hub.put("k", b"x")
    assert not isinstance(info.value, TransientBucketError)


def test_a_huggingface_hub_without_the_session_hook_keeps_transfers_working_and_says_so(monkeypatch, caplog):
    from huggingface_hub.utils import _xet

    import rlsync.bucket.hf_xet_grants as grants

    monkeypatch.setattr(grants, "_installed", False)
    monkeypatch.delattr(_xet, "get_xet_session")
    with caplog.at_level("WARNING", logger=grants.__name__), grants.seeding() as used:
        assert used == []
    assert "get_xet_session" in caplog.text and grants._installed
