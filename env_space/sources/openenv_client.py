"""An OpenEnv environment server as a task source: ``ENV_ENVIRONMENT=openenv:http://host:8000``.

Single-step episodes through openenv-core's ``GenericEnvClient`` (WebSocket, no
environment-specific package needed): task ``i`` of batch seed ``s`` is the
observation of ``reset(seed=<s, i>)``, its text field ``ENV_OPENENV_PROMPT_FIELD`` the
prompt; scoring opens a new episode with the same seed, checks that the server gives
the same prompt again (so the server must reset reproducibly by seed), sends the
completion as the action's ``ENV_OPENENV_ACTION_FIELD`` in one ``step`` and takes the
step result's ``reward``. No episode stays open between publishing a task and scoring
it, so the server may restart in between. One WebSocket session is reused from call
to call; a call that fails (or overstays its bound) discards its session.

Defaults fit text environments whose action is ``{"message": ...}`` and whose
observation has a ``prompt`` (TextArena-style, and this project's own
:mod:`env_space.sources.openenv_server`). Multi-turn episodes are out of scope: see
that module's docstring for how they would fit.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from openenv.core.generic_client import GenericEnvClient

from env_space.bounded import ScoringFailure
from env_space.environments import Environment, Scoring, Task

from .settings import OpenEnvConfig

__all__ = ["OpenEnvEnvironment", "from_spec"]


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

    @contextlib.contextmanager
    def _session(self) -> Iterator[Any]:
        """An idle connected session, or a new one; kept for reuse unless the call fails."""
        with self._lock:
            client = self._idle.pop() if self._idle else None
        if client is None:
            timeout = self.config.timeout_s
            client = GenericEnvClient(base_url=self.url, connect_timeout_s=timeout, message_timeout_s=timeout).sync()
            client.connect()
        try:
            yield client
        except BaseException:
            client.close()
            raise
        with self._lock:
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
            raise ValueError(f"observation has no text field {self.config.prompt_field!r}: {sorted(observation)}")
        return prompt

    def tasks(self, n: int, *, seed: int) -> list[Task]:
        out = []
        with self._session() as client:
            for i in range(n):
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
    return OpenEnvEnvironment(argument, settings or OpenEnvConfig.from_env())
