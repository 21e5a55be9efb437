"""The Hub stand-in's Xet storage (``testing/hub/cas.py``, ``xet_storage.py``, ``xet_formats.py``): served over HTTP
by the stand-in alone, so separate processes share one bucket through the real huggingface_hub + hf_xet client (with
xet-core's ``local://`` store each process opened one database, which one process at a time may hold); byte ranges
of a file made of several xorbs' chunks read exactly; what the Hub's storage refuses, it refuses.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from rlsync.bucket.budget import BudgetConfig, RequestMeter
from rlsync.bucket.hf import HfBucket

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "hf_XETstorageTOKEN0123456789abcdef"
BUCKET = "someone/xet"
PROCESSES = 3
OBJECTS = 3

#: One writer and reader of the bucket, in a process of its own: it waits for the file ``go``, writes its objects,
#: then reads every process's objects (polling each until it is there) and checks them byte for byte.
WORKER = """
import random, sys, time
from pathlib import Path
from huggingface_hub import HfApi
from rlsync.bucket.budget import BudgetConfig, RequestMeter
from rlsync.bucket.hf import HfBucket
from rlsync.errors import ObjectNotFoundError
url, token, bucket_id, me, processes, objects, go = sys.argv[1:]
me, processes, objects = int(me), int(processes), int(objects)
api, meter = HfApi(endpoint=url, token=token), RequestMeter(BudgetConfig(enabled=False))
bucket = HfBucket(bucket_id, token=token, api=api, meter=meter)
common = random.Random(0).randbytes(200_000)
def payload(who, k):
    return common + random.Random(f"{who}/{k}").randbytes(100_000 + 30_000 * k)
while not Path(go).exists():
    time.sleep(0.05)
for k in range(objects):
    bucket.put(f"p{me}/{k}", payload(me, k))
for who in range(processes):
    for k in range(objects):
        deadline = time.monotonic() + 120
        while True:
            try:
                assert bucket.get(f"p{who}/{k}") == payload(who, k), (who, k)
                break
            except ObjectNotFoundError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
