"""Soak test: "nothing lost, nothing half-applied" under kills, damage, flaky storage and two trainers.

Every trial builds a fresh local bucket, injects one kind of fault many times at
random moments, and checks the same invariants throughout:

* a replica never serves a mix of two versions: after every apply, the
  whole-state hash of its tensors (recomputed from the bytes, not the
  subscriber's own claim) equals the hash the pointer published for its step;
* every replica ends at the newest published version, bit-exactly;
* no published version is lost, reused or skipped: pointer steps are
  consecutive across publisher restarts, and every object the pointer ever
  named keeps its bytes (its sha256 never changes) until retention drops it;
* ``verify_bucket`` passes whenever no damage was injected on purpose.

Trial kinds (``--kinds``):

``publisher_kill``
    A publisher process (a small fp32 toy model and a plain
    :class:`~rlsync.protocol.Publisher` loop, not the GRPO trainer) is killed
    with SIGKILL after a random delay or at a chosen point inside ``publish``:
    while taking the run lock, mid delta upload, between the data and the
    pointer, mid anchor shard upload, between anchor shards, after the pointer
    but before the retention delete, and halfway through the retention delete.
    It is restarted with the same owner id and must ``resume()`` from the last
    complete publish.
``subscriber_kill``
    A subscriber process is killed after a random delay, mid download, between
    fetch and apply, or mid apply (while hashing the patched tensors); a fresh
    process bootstraps and must reach the newest version bit-exactly.
``apply_interrupt``
    In-process: an exception (or ``KeyboardInterrupt``) is raised after k
    tensors of a delta were written; the subscriber must roll back to the exact
    previous state hash, then apply the same update cleanly.
``bucket_damage``
    A delta deleted, bytes flipped, a file truncated, an old delta replayed
    over a newer one (pointer size fixed up), a pointer naming a missing file,
    an anchor shard deleted or flipped, a garbled pointer: subscribers refuse,
    keep their last good state, and reach the newest version after the next
    anchor.
``flaky_storage``
    :class:`~testing.faulty.FaultyBucket` (latency, 503, 429 with retry-after,
    uploads cut short, lagging listings) under a
    :class:`~rlsync.bucket.RetryingBucket`, beneath the publisher and three
    subscriber threads: everything converges bit-exactly and no cut-short
    upload is ever named by the pointer.
``hub_storage``
    The real Hub client (huggingface_hub + hf_xet, :class:`~rlsync.bucket.hf.HfBucket` under a
    :class:`~rlsync.bucket.RetryingBucket`) against the Hub stand-in server
    (:mod:`testing.hub.server`), which fails a random share of Hub API requests, Xet token
    grants and Xet storage requests (429, 503, dropped connections), beneath the publisher and
    two subscriber threads: everything converges bit-exactly.
``hub_hostile``
    The hostile inputs of issue 33 at volume against the Hub stand-in, beneath a publisher and two
    subscribers following the bucket through watched views: a hostile writer plants oversized
    objects (refused from their listed size, never downloaded), demand objects asking for 2^20
    samples or an unpublished version (bounded, refused), key floods under ``tasks/`` (a view
    started meanwhile becomes ready within a bounded number of listing pages), failing feed
    sessions and malformed feed changes (skipped, counted); then a trainer taken over while the
    feed fails is fenced. Everything converges bit-exactly, every watch thread stays alive.
``two_trainers``
    A second trainer with another owner id is refused (``RunLockedError``);
    then one that takes the run over (same owner id, or a stale lock) makes the
    first one stop with ``FencedError``; the chain stays valid.
``hostile_replicas``
    The real trainer and env (tiny model, CPU) with honest replicas and hostile
    ones writing random malformed rollouts among the good ones (non-finite
    log-probs, token ids out of vocabulary, empty or overlong sequences, future
    versions, deep or huge-integer JSON, oversized objects), scores straight into
    ``scores/``, bad status objects and a NaN control value: 0 states lost, 0
    non-finite publishes, every role alive, every hostile object refused and counted.
``hostile_tasks``
    The env (reasoning-gym verifiers that evaluate answers) and a real replica (tiny model)
    while planted task keys (``tasks/9999999999.json``, 11-digit and unpadded names), task
    objects asking for millions of tasks or holding 8 MB of prompts, and rollouts whose
    completions are code (``__import__('os').system(...)``, ``9**9**9**9``) arrive: no code runs
    (a canary file), no file outside the bucket changes, no genuine batch is lost or unscored,
    both roles stay alive within bounded memory.
``hostile_values``
    The hostile writers of issue 41 between a publisher's versions: metrics and status objects with
    values of the wrong JSON kind in typed fields, status objects past their size or in a flood,
    ``RateLimit`` headers with numbers too large to use, and a lock epoch, a pointer epoch or a
    pointer step that leaves no room (the trainer then restarts, continuing the run or starting a
    new one): every reader goes on, a panel snapshot's reads stay bounded, the restarted trainer
    takes the lock and publishes the next version, and the follower converges bit-exactly.

Usage::

    python -m testing.soak                      # default trial counts
    python -m testing.soak --trials 3           # 3 trials of every kind
    python -m testing.soak --kinds publisher_kill --trials 200 --seed 7
    python -m testing.soak --json soak.json

Exit status 1 if any state was lost or any invariant was violated.

Layout: ``kinds/`` holds one module per trial kind (a new fault kind is one small module
there plus one line in ``kinds.MODULES``); :mod:`.invariants` the checks every trial
makes; :mod:`.hooks` the fault wrapper that kills a process at a chosen point;
:mod:`.processes` the child processes; :mod:`.toy` the toy model and its in-process
publisher; :mod:`.runner` the command line; :mod:`.report` the summary.
"""
