"""The bucket API of the Hub stand-in (:mod:`testing.hub.server`): what huggingface_hub 2.4.0's bucket methods call.

- ``GET /api/whoami-v2`` (:mod:`testing.hub.accounts`);
- ``POST /api/buckets/{ns}/{name}`` (create_bucket: of concurrent creates one wins, the others get 409 as from the
  Hub) and ``GET`` (bucket_info);
- ``GET /api/buckets/{id}/tree[/{prefix}]`` (list_bucket_tree, paginated with a ``Link`` header);
- ``POST /api/buckets/{id}/paths-info`` (get_bucket_paths_info);
- ``POST /api/buckets/{id}/batch`` (batch_bucket_files' ndjson commit of add/delete operations; an added file's
  size is the one its Xet hash has in the stand-in's Xet storage);
- ``GET /api/buckets/{id}/events`` (:mod:`testing.hub.events`);
- ``HEAD /buckets/{id}/resolve/{path}`` (get_bucket_file_metadata: Xet hash and token refresh route).
"""

from __future__ import annotations

import datetime
import json
import re
import time
from urllib.parse import unquote

from testing.hub.events import serve_events


def serve(handler, raw_path: str, query: dict, body: bytes, role: str) -> None:
    """Answer one bucket API request on `handler` (a :class:`testing.hub.handler.Handler`) from a token of `role`."""
    hub = handler.hub
    if raw_path == "/api/whoami-v2":
        found = hub.accounts.whoami(bearer(handler.headers.get("Authorization")))
        return handler._send(200, found) if found else handler._error(401, "Invalid credentials in Authorization header")
    match = re.fullmatch(r"/api/buckets/([^/]+)/([^/]+)", raw_path)
    if match:
        return _bucket(handler, f"{match[1]}/{match[2]}", role)
    match = re.fullmatch(r"/api/buckets/([^/]+/[^/]+)/events", raw_path)
    if match and handler.command == "GET":
        return serve_events(handler, match[1], query)
    match = re.fullmatch(r"/api/buckets/([^/]+/[^/]+)/(tree|paths-info|batch)(/.*)?", raw_path)
    if match:
        bucket_id, op = match[1], match[2]
        if bucket_id not in hub.buckets:
            return handler._error(404, "Bucket not found", {"X-Error-Code": "RepoNotFound"})
        if op == "tree":
            return _tree(handler, bucket_id, unquote((match[3] or "/")[1:]), query)
        if op == "paths-info":
            return _paths_info(handler, bucket_id, json.loads(body or b"{}").get("paths", []))
        if not may_write(handler, role, bucket_id):
            return handler._error(403, "You don't have write access to this bucket")
        return _batch(handler, bucket_id, body)
    match = re.fullmatch(r"/buckets/([^/]+/[^/]+)/resolve/(.+)", raw_path)
    if match:
        return _resolve(handler, match[1], unquote(match[2]))
    handler._error(404, "not found")


def bearer(auth: str | None) -> str | None:
    """The token of an ``Authorization: Bearer`` header."""
    return auth[len("Bearer ") :] if auth and auth.startswith("Bearer ") else None


def may_write(handler, role: str, bucket_id: str) -> bool:
    """Whether the request's token (of `role`) may write in `bucket_id`'s namespace."""
    token = bearer(handler.headers.get("Authorization"))
    return role == "write" and handler.hub.accounts.may_write(token, bucket_id.split("/")[0])


