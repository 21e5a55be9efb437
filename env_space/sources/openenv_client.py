"""An OpenEnv environment server as a task source: ``ENV_ENVIRONMENT=openenv:http://host:8000``.

Single-step episodes through openenv-core's ``GenericEnvClient`` (WebSocket, no
environment-specific package needed): task ``i`` of batch seed ``s`` is the
observation of ``reset(seed=<s, i>)``, its text field ``ENV_OPENENV_PROMPT_FIELD`` the
prompt; scoring opens a new episode with the same seed, checks that the server gives
the same prompt again (so the server must reset reproducibly by seed), sends the
completion as the action's ``ENV_OPENENV_ACTION_FIELD`` in one ``step`` and takes the
step result's ``reward``. No episode stays open between publishing a task and scoring
it, so the server may restart in between. One WebSocket session is reused from call
to call; a call that fails (or overstays its bound) discards its session, and
further calls fail at once (``ConnectionError``) for a backoff that doubles with
each failure in a row (1 s up to 60 s), so a malformed server is not retried hot.
Messages are capped (``ENV_OPENENV_MAX_MESSAGE_MB``) and prompts at what a replica
reads; making one batch is bounded by ``ENV_OPENENV_BATCH_TIMEOUT_S``.

Defaults fit text environments whose action is ``{"message": ...}`` and whose
observation has a ``prompt`` (TextArena-style, and this project's own
:mod:`env_space.sources.openenv_server`). Multi-turn episodes are out of scope: see
that module's docstring for how they would fit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator
from typing import Any

from env_space.bounded import ScoringFailure
from rlsync.spaces.exchange import DEFAULT_LIMITS
from env_space.environments import Environment, Scoring, Task
from rlsync.registry import Kind, register

from .settings import read_source_settings

__all__ = ["OpenEnvConfig", "OpenEnvEnvironment", "from_spec"]

_MAX_BACKOFF_S = 60.0


@dataclasses.dataclass
class OpenEnvConfig:
    """Settings of the OpenEnv source (environment variables ``ENV_OPENENV_<FIELD>``)."""

    prompt_field: str = dataclasses.field(default="prompt", metadata={"help": "observation field holding the prompt"})
    action_field: str = dataclasses.field(
        default="message", metadata={"help": "action field the completion is sent in"}
    )
    type_field: str = dataclasses.field(
        default="task_type", metadata={"help": "observation field naming the task type ('' = none)"}
    )
    timeout_s: float = dataclasses.field(default=30.0, metadata={"help": "connect and message timeout"})
    batch_timeout_s: float = dataclasses.field(
        default=120.0, metadata={"help": "time bound of making one task batch (plus at most one call's timeout)"}
    )
    max_message_mb: float = dataclasses.field(
        default=1.0, metadata={"help": "largest WebSocket message accepted from the server"}
    )


class OpenEnvEnvironment(Environment):
    """Tasks and rewards from an OpenEnv server, one step per episode.

    Args:
        url: The server's base URL (``http://`` or ``ws://``; a Space: ``https://OWNER-NAME.hf.space``).
        config: Field names and timeouts.
    """

    scoring = Scoring.SELF_BOUNDED  # the server scores; each call is bounded by the client's timeouts

    def __init__(self, url: str, config: OpenEnvConfig | None = None) -> None:
        self.url = url
        self.config = config or OpenEnvConfig()
        self.name = f"openenv:{url}"
        self._idle: list[Any] = []  # connected sessions nobody is using
        self._lock = threading.Lock()
        self._backoff_s = 0.0  # after failures in a row: calls fail at once until _retry_at
        self._retry_at = 0.0

    @contextlib.contextmanager
    def _session(self) -> Iterator[Any]:
        """An idle connected session, or a new one; kept for reuse unless the call fails."""
        with self._lock:
            if time.monotonic() < self._retry_at:
                raise ConnectionError(f"openenv: {self.url} failed; backing off {self._backoff_s:.0f}s")
            client = self._idle.pop() if self._idle else None
        try:
            if client is None:
                timeout = self.config.timeout_s
                from openenv.core.generic_client import GenericEnvClient  # imported when used: see the registry

                client = GenericEnvClient(
                    base_url=self.url, connect_timeout_s=timeout, message_timeout_s=timeout,
                    max_message_size_mb=self.config.max_message_mb,
                ).sync()  # fmt: skip
                client.connect()
            yield client
        except BaseException as exc:
            if client is not None:
                client.close()
            if not isinstance(exc, ScoringFailure):  # the server answered; only failing calls back off
                with self._lock:
                    self._backoff_s = min(max(2 * self._backoff_s, 1.0), _MAX_BACKOFF_S)
                    self._retry_at = time.monotonic() + self._backoff_s
            raise
        with self._lock:
            self._backoff_s, self._retry_at = 0.0, 0.0
            self._idle.append(client)

    def close(self) -> None:
        """Close the idle sessions."""
        with self._lock:
            idle, self._idle = self._idle, []
        for client in idle:
            client.close()

    @staticmethod
    def episode_seed(seed: int, index: int) -> int:
        """The ``reset`` seed of task ``index`` of a batch with seed ``seed`` (fits 31 bits)."""
        return (seed * 1_000_003 + index) % 2**31

    def _prompt(self, observation: dict[str, Any]) -> str:
        prompt = observation.get(self.config.prompt_field)
        if not isinstance(prompt, str):
            raise ValueError(f"observation has no text field {self.config.prompt_field!r}: {sorted(observation)[:20]}")
        if len(prompt) > DEFAULT_LIMITS.max_chars:
            raise ValueError(f"a prompt of {len(prompt)} characters, more than replicas read ({DEFAULT_LIMITS.max_chars})")
        return prompt

    def tasks(self, n: int, *, seed: int) -> list[Task]:
        out = []
        deadline = time.monotonic() + self.config.batch_timeout_s
        with self._session() as client:
            for i in range(n):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"openenv: {i} of {n} tasks after {self.config.batch_timeout_s:g}s")
                episode_seed = self.episode_seed(seed, i)
                observation = client.reset(seed=episode_seed).observation
                kind = (
                    str(observation.get(self.config.type_field) or "openenv") if self.config.type_field else "openenv"
                )
                out.append(Task(f"oe-{seed}-{i}", self._prompt(observation), "", {"type": kind, "seed": episode_seed}))
        return out

    def score(self, task: Task, completion: str) -> float:
        with self._session() as client:
            if self._prompt(client.reset(seed=task.meta["seed"]).observation) != task.prompt:
                raise ScoringFailure("openenv: reset gave another prompt for the same seed")
            result = client.step({self.config.action_field: completion})
        if result.reward is None:
            reason = (
                result.observation.get("metadata", {}).get("failure") if isinstance(result.observation, dict) else None
            )
            raise ScoringFailure(f"openenv: step gave no reward{f' ({reason})' if reason else ''}")
        return result.reward


def from_spec(argument: str, *, chat_template: str = "", settings: OpenEnvConfig | None = None) -> OpenEnvEnvironment:
    """Build the source from ``ENV_ENVIRONMENT=openenv:<url>`` (the server formats its own prompts)."""
    return OpenEnvEnvironment(argument, settings or read_source_settings("openenv"))


register(Kind.ENV_SOURCE, "openenv", "env_space.sources.openenv_client:from_spec", env_prefix="ENV_OPENENV",
         settings="env_space.sources.openenv_client:OpenEnvConfig", package="openenv-core", requires=("openenv",),
         summary="an OpenEnv environment server, one step per episode", example="openenv:http://127.0.0.1:8000")
