"""What ``rlsync inspect`` shows for the bucket objects that are not one safetensors file:
an anchor folder (the key ``rlsync ls`` prints) and JSON objects (the pointer ``latest.json``,
a sharded checkpoint's ``*.index.json``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .errors import FormatError
from .files import read_regular
from .jsonlimits import loads_bounded
from .limits import MAX_POINTER_BYTES
from .protocol.manifest import Manifest

#: Files of one folder that ``inspect`` describes (a hostile folder may hold any number).
MAX_FOLDER_FILES = 256


def anchor_folder_files(folder: Path) -> list[Path]:
    """The files of an anchor folder (its shards and index), sorted by name.

    Raises:
        FormatError: the folder holds no safetensors file, or more than :data:`MAX_FOLDER_FILES` files.
    """
    files = []
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.is_file(follow_symlinks=False):
                files.append(Path(entry.path))
                if len(files) > MAX_FOLDER_FILES:
                    raise FormatError(f"{folder}: more than {MAX_FOLDER_FILES} files; not an anchor folder")
    if not any(f.suffix == ".safetensors" for f in files):
        raise FormatError(f"{folder}: no safetensors file; not an anchor folder")
    return sorted(files)


def describe_json(path: Path) -> list[str]:
    """Lines describing a pointer object (its versions, as ``rlsync ls`` counts them) or any other
    JSON object (its top-level keys); strings from the file are raw (the caller escapes them).

    Raises:
        FormatError: not a JSON object, or a pointer that does not check out.
    """
    data = read_regular(path, max_bytes=MAX_POINTER_BYTES)
    doc = loads_bounded(data, what=str(path), max_bytes=MAX_POINTER_BYTES)
    if not isinstance(doc, dict):
        raise FormatError(f"{path}: not a JSON object")
    if doc.get("format") == "rlsync":
        manifest = Manifest.from_json(data)
        anchors = ", ".join(str(a.step) for a in manifest.anchors)
        deltas = manifest.deltas
        return [
            f"file: {path} ({len(data):,} bytes)", "kind: pointer (latest.json)",
            f"run: {manifest.run_id or '-'}", f"newest step: {manifest.step}", f"state_hash: {manifest.state_hash}",
            f"anchors: {anchors}", f"deltas: {len(deltas)}" + (f" (steps {deltas[0].step}-{deltas[-1].step})" if deltas else ""),
            f"catch-up for a new replica: {manifest.catchup_bytes():,} bytes",
        ]  # fmt: skip
    keys = ", ".join(json.dumps(k)[:80] for k in list(doc)[:20])
    return [f"file: {path} ({len(data):,} bytes)", "kind: JSON object (not an rlsync pointer)", f"keys: {keys}"]