def iso(t: float) -> str:
    """`t` (seconds since the epoch) as the Hub writes times."""
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _bucket(handler, bucket_id: str, role: str) -> None:
    hub = handler.hub
    exists = bucket_id in hub.buckets
    if handler.command == "POST":
        if not may_write(handler, role, bucket_id):
            return handler._error(403, "You don't have the rights to create a bucket in this namespace")
        if not hub.create_bucket(bucket_id):  # checked and created at once: one of two racing creates wins
            message = "You already created this bucket"  # with its url, which create_bucket(exist_ok=True) reads
            return handler._send(409, {"error": message, "url": f"{hub.url}/buckets/{bucket_id}"},
                                 {"X-Error-Message": message})  # fmt: skip
        return handler._send(200, {"url": f"{hub.url}/buckets/{bucket_id}", "id": bucket_id})
    if not exists:
        return handler._error(404, "Bucket not found", {"X-Error-Code": "RepoNotFound"})
    changes = hub.changes.get(bucket_id) or []
    updated = iso(changes[-1][1]) if changes else "2026-01-01T00:00:00.000Z"
    handler._send(200, {"id": bucket_id, "private": False, "createdAt": "2026-01-01T00:00:00.000Z",
                        "updatedAt": updated, "size": 0, "totalFiles": len(hub.buckets[bucket_id])})  # fmt: skip


def _tree(handler, bucket_id: str, prefix: str, query: dict) -> None:
    hub = handler.hub
    objects = hub.buckets[bucket_id]
    recursive = query.get("recursive", ["False"])[0].lower() == "true"
    start = int(query.get("cursor", ["0"])[0])
    paths = sorted(p for p in objects if p.startswith(prefix))
    if not recursive:
        raise NotImplementedError("only recursive listings are served")
    if prefix and not paths:
        return handler._error(404, "Path not found", {"X-Error-Code": "EntryNotFound"})
    page = paths[start : start + hub.page_size]
    headers = {}
    if start + hub.page_size < len(paths):
        nxt = f"{hub.url}/api/buckets/{bucket_id}/tree?recursive=true&cursor={start + hub.page_size}"
        if prefix:
            nxt = nxt.replace("/tree?", f"/tree/{prefix}?")
        headers["Link"] = f'<{nxt}>; rel="next"'
    handler._send(200, [_file_entry(p, objects[p]) for p in page], headers)


def _paths_info(handler, bucket_id: str, paths: list[str]) -> None:
    if len(paths) > 1000:
        return handler._error(400, "too many paths")
    objects = handler.hub.buckets[bucket_id]
    handler._send(200, [_file_entry(p, objects[p]) for p in paths if p in objects])


def _batch(handler, bucket_id: str, body: bytes) -> None:
    hub = handler.hub
    operations = [json.loads(line) for line in body.splitlines() if line.strip()]
    if len(operations) > 1000:
        return handler._error(400, "too many operations in one batch")
    objects = hub.buckets[bucket_id]
    failed = []
    with hub._lock:
        for op in operations:
            if op["type"] == "addFile":
                size = hub.xet.file_size(op["xetHash"])
                if size is None:
                    failed.append({"path": op["path"], "error": "unknown xet hash"})
                    continue
                change = "update" if op["path"] in objects else "add"
                objects[op["path"]] = {"size": size, "xetHash": op["xetHash"], "mtime": op.get("mtime")}
                hub._record_change(bucket_id, {"path": op["path"], "op": change, "size": size,
                                               "xetHash": op["xetHash"], "uploadedAt": iso(time.time())})  # fmt: skip
            elif op["type"] == "deleteFile":
                if objects.pop(op["path"], None) is not None:
                    hub._record_change(bucket_id, {"path": op["path"], "op": "delete"})
            else:
                failed.append({"path": op.get("path"), "error": f"unsupported operation {op['type']}"})
    handler._send(422 if failed and len(failed) == len(operations) else 200, {"failed": failed})


def _resolve(handler, bucket_id: str, path: str) -> None:
    hub = handler.hub
    meta = hub.buckets.get(bucket_id, {}).get(path)
    if meta is None:
        return handler._error(404, "Entry not found", {"X-Error-Code": "EntryNotFound"})
    refresh = f"{hub.url}/api/buckets/{bucket_id}/xet-read-token"
    handler._send(200, b"", {"X-Xet-Hash": meta["xetHash"], "Link": f'<{refresh}>; rel="xet-auth"',
                             "X-Linked-Size": str(meta["size"])})  # fmt: skip


def _file_entry(path: str, meta: dict) -> dict:
    mtime = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime((meta["mtime"] or 0) / 1000))
    return {"type": "file", "path": path, "size": meta["size"], "xetHash": meta["xetHash"], "mtime": mtime}
