"""Processes of a gloo group that exit without ``destroy_process_group``: how many abort.

Each round starts ``world`` ranks (spawned processes, one gloo group); every rank runs a few
all-gathers and leaves an all-reduce in flight, then returns without destroying the group, as a
rank of a TRL run does when its script ends. With ``--publisher`` every rank first builds a
:class:`rlsync.protocol.sharded.ShardedPublisher`, which destroys the group at interpreter exit.
A rank whose group is still alive while the interpreter tears down can abort ("terminate called
without an active exception", exit code -6): pytorch/pytorch#190489.

    python -m benchmarks.gloo_exit --rounds 8 --world 4
    python -m benchmarks.gloo_exit --rounds 8 --world 4 --publisher
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile

import torch
import torch.multiprocessing as mp


def _rank(rank: int, world: int, port: int, publisher: bool, folder: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if publisher:
        from rlsync.bucket import LocalBucket
        from rlsync.protocol.sharded import ShardedPublisher

        ShardedPublisher(LocalBucket(folder))
    out = [torch.empty(1) for _ in range(world)]
    for _ in range(20):
        dist.all_gather(out, torch.tensor([float(rank)]))
    dist.all_reduce(torch.ones(1000), async_op=True)  # still in flight when the script ends


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--publisher", action="store_true", help="build a ShardedPublisher on every rank")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    aborted = 0
    for _ in range(args.rounds):
        port, folder = _port(), tempfile.mkdtemp(prefix="gloo-exit-")
        procs = [ctx.Process(target=_rank, args=(r, args.world, port, args.publisher, folder)) for r in range(args.world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        aborted += sum(p.exitcode == -6 for p in procs)
    print(f"{aborted} of {args.rounds * args.world} rank processes aborted (publisher: {args.publisher})")


if __name__ == "__main__":
    main()
