"""Size limits on what the library reads from a bucket or a file, in one place.

Every object in a bucket is untrusted: a reader refuses one larger than its limit before
reading its bytes (:class:`~rlsync.errors.ObjectTooLargeError`). The limits are generous
for honest objects and small enough that a hostile one costs bounded memory and time.
"""

from __future__ import annotations

#: The pointer (``latest.json``): every retained version's entry.
MAX_POINTER_BYTES = 16 * 1024 * 1024
#: The run lock (``lock.json``).
MAX_LOCK_BYTES = 64 * 1024
#: The anchor policy's control object (``control/publisher.json``).
MAX_CONTROL_BYTES = 64 * 1024
#: What the owner wants running on one Space (``control/desired/<role>/<instance>.json``).
MAX_DESIRED_BYTES = 16 * 1024
#: A checkpoint's ``COMPLETE.json`` marker.
MAX_MARKER_BYTES = 1 << 20
#: An exchange object of the RL loop (tasks, rollouts, scores, status, metrics, demand).
MAX_OBJECT_BYTES = 16 * 1024 * 1024
#: A safetensors file's JSON header.
MAX_HEADER_BYTES = 100 * 1024 * 1024
#: The ``__metadata__`` of a safetensors header.
MAX_METADATA_BYTES = 16 * 1024 * 1024
#: The headers and metadata of all the files of one update, read before its data.
MAX_HEADERS_BYTES = 64 << 20
#: A replica's status object (``status/<replica>.json``): a real one with every field at its
#: largest (50 syncs, a Hub count of 64 request kinds, 64 adapters) is about 15 KB, a common one 8 KB.
MAX_STATUS_BYTES = 24 * 1024
#: The status objects a panel's snapshot reads (the first by key of those within the size; the others
#: are refused unread).
MAX_STATUS_OBJECTS = 64
