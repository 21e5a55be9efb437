"""Scoring cost per source: the library's own call against the env simulator's bounded path.

For each source, ``--samples`` scripted completions (half correct, half wrong) are
scored twice in the same run (each after one untimed warm-up pass): by calling the library directly (reasoning-gym's
``score_answer``, math-verify's ``verify(parse(...))``), and through the env
simulator's ``score_sample`` (a confined child per call, forked from the scoring server:
:func:`env_space.isolation.start_scoring_server`; reward functions in the worker process or
in such a child per call). Printed: microseconds per sample and the ratio
to the direct call, which is what the time bound and the isolation cost. The
OpenEnv row is one WebSocket ``reset`` + ``step`` round trip per sample to a server
on 127.0.0.1 serving the same reasoning-gym generators (its direct baseline is the
reasoning-gym call).

    python -m benchmarks.env_scoring                 # 400 samples per source
    python -m benchmarks.env_scoring --samples 1000
    python -m benchmarks.env_scoring --rows dataset-thread   # one source per process, as in an env Space
"""

from __future__ import annotations

import argparse
import socket
import tempfile
import threading
import time
from collections.abc import Callable

import datasets
import uvicorn
from math_verify import parse, verify
from reasoning_gym.utils import extract_answer

from env_space.isolation import modules_of, start_scoring_server
from env_space.simulator import EnvConfig, EnvSimulator
from env_space.sources import open_environment
from env_space.sources.openenv_server import build_app
from env_space.sources.settings import DatasetSourceConfig, OpenEnvConfig, ReasoningGymConfig
from rlsync.bucket import LocalBucket

RG = "reasoning_gym:leg_counting,basic_arithmetic"


def _per_sample_us(fn: Callable[[int], object], n: int) -> float:
    """Mean time of ``fn(i)`` over ``i < n``, after one untimed pass (warm caches on every path alike)."""
    for i in range(n):
        fn(i)
    start = time.perf_counter()
    for i in range(n):
        fn(i)
    return (time.perf_counter() - start) / n * 1e6


def _simulator(environment, root: str) -> EnvSimulator:
    start_scoring_server(modules_of(environment.score))  # as the env does for its environment (the first one counts)
    simulator = EnvSimulator(EnvConfig(bucket=root, environment="reverse"), bucket=LocalBucket(root))
    simulator.environment = environment
    return simulator


def _completions(tasks) -> list[str]:
    return [f"<answer>{t.answer}</answer>" if i % 2 == 0 else "<answer>-1</answer>" for i, t in enumerate(tasks)]


def _dataset_row(path: str, isolation: str, n: int, root: str) -> tuple[str, float, float]:
    config = DatasetSourceConfig(rewards="math_verify", reward_isolation=isolation)
    source = open_environment(f"dataset:{path}", settings=config)
    tasks = source.tasks(n, seed=0)
    texts = [f"so ${t.answer}$" if i % 2 == 0 else "so $-1$" for i, t in enumerate(tasks)]
    direct = _per_sample_us(lambda i: float(verify(parse(tasks[i].answer), parse(texts[i]))), n)
    simulator = _simulator(source, root)
    bounded = _per_sample_us(lambda i: simulator.score_sample(tasks[i], texts[i]), n)
    source.close()
    return f"dataset math_verify ({isolation})", direct, bounded


ROWS = ("reasoning_gym", "dataset-thread", "dataset-process", "openenv")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--rows", default=",".join(ROWS), help=f"rows to run, of {','.join(ROWS)} (an env process "
                        "scores one source: its scoring server preloads that source's modules only)")
    args = parser.parse_args()
    n, wanted = args.samples, set(args.rows.split(","))
    root = tempfile.mkdtemp(prefix="env-scoring-")
    rows = []

    rg = open_environment(RG, settings=ReasoningGymConfig())
    tasks = rg.tasks(n, seed=0)
    texts = _completions(tasks)
    verifiers = rg.verifiers  # the generators whose score_answer the source calls

    def rg_direct(i: int) -> float:
        entry = tasks[i].meta["entry"]
        return verifiers[entry["metadata"]["source_dataset"]].score_answer(extract_answer(texts[i]), entry)

    direct = _per_sample_us(rg_direct, n)
    if "reasoning_gym" in wanted:
        simulator = _simulator(rg, root)
        rows.append(("reasoning_gym", direct, _per_sample_us(lambda i: simulator.score_sample(tasks[i], texts[i]), n)))

    path = f"{root}/math"
    values = [str(v) for v in range(50)]
    datasets.Dataset.from_dict({"prompt": [f"What is {v}?" for v in values], "answer": values}).save_to_disk(path)
    isolations = [i for i in ("thread", "process") if f"dataset-{i}" in wanted]
    rows += [_dataset_row(path, isolation, n, root) for isolation in isolations]

    if "openenv" in wanted:
        rows.append(("openenv (reasoning_gym over 127.0.0.1)", direct, _openenv_row(rg, n, root)))

    print(f"{'source':42s} {'direct us':>10s} {'bounded us':>11s} {'ratio':>7s}")
    for name, direct, bounded in rows:
        print(f"{name:42s} {direct:10.0f} {bounded:11.0f} {bounded / direct:7.1f}")


def _openenv_row(rg, n: int, root: str) -> float:
    """Microseconds per sample scored through an OpenEnv server of the same generators on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(rg), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    openenv = open_environment(f"openenv:http://127.0.0.1:{port}", settings=OpenEnvConfig())
    oe_tasks = openenv.tasks(min(n, 200), seed=0)
    answers = [rg.tasks(1, seed=t.meta["seed"])[0].answer for t in oe_tasks]
    oe_texts = [f"<answer>{a}</answer>" if i % 2 == 0 else "<answer>-1</answer>" for i, a in enumerate(answers)]
    simulator = _simulator(openenv, root)
    oe = _per_sample_us(lambda i: simulator.score_sample(oe_tasks[i], oe_texts[i]), len(oe_tasks))
    openenv.close()
    server.should_exit = True
    thread.join(10)
    return oe


if __name__ == "__main__":
    main()
