"""Cost of parsing a safetensors header of many tiny entries (issue 26, high 5).

``python -m benchmarks.hostile_header [ENTRIES]`` builds a header of ENTRIES zero-sized entries
(1.7 million: about 96 MB, under the 100 MiB header limit), parses it with
:func:`rlsync.format.parse_header` and prints the outcome, the seconds it took and the peak RSS.
"""

from __future__ import annotations

import resource
import struct
import sys
import time

from rlsync.errors import FormatError
from rlsync.format import parse_header


def main(argv: list[str] | None = None) -> int:
    entries = int((argv if argv is not None else sys.argv[1:] or ["1700000"])[0])
    body = ",".join(f'"{i:x}":{{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}' for i in range(entries))
    head = ("{" + body + "}").encode()
    data = struct.pack("<Q", len(head)) + head
    del body
    t0 = time.perf_counter()
    try:
        parse_header(data)
        outcome = "accepted"
    except FormatError as exc:
        outcome = f"refused ({str(exc)[:70]})"
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{len(head) / 1e6:.1f} MB header, {entries:,} entries: {outcome} in {seconds:.2f} s, peak RSS {peak:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
