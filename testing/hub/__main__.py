"""``python -m testing.hub [--root DIR]``: the Hub stand-in as a process of its own, shared by the processes pointed
at it (``HF_ENDPOINT``). Prints its URL on the first line of stdout, serves until SIGTERM or SIGINT; configured
through its control routes (:mod:`testing.hub.control`, :class:`testing.hub.process.HubProcess`)."""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import threading
from pathlib import Path

from testing.hub.server import HubServer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m testing.hub", description=__doc__)
    parser.add_argument("--root", help="folder of the Xet storage (default: a new temporary folder)")
    args = parser.parse_args(argv)
    root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="hub-standin-"))
    server = HubServer(root)
    done = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: done.set())
    print(server.url, flush=True)
    done.wait()
    server.close()
    sys.exit(0)


if __name__ == "__main__":
    main()
