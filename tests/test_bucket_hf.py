"""HfBucket against a recording stand-in for ``huggingface_hub.HfApi``.

The Hugging Face Hub cannot be reached from the machines these tests run on (no network except
package registries), so :class:`RecordingHfApi` replaces ``HfApi`` at the network boundary: it keeps
objects in memory, implements the five bucket methods HfBucket uses with the same signatures as
huggingface_hub 2.4.0 (checked by ``test_stand_in_matches_real_hfapi_signatures``) and the same
documented semantics (lexical prefix matching in ``list_bucket_tree``, ``EntryNotFoundError`` from
``download_bucket_files(raise_on_missing_files=True)``, missing paths ignored by
``get_bucket_paths_info``), returns real ``BucketFile``/``BucketFolder`` objects, and records every
call so the tests can check the exact calls and arguments HfBucket makes.

HTTP failures are real huggingface_hub exceptions produced by huggingface_hub's own
``hf_raise_for_status`` from real ``httpx2.Response`` objects (huggingface_hub 2.4 uses ``httpx2``,
not ``requests``), so the error mapping is tested against what the library really raises.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import logging
import os
import subprocess
import sys
import traceback
import warnings
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime
from pathlib import Path
from typing import Any

import httpx2
import pytest
from huggingface_hub import BucketFile, BucketFolder, BucketUrl, HfApi
from huggingface_hub.errors import (
    BucketBatchError,
    BucketNotFoundError,
    EntryNotFoundError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
)
from huggingface_hub.hf_api import _bucket_batch_error
from huggingface_hub.utils import hf_raise_for_status

from shared.bucket import (
    BucketError,
    InvalidKeyError,
    ObjectInfo,
    ObjectNotFoundError,
    TransientBucketError,
    open_bucket,
)
from shared.bucket.hf import HfBucket

TOKEN = "hf_TESTsecretTOKEN0123456789abcdefXYZ"
ENDPOINT = "https://huggingface.co"
BUCKET = "someone/rl-sync"


@dataclasses.dataclass
class Call:
    name: str
    args: tuple
    kwargs: dict[str, Any]


class RecordingHfApi:
    """In-memory stand-in for the bucket part of `HfApi`, recording every call."""

    def __init__(self, token: str | None = None) -> None:
        self.token = token
        self.buckets: dict[str, dict[str, bytes]] = {BUCKET: {}}
        self.calls: list[Call] = []
        self.failures: dict[str, list[BaseException]] = {}

    # helpers
    def fail_next(self, method: str, *errors: BaseException) -> None:
        self.failures.setdefault(method, []).extend(errors)

    def _enter(self, name: str, args: tuple, kwargs: dict[str, Any]) -> None:
        self.calls.append(Call(name, args, kwargs))
        queue = self.failures.get(name)
        if queue:
            raise queue.pop(0)

    def names(self) -> list[str]:
        return [c.name for c in self.calls]

    def _objects(self, bucket_id: str) -> dict[str, bytes]:
        if bucket_id not in self.buckets:
            raise http_error(404, f"{ENDPOINT}/api/buckets/{bucket_id}/paths-info", {"X-Error-Code": "RepoNotFound"})
        return self.buckets[bucket_id]

    @staticmethod
    def _file(path: str, data: bytes) -> BucketFile:
        return BucketFile(type="file", path=path, size=len(data), xetHash=hashlib.sha256(data).hexdigest(), mtime=None)

    # the HfApi methods
    def create_bucket(
        self,
        bucket_id: str,
        *,
        private: bool | None = None,
        visibility: str | None = None,
        resource_group_id: str | None = None,
        region: str | None = None,
        exist_ok: bool = False,
        token: bool | str | None = None,
    ) -> BucketUrl:
        self._enter("create_bucket", (bucket_id,), dict(private=private, visibility=visibility,
                    resource_group_id=resource_group_id, region=region, exist_ok=exist_ok, token=token))
        if bucket_id in self.buckets and not exist_ok:
            raise http_error(409, f"{ENDPOINT}/api/buckets/{bucket_id}")
        self.buckets.setdefault(bucket_id, {})
        return BucketUrl(f"{ENDPOINT}/buckets/{bucket_id}", endpoint=ENDPOINT)

    def batch_bucket_files(
        self,
        bucket_id: str,
        *,
        add: list[tuple[str | Path | bytes, str]] | None = None,
        copy: list[tuple[str, str, str, str]] | None = None,
        delete: list[str] | None = None,
        token: str | bool | None = None,
    ) -> None:
        self._enter("batch_bucket_files", (bucket_id,), dict(add=add, copy=copy, delete=delete, token=token))
        objects = self._objects(bucket_id)
        for source, destination in add or []:
            objects[destination] = source if isinstance(source, bytes) else Path(source).read_bytes()
        for path in delete or []:
            objects.pop(path, None)

    def download_bucket_files(
        self,
        bucket_id: str,
        files: list[tuple[str | BucketFile, str | Path]],
        *,
        raise_on_missing_files: bool = False,
        token: str | bool | None = None,
    ) -> None:
        self._enter("download_bucket_files", (bucket_id, files),
                    dict(raise_on_missing_files=raise_on_missing_files, token=token))
        objects = self._objects(bucket_id)
        missing = [remote for remote, _ in files if remote not in objects]
        if missing and raise_on_missing_files:
            raise EntryNotFoundError(f"{len(missing)} file(s) not found in bucket '{bucket_id}': {', '.join(missing)}")
        for remote, local in files:
            if remote in missing:
                warnings.warn(f"File '{remote}' not found in bucket '{bucket_id}'. Skipping.")
                continue
            Path(local).parent.mkdir(parents=True, exist_ok=True)
            Path(local).write_bytes(objects[remote])

    def list_bucket_tree(
        self,
        bucket_id: str,
        prefix: str | None = None,
        *,
        recursive: bool | None = None,
        token: str | bool | None = None,
    ):
        self._enter("list_bucket_tree", (bucket_id,), dict(prefix=prefix, recursive=recursive, token=token))
        objects = self._objects(bucket_id)
        # Like the Hub: the prefix is matched lexically ("runs/x" also matches "runs/x2/...").
        matching = sorted(path for path in objects if path.startswith(prefix or ""))
        if recursive:
            for path in matching:
                yield self._file(path, objects[path])
            return
        seen = set()
        for path in matching:
            head = path.split("/", 1)[0]
            if "/" in path and head not in seen:
                seen.add(head)
                yield BucketFolder(type="directory", path=head)
            elif "/" not in path:
                yield self._file(path, objects[path])

    def get_bucket_paths_info(self, bucket_id: str, paths, *, token: str | bool | None = None):
        paths = list(paths)
        self._enter("get_bucket_paths_info", (bucket_id, paths), dict(token=token))
        objects = self._objects(bucket_id)
        for path in paths:
            if path in objects:
                yield self._file(path, objects[path])


def http_error(status: int, url: str, headers: dict[str, str] | None = None, body: bytes = b"") -> HfHubHTTPError:
    """The exception huggingface_hub itself raises for this HTTP response."""
    request = httpx2.Request("POST", url, headers={"authorization": f"Bearer {TOKEN}"})
    response = httpx2.Response(status, headers=headers or {}, content=body, request=request)
    try:
        hf_raise_for_status(response)
    except HfHubHTTPError as err:
        return err
    raise AssertionError(f"hf_raise_for_status did not raise for {status}")


@pytest.fixture
def api() -> RecordingHfApi:
    return RecordingHfApi()


@pytest.fixture
def bucket(api, monkeypatch) -> HfBucket:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return HfBucket(BUCKET, prefix="runs/exp1", token=TOKEN, api=api)


# -- the stand-in itself -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "method",
    ["create_bucket", "batch_bucket_files", "download_bucket_files", "list_bucket_tree", "get_bucket_paths_info"],
)
def test_stand_in_matches_real_hfapi_signatures(method):
    real = inspect.signature(getattr(HfApi, method))
    fake = inspect.signature(getattr(RecordingHfApi, method))
    assert [(p.name, p.kind) for p in fake.parameters.values()] == [
        (p.name, p.kind) for p in real.parameters.values()
    ]


def test_package_import_does_not_import_huggingface_hub():
    code = (
        "import sys, shared.bucket as b\n"
        "assert 'huggingface_hub' not in sys.modules\n"
        "b.HfBucket\n"
        "assert 'huggingface_hub' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


# -- calls and arguments -------------------------------------------------------------------------------


def test_put_calls_batch_bucket_files_with_prefixed_path(bucket, api):
    bucket.put("anchors/000010.safetensors", b"weights")
    assert api.calls == [
        Call("batch_bucket_files", (BUCKET,),
             dict(add=[(b"weights", "runs/exp1/anchors/000010.safetensors")], copy=None, delete=None, token=TOKEN))
    ]
    assert api.buckets[BUCKET] == {"runs/exp1/anchors/000010.safetensors": b"weights"}


def test_put_accepts_bytes_like(bucket, api):
    bucket.put("k", bytearray(b"abc"))
    assert api.calls[0].kwargs["add"] == [(b"abc", "runs/exp1/k")]
    assert type(api.calls[0].kwargs["add"][0][0]) is bytes  # huggingface_hub tells bytes from paths by type


def test_put_file_uploads_the_path_not_the_bytes(bucket, api, tmp_path):
    src = tmp_path / "big.bin"
    src.write_bytes(b"0123456789")
    bucket.put_file("deltas/000011", src)
    assert api.calls == [
        Call(
            "batch_bucket_files",
            (BUCKET,),
            dict(add=[(str(src), "runs/exp1/deltas/000011")], copy=None, delete=None, token=TOKEN),
        )
    ]
    assert api.buckets[BUCKET]["runs/exp1/deltas/000011"] == b"0123456789"


def test_get_downloads_to_a_temporary_file_and_cleans_up(bucket, api):
    api.buckets[BUCKET]["runs/exp1/obj"] = b"payload"
    assert bucket.get("obj") == b"payload"
    [call] = api.calls
    assert call.name == "download_bucket_files"
    assert call.kwargs == dict(raise_on_missing_files=True, token=TOKEN)
    bucket_id, [(remote, local)] = call.args
    assert (bucket_id, remote) == (BUCKET, "runs/exp1/obj")
    assert not Path(local).exists() and not Path(local).parent.exists()  # temporary download removed


def test_get_file_downloads_through_part_file(bucket, api, tmp_path):
    api.buckets[BUCKET]["runs/exp1/obj"] = b"payload"
    out = tmp_path / "out.bin"
    bucket.get_file("obj", out)
    assert out.read_bytes() == b"payload"
    [(_, local)] = api.calls[0].args[1]
    assert local == f"{out}.part"
    assert not Path(local).exists()


def test_get_missing_maps_entry_not_found_to_object_not_found(bucket, api, tmp_path):
    with pytest.raises(ObjectNotFoundError, match="'missing'") as info:
        bucket.get("missing")
    assert isinstance(info.value.__cause__, EntryNotFoundError)
    out = tmp_path / "out"
    with pytest.raises(ObjectNotFoundError):
        bucket.get_file("missing", out)
    assert not out.exists() and not Path(f"{out}.part").exists()


def test_list_strips_prefix_sorts_and_skips_foreign_paths(bucket, api):
    api.buckets[BUCKET].update(
        {
            "runs/exp1/deltas/000012": b"12",
            "runs/exp1/anchors/000010": b"1",
            "runs/exp1/deltas/000011": b"111",
            "runs/exp10/anchors/000001": b"other run, lexically matched by the server",
            "runs/exp1/bad name.txt": b"not a valid key",
            "elsewhere": b"x",
        }
    )
    assert bucket.list() == [
        ObjectInfo("anchors/000010", 1),
        ObjectInfo("deltas/000011", 3),
        ObjectInfo("deltas/000012", 2),
    ]
    assert api.calls[-1] == Call("list_bucket_tree", (BUCKET,), dict(prefix="runs/exp1/", recursive=True, token=TOKEN))

    assert [o.key for o in bucket.list("deltas/")] == ["deltas/000011", "deltas/000012"]
    assert api.calls[-1].kwargs["prefix"] == "runs/exp1/deltas/"


def test_list_without_prefix_lists_whole_bucket(api, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    bucket = HfBucket(BUCKET, token=TOKEN, api=api)
    api.buckets[BUCKET].update({"b": b"22", "a/x": b"1"})
    assert bucket.list() == [ObjectInfo("a/x", 1), ObjectInfo("b", 2)]
    assert api.calls[-1].kwargs == dict(prefix=None, recursive=True, token=TOKEN)
    bucket.put("c", b"3")
    assert api.calls[-1].kwargs["add"] == [(b"3", "c")]


def test_list_ignores_folder_entries(bucket, api, monkeypatch):
    api.buckets[BUCKET]["runs/exp1/a/b"] = b"1"
    real = api.list_bucket_tree

    def with_folders(bucket_id, prefix=None, *, recursive=None, token=None):
        yield BucketFolder(type="directory", path="runs/exp1/a")
        yield from real(bucket_id, prefix, recursive=recursive, token=token)

    monkeypatch.setattr(api, "list_bucket_tree", with_folders)
    assert bucket.list() == [ObjectInfo("a/b", 1)]


def test_delete_only_sends_existing_paths(bucket, api):
    api.buckets[BUCKET].update({"runs/exp1/a": b"1", "runs/exp1/b": b"2"})
    bucket.delete(["a", "never"])
    assert api.calls == [
        Call("get_bucket_paths_info", (BUCKET, ["runs/exp1/a", "runs/exp1/never"]), dict(token=TOKEN)),
        Call("batch_bucket_files", (BUCKET,), dict(add=None, copy=None, delete=["runs/exp1/a"], token=TOKEN)),
    ]
    assert api.buckets[BUCKET] == {"runs/exp1/b": b"2"}

    api.calls.clear()
    bucket.delete(["never"])
    assert api.names() == ["get_bucket_paths_info"]  # nothing to delete: no batch call
    api.calls.clear()
    bucket.delete([])
    assert api.calls == []


def test_exists_uses_paths_info_without_downloading(bucket, api):
    api.buckets[BUCKET]["runs/exp1/a"] = b"1"
    assert bucket.exists("a") is True
    assert bucket.exists("b") is False
    assert api.names() == ["get_bucket_paths_info", "get_bucket_paths_info"]
    assert api.calls[0].args == (BUCKET, ["runs/exp1/a"])


def test_invalid_keys_rejected_before_any_call(bucket, api):
    for op in (
        lambda: bucket.put("../x", b""),
        lambda: bucket.get("/abs"),
        lambda: bucket.delete(["ok", "a//b"]),
        lambda: bucket.exists("a\\b"),
        lambda: bucket.list("../"),
    ):
        with pytest.raises(InvalidKeyError):
            op()
    assert api.calls == []


def test_create_bucket_only_when_asked(api, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    HfBucket("someone/new", token=TOKEN, api=api)
    assert api.calls == []
    HfBucket("someone/new", token=TOKEN, api=api, create=True)
    assert api.calls == [
        Call("create_bucket", ("someone/new",), dict(private=None, visibility=None, resource_group_id=None,
                                                     region=None, exist_ok=True, token=TOKEN))
    ]
    assert "someone/new" in api.buckets


def test_from_url_parses_owner_name_and_nested_prefix(api):
    bucket = HfBucket.from_url("hf://buckets/someone/rl-sync/runs/exp1/", token=TOKEN, api=api)
    assert (bucket.bucket_id, bucket.prefix) == (BUCKET, "runs/exp1")
    assert bucket.url == "hf://buckets/someone/rl-sync/runs/exp1"
    bucket.put("k", b"v")
    assert api.calls[-1].kwargs["add"] == [(b"v", "runs/exp1/k")]


@pytest.mark.parametrize("bucket_id", ["no-namespace", "a/b/c", "/b", "a/"])
def test_bad_bucket_id_rejected(bucket_id, api):
    with pytest.raises(BucketError, match="namespace/name"):
        HfBucket(bucket_id, api=api)


def test_bad_prefix_rejected(api):
    with pytest.raises(InvalidKeyError):
        HfBucket(BUCKET, prefix="runs/../x", api=api)


# -- token sources ---------------------------------------------------------------------------------------


def test_token_from_hf_token_env_when_not_given(api, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_fromENV")
    bucket = HfBucket(BUCKET, api=api)
    bucket.put("k", b"v")
    assert api.calls[-1].kwargs["token"] == "hf_fromENV"
    explicit = HfBucket(BUCKET, token=TOKEN, api=api)
    explicit.put("k", b"v")
    assert api.calls[-1].kwargs["token"] == TOKEN


def test_default_client_is_a_real_hfapi_with_the_token(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_fromENV")
    assert isinstance(HfBucket(BUCKET)._api, HfApi)
    assert HfBucket(BUCKET)._api.token == "hf_fromENV"
    assert HfBucket(BUCKET, token=TOKEN)._api.token == TOKEN


# -- error mapping -----------------------------------------------------------------------------------------


def test_remote_404_entry_maps_to_object_not_found(bucket, api):
    err = http_error(404, f"{ENDPOINT}/buckets/{BUCKET}/resolve/runs%2Fexp1%2Fx", {"X-Error-Code": "EntryNotFound"})
    assert isinstance(err, RemoteEntryNotFoundError)
    api.fail_next("download_bucket_files", err)
    with pytest.raises(ObjectNotFoundError, match="HTTP 404"):
        bucket.get("x")


def test_plain_404_maps_to_object_not_found(bucket, api):
    api.fail_next("download_bucket_files", http_error(404, f"{ENDPOINT}/some/thing"))
    with pytest.raises(ObjectNotFoundError):
        bucket.get("x")


def test_missing_bucket_is_a_configuration_error_not_a_missing_object(api, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    bucket = HfBucket("someone/absent", token=TOKEN, api=api)
    for op in (lambda: bucket.get("x"), bucket.list, lambda: bucket.exists("x"), lambda: bucket.put("x", b"")):
        with pytest.raises(BucketError, match="bucket 'someone/absent' not found") as info:
            op()
        assert not isinstance(info.value, (ObjectNotFoundError, TransientBucketError))
        assert isinstance(info.value.__cause__, BucketNotFoundError)


def test_list_of_missing_folder_404_is_empty(bucket, api):
    api.fail_next("list_bucket_tree", http_error(404, f"{ENDPOINT}/api/buckets/{BUCKET}/tree/runs%2Fexp1%2F"))
    assert bucket.list() == []


def test_429_with_retry_after_header_is_transient(bucket, api):
    err = http_error(429, f"{ENDPOINT}/api/buckets/{BUCKET}/batch", {"Retry-After": "7"})
    api.fail_next("batch_bucket_files", err)
    with pytest.raises(TransientBucketError, match="HTTP 429") as info:
        bucket.put("k", b"v")
    assert info.value.retry_after == 7.0
    assert isinstance(info.value.__cause__, HfHubHTTPError)  # original kept for debugging


def test_429_with_http_date_retry_after(bucket, api):
    when = format_datetime(datetime.now(timezone.utc) + timedelta(seconds=120), usegmt=True)
    err = http_error(429, f"{ENDPOINT}/api/buckets/{BUCKET}/paths-info", {"Retry-After": when})
    api.fail_next("get_bucket_paths_info", err)
    with pytest.raises(TransientBucketError) as info:
        bucket.exists("k")
    assert 100 < info.value.retry_after <= 121


def test_429_with_hub_ratelimit_header(bucket, api):
    headers = {"RateLimit": '"api";r=0;t=42', "RateLimit-Policy": '"fixed window";"api";q=500;w=300'}
    api.fail_next("list_bucket_tree", http_error(429, f"{ENDPOINT}/api/buckets/{BUCKET}/tree", headers))
    with pytest.raises(TransientBucketError) as info:
        bucket.list()
    assert info.value.retry_after == 42.0


@pytest.mark.parametrize("status", [408, 500, 502, 503, 504])
def test_5xx_and_timeouts_are_transient_without_retry_after(bucket, api, status):
    api.fail_next("download_bucket_files", http_error(status, f"{ENDPOINT}/api/buckets/{BUCKET}/paths-info"))
    with pytest.raises(TransientBucketError, match=f"HTTP {status}") as info:
        bucket.get("k")
    assert info.value.retry_after is None


@pytest.mark.parametrize(
    "exc",
    [
        httpx2.ConnectError("connection refused", request=httpx2.Request("POST", f"{ENDPOINT}/api/buckets/x/batch")),
        httpx2.ReadTimeout("timed out", request=httpx2.Request("POST", f"{ENDPOINT}/api/buckets/x/batch")),
        ConnectionResetError("reset by peer"),
    ],
)
def test_connection_errors_are_transient(bucket, api, exc):
    api.fail_next("batch_bucket_files", exc)
    with pytest.raises(TransientBucketError, match="connection error"):
        bucket.put("k", b"v")


@pytest.mark.parametrize("status", [400, 401, 403, 409, 413])
def test_other_http_errors_are_permanent(bucket, api, status):
    api.fail_next("batch_bucket_files", http_error(status, f"{ENDPOINT}/api/buckets/{BUCKET}/batch"))
    with pytest.raises(BucketError, match=f"HTTP {status}") as info:
        bucket.put("k", b"v")
    assert not isinstance(info.value, (TransientBucketError, ObjectNotFoundError))


def batch_error(paths: list[str]) -> BucketBatchError:
    """The error huggingface_hub raises when the /batch endpoint reports failed operations."""
    failures = [{"path": path, "error": "File not found"} for path in paths]
    request = httpx2.Request("POST", f"{ENDPOINT}/api/buckets/{BUCKET}/batch")
    response = httpx2.Response(422, json={"failed": failures}, request=request)
    return _bucket_batch_error(BUCKET, failures, sent=len(paths), response=response)


def test_batch_failure_is_permanent_and_lists_failures(bucket, api):
    api.fail_next("batch_bucket_files", batch_error(["runs/exp1/k"]))
    with pytest.raises(BucketError, match="rejected the operation .runs/exp1/k: File not found") as info:
        bucket.put("k", b"v")
    assert not isinstance(info.value, TransientBucketError)


def test_delete_racing_another_delete_is_ignored(bucket, api):
    api.buckets[BUCKET]["runs/exp1/a"] = b"1"

    def gone_first(bucket_id, *, add=None, copy=None, delete=None, token=None):
        api.calls.append(Call("batch_bucket_files", (bucket_id,), dict(delete=delete)))
        api.buckets[BUCKET].clear()  # someone else deleted it between paths-info and batch
        raise batch_error(delete)

    api.batch_bucket_files = gone_first
    bucket.delete(["a"])  # the object is gone, which is what was asked
    assert api.names() == ["get_bucket_paths_info", "batch_bucket_files", "get_bucket_paths_info"]


def test_delete_failure_with_object_still_there_is_raised(bucket, api):
    api.buckets[BUCKET]["runs/exp1/a"] = b"1"
    api.fail_next("batch_bucket_files", batch_error(["runs/exp1/a"]))
    with pytest.raises(BucketError, match="delete 'a'"):
        bucket.delete(["a"])


def test_offline_mode_is_permanent(bucket, api):
    api.fail_next("list_bucket_tree", OfflineModeIsEnabled("Cannot reach the Hub: offline mode is enabled."))
    with pytest.raises(BucketError, match="HF_HUB_OFFLINE") as info:
        bucket.list()
    assert not isinstance(info.value, TransientBucketError)


def test_download_that_wrote_nothing_is_not_found(bucket, api, monkeypatch):
    api.buckets[BUCKET]["runs/exp1/k"] = b"v"
    monkeypatch.setattr(api, "download_bucket_files", lambda *args, **kwargs: None)
    with pytest.raises(ObjectNotFoundError):
        bucket.get("k")


def test_get_file_failing_mid_download_leaves_no_part_file(bucket, api, tmp_path, monkeypatch):
    def partial_then_reset(bucket_id, files, *, raise_on_missing_files=False, token=None):
        Path(files[0][1]).write_bytes(b"half")
        raise ConnectionResetError("reset by peer")

    monkeypatch.setattr(api, "download_bucket_files", partial_then_reset)
    out = tmp_path / "out"
    with pytest.raises(TransientBucketError):
        bucket.get_file("k", out)
    assert not out.exists() and not Path(f"{out}.part").exists()


def test_unexpected_client_error_is_permanent_bucket_error(bucket, api):
    api.fail_next("download_bucket_files", ValueError("Could not parse xet file data"))
    with pytest.raises(BucketError, match="ValueError: Could not parse xet file data") as info:
        bucket.get("k")
    assert not isinstance(info.value, TransientBucketError)


def test_error_message_names_operation_key_and_bucket(bucket, api):
    err = http_error(503, f"{ENDPOINT}/api/buckets/{BUCKET}/batch", {"X-Request-Id": "req-123"})
    api.fail_next("batch_bucket_files", err)
    with pytest.raises(TransientBucketError) as info:
        bucket.put("deltas/7", b"v")
    message = str(info.value)
    assert "put 'deltas/7'" in message and "hf://buckets/someone/rl-sync/runs/exp1" in message
    assert "req-123" in message


# -- the token never leaks -------------------------------------------------------------------------------------


def _everything_said(err: BaseException) -> str:
    return "".join(traceback.format_exception(err)) + str(err) + repr(err)


def test_token_never_in_repr(bucket):
    assert TOKEN not in repr(bucket) and TOKEN not in str(bucket)
    assert repr(bucket) == "HfBucket('hf://buckets/someone/rl-sync/runs/exp1')"


@pytest.mark.parametrize("status", [401, 403, 429, 500])
def test_token_echoed_by_server_is_scrubbed_from_errors_and_logs(bucket, api, caplog, status):
    echoed = f"Invalid credentials in Authorization header: Bearer {TOKEN}"
    err = http_error(status, f"{ENDPOINT}/api/buckets/{BUCKET}/batch", {"X-Error-Message": echoed},
                     body=f'{{"error": "bad token {TOKEN}"}}'.encode())
    assert TOKEN in str(err)  # the scenario really carries the token
    api.fail_next("batch_bucket_files", err)
    caplog.set_level(logging.DEBUG)
    with pytest.raises(BucketError) as info:
        bucket.put("k", b"v")
    assert TOKEN not in _everything_said(info.value)
    assert "<redacted>" in str(info.value)
    assert info.value.__cause__ is None  # the leaking original is not chained
    assert TOKEN not in caplog.text


def test_token_deep_in_the_cause_chain_is_not_chained(bucket, api):
    try:
        try:
            raise RuntimeError(f"proxy rejected Bearer {TOKEN}")
        except RuntimeError as inner:
            raise ConnectionError("connection aborted") from inner
    except ConnectionError as outer:
        api.fail_next("get_bucket_paths_info", outer)
    with pytest.raises(TransientBucketError) as info:
        bucket.exists("k")
    assert TOKEN not in _everything_said(info.value)


def test_original_error_is_chained_when_it_carries_no_token(bucket, api):
    original = http_error(500, f"{ENDPOINT}/api/buckets/{BUCKET}/batch")
    api.fail_next("batch_bucket_files", original)
    with pytest.raises(TransientBucketError) as info:
        bucket.put("k", b"v")
    assert info.value.__cause__ is original


def test_token_from_env_is_scrubbed_too(api, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_envSECRETvalue9876543210")
    bucket = HfBucket(BUCKET, api=api)
    api.fail_next("list_bucket_tree", ConnectionError("proxy said: token hf_envSECRETvalue9876543210 rejected"))
    with pytest.raises(TransientBucketError) as info:
        bucket.list()
    assert "hf_envSECRETvalue9876543210" not in _everything_said(info.value)


def test_token_not_logged_on_success(bucket, api, caplog, tmp_path):
    caplog.set_level(logging.DEBUG)
    api.buckets[BUCKET]["runs/exp1/a"] = b"1"
    bucket.put("b", b"2")
    bucket.get("a")
    bucket.get_file("a", tmp_path / "a")
    bucket.list()
    bucket.delete(["a"])
    assert caplog.records  # operations are logged at debug level
    assert TOKEN not in caplog.text


def test_open_bucket_hf_url_reads_hf_token_env(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    wrapped = open_bucket("hf://buckets/someone/rl-sync/runs/exp1")
    bucket = wrapped.inner
    assert isinstance(bucket, HfBucket) and bucket._api.token == TOKEN
    assert TOKEN not in repr(wrapped)
    assert TOKEN not in repr(bucket)
    assert os.environ["HF_TOKEN"] == TOKEN
