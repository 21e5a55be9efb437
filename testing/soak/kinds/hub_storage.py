"""Trial ``hub_storage``: the real Hub client (huggingface_hub + hf_xet) against the Hub stand-in
server, with random 429/503/dropped connections on the Hub API, the Xet token endpoint and Xet
storage, beneath a publisher and two subscribers; everything converges bit-exactly."""

from __future__ import annotations

import collections
import contextlib
import random
import tempfile
from pathlib import Path
from typing import Iterator

from rlsync.bucket import RetryingBucket
from rlsync.protocol import Subscriber

from ...hub.server import HubServer
from ..invariants import Ledger, TrialResult, check_verified
from ..processes import CHILD_TIMEOUT_S
from ..toy import PublisherThread, follow_until_converged

DEFAULT_TRIALS = 2
TOKEN = "hf_SOAKtoken0123456789abcdefghijklmn"
BUCKET = "soak/run"


@contextlib.contextmanager
def _online() -> Iterator[None]:
    """huggingface_hub allowed to send requests (the test suite sets HF_HUB_OFFLINE), restored after."""
    from huggingface_hub import constants

    before = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = False
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = before


def _bucket(server: HubServer, attempts: int) -> RetryingBucket:
    from huggingface_hub import HfApi

    from rlsync.bucket.budget import BudgetConfig, RequestMeter
    from rlsync.bucket.hf import HfBucket

    unpaced = RequestMeter(BudgetConfig(enabled=False))  # the stand-in limits nothing here: faults, not a budget
    inner = HfBucket(BUCKET, token=TOKEN, api=HfApi(endpoint=server.url, token=TOKEN), meter=unpaced)
    return RetryingBucket(inner, max_attempts=attempts, base_delay=0.001, max_delay=0.01, max_total=30.0)


def _start(workdir: Path) -> HubServer:
    """A Hub stand-in with this trial's token and bucket, and the Hub client's timeouts set for it."""
    from huggingface_hub.utils import disable_progress_bars

    from rlsync.bucket.hf_transport import HfTransferConfig, install

    disable_progress_bars()
    server = HubServer(Path(tempfile.mkdtemp(prefix="hub-", dir=workdir)))
    server.add_token(TOKEN, "write")
    server.create_bucket(BUCKET)
    install(HfTransferConfig(connect_timeout=2.0, read_timeout=2.0))
    return server


def trial_hub_storage(rng: random.Random, workdir: Path, final: int | None = None) -> TrialResult:
    """Publisher and two subscribers on retrying Hub buckets through a faulty Hub stand-in.

    Args:
        rng: Draws the fault rates and seeds.
        workdir: Scratch folder (the stand-in's Xet storage).
        final: Last version published (default: drawn from 6..10).
    """
    result = TrialResult("hub_storage")
    server = _start(workdir)
    ledger = Ledger(result)
    final = final if final is not None else rng.randint(6, 10)
    try:
        with _online():
            observer = _bucket(server, attempts=30)  # reads what the pointer names; must not give up

            class Checked(PublisherThread):
                def after_publish(self, step: int) -> None:
                    ledger.observe(observer)

            rates = {"api": rng.uniform(0.03, 0.1), "token": rng.uniform(0.03, 0.1), "storage": rng.uniform(0.03, 0.1)}
            server.chaos(rates, seed=rng.randrange(2**31))
            publisher = Checked(_bucket(server, 8), ledger, final, interval=4, keep=2, pause_s=0.0,
                                seed=rng.randrange(1000))  # fmt: skip
            subs = [Subscriber(_bucket(server, 8)) for _ in range(2)]
            follow_until_converged(publisher, subs, ledger, CHILD_TIMEOUT_S, collections.Counter())
            server.chaos({})
            ledger.observe(observer)
            check_verified(observer, result, "after the faulty Hub run")
            if publisher.retries:
                result.faults["hub: publish retried after retries ran out"] += publisher.retries
    finally:
        server.close()
    for side, n in server.chaotic.items():
        if n:
            result.faults[f"hub: {side} faults"] += n
    return result
