"""The library's worker threads (numpy, torch and zstd release the GIL)."""

from __future__ import annotations

import concurrent.futures
import functools
import os

from .config import process_settings


@functools.lru_cache(maxsize=1)
def worker_pool() -> concurrent.futures.ThreadPoolExecutor:
    """A process-wide thread pool sized by ``RLSYNC_THREADS`` or the CPU count."""
    workers = process_settings().threads or os.cpu_count() or 1
    return concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rlsync")
