"""The events feed of the Hub stand-in (:mod:`testing.hub.server`): ``GET /api/buckets/{id}/events``.

It answers as ``huggingface_hub._bucket_live_follow`` expects: a ``text/event-stream`` that replays
the changes after ``cursor`` (or since the instant ``since``; neither: none), sends ``ready`` with
the cursor, then each batch's changes live as ``changes`` events, with a ``: ping`` comment while
nothing happens. A session ends with ``reconnect`` after the server's session length; a cursor
older than the replay buffer (or a reset the test asked for) gets ``reset``. One session is one
API request, whatever it streams.
"""

from __future__ import annotations

import datetime
import json
import time


def serve_events(handler, bucket_id: str, query: dict) -> None:
    """Serve one live-follow session on `handler` (a :class:`testing.hub.handler.Handler`)."""
    hub = handler.hub
    if not hub.feed_enabled:
        return handler._error(404, "live-follow is not enabled", {"X-Error-Code": "EntryNotFound"})
    if bucket_id not in hub.buckets:
        return handler._error(404, "Bucket not found", {"X-Error-Code": "RepoNotFound"})
    cursor_arg, since_arg = query.get("cursor", [""])[0], query.get("since", [""])[0]
    if cursor_arg and not cursor_arg.isdigit():
        return handler._error(400, "invalid cursor")
    handler.send_response(200)
    for name, value in handler._limits.items():
        handler.send_header(name, value)
    handler.send_header("Content-Type", "text/event-stream")
    handler.send_header("Cache-Control", "no-cache")
    handler.send_header("Connection", "close")
    handler.end_headers()
    handler.close_connection = True

    def emit(event: str, data: dict) -> None:
        handler.wfile.write(f"event: {event}\ndata: {json.dumps(data)}\n\n".encode())
        handler.wfile.flush()

    try:
        with hub._lock:
            log = hub.changes.get(bucket_id, [])
            oldest = log[0][0] if log else hub._seq + 1
            reset = hub._reset_pending > 0 or (cursor_arg and int(cursor_arg) < oldest - 1 and log)
            if hub._reset_pending > 0:
                hub._reset_pending -= 1
        if reset:
            return emit("reset", {"reason": "cursor older than the replay buffer"})
        with hub._lock:
            if cursor_arg:
                after = int(cursor_arg)
            elif since_arg:
                since = datetime.datetime.fromisoformat(since_arg.replace("Z", "+00:00")).timestamp()
                after = max((seq for seq, t, _ in log if t < since), default=log[0][0] - 1 if log else hub._seq)
            else:
                after = hub._seq
            replay = [(seq, c) for seq, _, c in log if seq > after]
        if replay:
            after = replay[-1][0]
            emit("changes", {"cursor": str(after), "changes": [c for _, c in replay]})
        emit("ready", {"cursor": str(after)})
        ends = time.monotonic() + hub.feed_session_s
        while True:
            with hub._lock:
                fresh = [(seq, c) for seq, _, c in hub.changes.get(bucket_id, []) if seq > after]
                if not fresh and hub.feed_enabled:
                    hub._changed.wait(min(hub.feed_ping_s, max(0.0, ends - time.monotonic())))
                    fresh = [(seq, c) for seq, _, c in hub.changes.get(bucket_id, []) if seq > after]
                enabled = hub.feed_enabled
            if fresh:
                after = fresh[-1][0]
                emit("changes", {"cursor": str(after), "changes": [c for _, c in fresh]})
            if not enabled or time.monotonic() >= ends:
                return emit("reconnect", {"cursor": str(after)})
            if not fresh:
                handler.wfile.write(b": ping\n\n")
                handler.wfile.flush()
    except (BrokenPipeError, ConnectionResetError, OSError):
        pass
