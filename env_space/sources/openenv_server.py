"""Serve one of our environments as an OpenEnv server (single-step episodes).

``python -m env_space.sources.openenv_server --environment reasoning_gym:leg_counting --port 8000``
serves any environment ``ENV_ENVIRONMENT`` accepts over OpenEnv's HTTP/WebSocket API
(``openenv.core.env_server.create_app``), so OpenEnv clients (TRL's OpenEnv
integration, ``GenericEnvClient``, and this Space's own ``openenv:`` source) can use
it: ``reset(seed=s)`` gives the observation ``{"prompt", "task_id", "task_type"}`` of
task ``s``, and ``step({"message": completion})`` scores it and ends the episode
(``done=True``, ``reward``; a scoring failure gives ``reward=None`` and its reason in
``metadata["failure"]``). Scoring is bounded in time as in the simulator.

Multi-turn episodes would keep the episode open instead: ``step`` would return the
next observation with ``done=False`` until the environment ends it; on our side
the replica would then have to call the environment between turns, which the
bucket exchange (one completion per task) does not do yet.
"""

from __future__ import annotations

import argparse
import uuid
from typing import Any

from openenv.core.env_server import Action, Observation, State, create_app
from openenv.core.env_server import Environment as OpenEnvEnvironment

from env_space.bounded import finite_reward
from env_space.isolation import call_bounded, modules_of, start_scoring_server
from env_space.environments import Environment, Task

__all__ = ["CompletionAction", "PromptObservation", "SingleStepEpisode", "build_app", "main"]


class CompletionAction(Action):
    """The model's completion of the prompt."""

    message: str


class PromptObservation(Observation):
    """The task's prompt (after ``reset``) or the scored result (after ``step``)."""

    prompt: str = ""
    task_id: str = ""
    task_type: str = ""


class SingleStepEpisode(OpenEnvEnvironment):
    """An OpenEnv environment whose episodes are one task of ``environment``: reset -> prompt, step -> reward.

    Args:
        environment: Our environment (any source).
        score_timeout_s: Time bound of one scoring call.
    """

    SUPPORTS_CONCURRENT_SESSIONS = True  # each session holds only its own task

    def __init__(self, environment: Environment, score_timeout_s: float = 10.0) -> None:
        super().__init__()
        self.environment = environment
        self.score_timeout_s = score_timeout_s
        self._task: Task | None = None
        self._state = State()

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> PromptObservation:
        self._task = self.environment.tasks(1, seed=0 if seed is None else int(seed))[0]
        self._state = State(episode_id=episode_id or str(uuid.uuid4()), step_count=0)
        return self._observation()

    def step(self, action: CompletionAction, timeout_s: float | None = None, **kwargs: Any) -> PromptObservation:
        if self._task is None:
            raise RuntimeError("call reset before step")
        self._state.step_count += 1
        result = call_bounded(self.environment.score, self._task, action.message, timeout_s=self.score_timeout_s)
        if result.ok:
            result = finite_reward(result.value)
        observation = self._observation(done=True, reward=result.value if result.ok else None)
        if not result.ok:
            observation.metadata["failure"] = result.failure
        self._task = None
        return observation

    def _observation(self, **fields: Any) -> PromptObservation:
        task = self._task
        kind = str(task.meta.get("type", self.environment.name)) if task else ""
        return PromptObservation(
            prompt=task.prompt if task else "", task_id=task.task_id if task else "", task_type=kind, **fields
        )

    @property
    def state(self) -> State:
        return self._state


def build_app(environment: Environment, *, score_timeout_s: float = 10.0, max_sessions: int = 64) -> Any:
    """The FastAPI app serving ``environment`` with OpenEnv's server (``uvicorn.run(app)``)."""
    start_scoring_server(modules_of(environment.score))  # each score's confined child comes from it, warm
    return create_app(
        lambda: SingleStepEpisode(environment, score_timeout_s),
        CompletionAction,
        PromptObservation,
        env_name=environment.name,
        max_concurrent_envs=max_sessions,
    )


def main(argv: list[str] | None = None) -> None:
    """Command line: serve ``--environment`` on ``--host``:``--port``."""
    import uvicorn

    from env_space.sources import open_environment

    parser = argparse.ArgumentParser(
        prog="python -m env_space.sources.openenv_server", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--environment", default="reverse", help="what ENV_ENVIRONMENT accepts")
    parser.add_argument("--chat-template", default="", help="model id/path whose chat template formats prompts")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--score-timeout-s", type=float, default=10.0)
    args = parser.parse_args(argv)
    environment = open_environment(args.environment, chat_template=args.chat_template)
    uvicorn.run(build_app(environment, score_timeout_s=args.score_timeout_s), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