print("read", processes * objects, "objects")
"""


@pytest.fixture
def server(hub):
    hub.add_token(TOKEN, "write")
    hub.create_bucket(BUCKET)
    return hub


def bucket() -> HfBucket:
    return HfBucket(BUCKET, token=TOKEN, meter=RequestMeter(BudgetConfig(enabled=False)))


def grant(server, kind: str = "write") -> dict:
    """A Xet token from the stand-in's token endpoint: ``{"accessToken", "exp", "casUrl"}``."""
    request = urllib.request.Request(f"{server.url}/api/buckets/{BUCKET}/xet-{kind}-token",
                                     headers={"Authorization": f"Bearer {TOKEN}"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def call(url: str, token: str | None = None, body: bytes | None = None, headers: dict | None = None
         ) -> tuple[int, bytes]:  # fmt: skip
    """``(status, body)`` of one request to Xet storage."""
    headers = {**(headers or {}), **({"Authorization": f"Bearer {token}"} if token else {})}
    request = urllib.request.Request(url, data=body, headers=headers, method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def test_three_processes_write_and_read_one_bucket_at_once_bit_exactly(server, tmp_path):
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "shared"), str(ROOT)]), "HF_ENDPOINT": server.url,
           "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}  # fmt: skip
    args = [server.url, TOKEN, BUCKET]
    logs = [tmp_path / f"worker{i}.log" for i in range(PROCESSES)]
    workers = [subprocess.Popen([sys.executable, "-c", WORKER, *args, str(i), str(PROCESSES), str(OBJECTS), str(go)],
                                cwd=ROOT, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
               for i, log in enumerate(logs)]  # fmt: skip
    try:
        go.touch()  # all at once
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:  # until all are done, or one failed
            codes = [w.poll() for w in workers]
            if None not in codes or any(codes):
                break
            time.sleep(0.2)
    finally:
        for w in workers:
            w.kill()
            w.wait()
    for worker, log in zip(workers, logs):
        output = log.read_text(errors="replace")
        assert worker.returncode == 0 and f"read {PROCESSES * OBJECTS} objects" in output, output[-3000:]
    common = random.Random(0).randbytes(200_000)
    here = bucket()
    for who in range(PROCESSES):  # and this process reads what they wrote, whole-object hashes equal
        for k in range(OBJECTS):
            expected = common + random.Random(f"{who}/{k}").randbytes(100_000 + 30_000 * k)
            assert hashlib.sha256(here.get(f"p{who}/{k}")).hexdigest() == hashlib.sha256(expected).hexdigest()


def test_byte_ranges_of_a_file_made_of_several_xorbs_read_exactly(server):
    from hf_xet import XetFileInfo
    from huggingface_hub.utils import _xet

    rng = random.Random(1)
    first = rng.randbytes(700_000)
    second = first[:300_000] + rng.randbytes(250_000) + first[300_000:]  # deduplicated against `first`'s chunks
    writer = bucket()
    writer.put("first", first)
    writer.put("second", second)
    file_hash = server.buckets[BUCKET]["second"]["xetHash"]
    terms = server.xet.reconstruction(file_hash).terms
    assert len({t.xorb for t in terms}) == 2 and len(terms) >= 3  # chunks of both uploads' xorbs
    access = grant(server, "read")
    with _xet.get_xet_session().new_download_stream_group(
        endpoint=access["casUrl"], token=access["accessToken"], token_expiry_unix_secs=access["exp"]
    ) as group:
        info = XetFileInfo(file_hash, len(second))
        size = len(second)
        for start, end in [(0, size), (1, 2), (299_999, 300_001), (123_457, 612_345), (size - 5, size)]:
            assert b"".join(group.download_stream(info, start=start, end=end)) == second[start:end], (start, end)


def _xorb(chunks: list[bytes]) -> bytes:
    """A xorb of uncompressed chunks (no footer: the stand-in reads chunk headers only)."""
    return b"".join(bytes([0]) + len(c).to_bytes(3, "little") + bytes([0]) + len(c).to_bytes(3, "little") + c
                    for c in chunks)  # fmt: skip


def _shard(file_hash: bytes, terms: list[tuple[bytes, int, int, int]]) -> bytes:
    """A shard recording one file of `terms` (xorb hash, first chunk, end chunk, unpacked bytes)."""
    from testing.hub.xet_formats import BOOKEND, SHARD_TAG

    header = SHARD_TAG + struct.pack("<QQ", 2, 0)
    record = file_hash + struct.pack("<IIQ", 0, len(terms), 0)
    record += b"".join(xorb + struct.pack("<IIII", 0, length, a, b) for xorb, a, b, length in terms)
    return header + record + BOOKEND + bytes(16)


def test_xet_storage_refuses_what_the_hubs_refuses_and_serves_both_reconstruction_versions(server):
    from testing.hub.xet_formats import hash_hex

    access, reader = grant(server), grant(server, "read")
    cas, token = access["casUrl"], access["accessToken"]
    xorb_raw, file_raw = bytes(range(32)), bytes(range(32, 64))
    xorb, file_hash = hash_hex(xorb_raw), hash_hex(file_raw)
    chunks = [b"a" * 1000, b"b" * 2000, b"c" * 3000]
    assert call(f"{cas}/v1/xorbs/default/{xorb}", None, _xorb(chunks))[0] == 401  # no token
    assert call(f"{cas}/v1/xorbs/default/{xorb}", "xet-write-forged", _xorb(chunks))[0] == 401
    assert call(f"{cas}/v1/xorbs/default/{xorb}", reader["accessToken"], _xorb(chunks))[0] == 403
    assert call(f"{cas}/v1/xorbs/default/{xorb}", token, b"\x07" * 20)[0] == 400  # not a xorb
    assert call(f"{cas}/v1/xorbs/default/{xorb}", token, _xorb(chunks)[:-1])[0] == 400  # truncated
    assert call(f"{cas}/v1/xorbs/default/{xorb}", token, _xorb(chunks)) == (200, b'{"was_inserted": true}')
    assert call(f"{cas}/v1/xorbs/default/{xorb}", token, _xorb(chunks)) == (200, b'{"was_inserted": false}')
    assert call(f"{cas}/v1/shards", token, _shard(file_raw, [(bytes(32), 0, 1, 1000)]))[0] == 400  # unknown xorb
    assert call(f"{cas}/v1/shards", token, _shard(file_raw, [(xorb_raw, 0, 4, 6000)]))[0] == 400  # past its chunks
    assert call(f"{cas}/v1/shards", token, _shard(file_raw, [(xorb_raw, 0, 2, 2999)]))[0] == 400  # wrong length
    assert call(f"{cas}/v1/shards", token, _shard(file_raw, [(xorb_raw, 1, 3, 5000), (xorb_raw, 0, 2, 3000)]))[0] == 200
    assert server.xet.file_size(file_hash) == 8000
    wanted = {"Range": "bytes=1500-5499"}  # from within the first term's first chunk into the second term's first
    v1 = json.loads(call(f"{cas}/v1/reconstructions/{file_hash}", reader["accessToken"], headers=wanted)[1])
    v2 = json.loads(call(f"{cas}/v2/reconstructions/{file_hash}", reader["accessToken"], headers=wanted)[1])
    terms = [{"hash": xorb, "unpacked_length": 5000, "range": {"start": 1, "end": 3}},
             {"hash": xorb, "unpacked_length": 1000, "range": {"start": 0, "end": 1}}]  # the second cut to one chunk
    assert v1["terms"] == v2["terms"] == terms
    assert v1["offset_into_first_range"] == v2["offset_into_first_range"] == 1500
    (fetch,) = v1["fetch_info"][xorb]  # chunks [0, 1) and [1, 3) merged into one fetch, as the Hub merges them
    assert fetch["range"] == {"start": 0, "end": 3} and fetch["url_range"] == {"start": 0, "end": 6023}
    ranges = [{"chunks": fetch["range"], "bytes": fetch["url_range"]}]
    assert v2["xorbs"][xorb] == [{"url": fetch["url"], "ranges": ranges}]
    status, data = call(fetch["url"], headers={"Range": "bytes=1008-3015"})  # presigned: no token
    assert status == 206 and data == _xorb([b"b" * 2000])  # chunk 1, its header included
    assert call(fetch["url"], headers={"Range": f"bytes=6000-{1 << 62}"}) == (206, b"c" * 24)  # to its end, no further
    assert call(fetch["url"], headers={"Range": "bytes=6024-6030"})[0] == 416
    assert call(fetch["url"], headers={"Range": "bytes=5-1"})[0] == 400
    assert call(f"{cas}/v2/reconstructions/{file_hash}", token, headers={"Range": "bytes=8000-8100"})[0] == 416
    assert call(f"{cas}/v2/reconstructions/{hash_hex(bytes(32))}", token)[0] == 404
    server.xet_token_ttl = 0
    assert call(f"{cas}/v2/reconstructions/{file_hash}", grant(server)["accessToken"])[0] == 401  # expired
    server.reset()  # a reset stand-in is a new endpoint to hf_xet (whose caches are per endpoint): the old one is gone
    server.add_token(TOKEN, "write")
    server.create_bucket(BUCKET)
    assert grant(server)["casUrl"] != cas and call(f"{cas}/v2/reconstructions/{file_hash}", token)[0] == 404
