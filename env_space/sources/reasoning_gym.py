"""reasoning-gym generators as an environment: ``ENV_ENVIRONMENT=reasoning_gym:leg_counting=2,basic_arithmetic``.

Tasks come from reasoning-gym's ``composite`` dataset, the library's own weighted mix
of generators: batch seed ``s`` and position ``i`` always give the same entry, id
``rg-<s>-<i>``. The prompt is the chat ``[system prompt, question]`` (rendered with
the policy's chat template when ``ENV_CHAT_TEMPLATE`` is set); the system prompt asks
for the final answer inside ``<answer>...</answer>``. Scoring extracts the last such
tag with ``reasoning_gym.utils.extract_answer`` and calls the generator's own
``score_answer(answer, entry)``, exactly as reasoning-gym's evaluation does; a
completion without the tag scores what the verifier gives ``None`` (0). Loading reasoning-gym
(when the first environment is made: the registry imports this module for its settings only)
puts :func:`~env_space.sources.evaluators.guard_evaluators` in front of the
evaluators some verifiers call on the answer (sympy's ``parse_expr``, ``eval``), and the
simulator scores in a confined child (:attr:`~env_space.environments.Scoring.CONFINED`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

from env_space.environments import Environment, Task
from rlsync.registry import Kind, register

from . import parse_weighted
from .prompts import render_prompt
from .settings import read_source_settings

__all__ = ["ReasoningGymConfig", "ReasoningGymEnvironment", "from_spec"]


@dataclasses.dataclass
class ReasoningGymConfig:
    """Settings of the reasoning-gym source (environment variables ``ENV_RG_<FIELD>``)."""

    level: int = dataclasses.field(
        default=-1,
        metadata={
            "help": "difficulty: curriculum level of every generator (0 = easiest); -1 = the generators' defaults"
        },
    )
    overrides: str = dataclasses.field(
        default="", metadata={"help": 'JSON: generator config fields, e.g. {"leg_counting": {"max_animals": 4}}'}
    )
    system_prompt: str = dataclasses.field(
        default="default", metadata={"help": "a key of reasoning_gym.utils.SYSTEM_PROMPTS, or the text itself"}
    )
    answer_tag: str = dataclasses.field(
        default="answer", metadata={"help": "tag holding the final answer: <answer>...</answer>"}
    )


@functools.cache
def _library() -> Any:
    """reasoning-gym, imported when first used, with the guards in front of its evaluators."""
    import reasoning_gym
    import reasoning_gym.composite
    import reasoning_gym.utils

    from .evaluators import guard_evaluators

    guard_evaluators()
    return reasoning_gym


def _generator_config(name: str, level: int, overrides: dict[str, Any]) -> dict[str, Any]:
    reasoning_gym = _library()
    config: dict[str, Any] = {}
    if level >= 0 and name in reasoning_gym.factory.CURRICULA:
        curriculum = reasoning_gym.factory.create_curriculum(name)
        curriculum.set_global_level(level)
        generated = curriculum.generate_configuration()
        config = {k: v for k, v in dataclasses.asdict(generated).items() if k not in ("seed", "size")}
    return {**config, **overrides}


class ReasoningGymEnvironment(Environment):
    """A weighted mix of reasoning-gym generators.

    Args:
        generators: Generator name -> sampling weight.
        config: Difficulty, prompt and extraction settings.
        chat_template: Model id or path whose chat template renders the prompt (``""``: plain).

    Raises:
        ValueError: Unknown generator, bad override, or bad settings.
    """

    def __init__(
        self, generators: dict[str, float], config: ReasoningGymConfig | None = None, chat_template: str = ""
    ) -> None:
        reasoning_gym = _library()
        self.config = config or ReasoningGymConfig()
        self.chat_template = chat_template
        self.name = "reasoning_gym:" + ",".join(f"{g}={w:g}" for g, w in generators.items())
        unknown = sorted(set(generators) - set(reasoning_gym.factory.DATASETS))
        if unknown:
            raise ValueError(f"unknown reasoning-gym generators {unknown}; see reasoning_gym.factory.DATASETS")
        overrides = json.loads(self.config.overrides) if self.config.overrides.strip() else {}
        if not isinstance(overrides, dict) or not all(isinstance(v, dict) for v in overrides.values()):
            raise ValueError("ENV_RG_OVERRIDES must be a JSON object of objects, one per generator")
        if set(overrides) - set(generators):
            raise ValueError(f"overrides name generators not selected: {sorted(set(overrides) - set(generators))}")
        self.specs = [
            reasoning_gym.composite.DatasetSpec(g, w, _generator_config(g, self.config.level, overrides.get(g, {})))
            for g, w in generators.items()
        ]
        self.system_prompt = reasoning_gym.utils.SYSTEM_PROMPTS.get(self.config.system_prompt, self.config.system_prompt)
        self.verifiers = self._composite(1, seed=0).datasets  # name -> generator, for score_answer

    def _composite(self, n: int, *, seed: int) -> Any:
        try:
            return _library().create_dataset("composite", size=max(n, 1), seed=seed, datasets=self.specs)
        except (AssertionError, TypeError) as exc:  # the library validates configs with assert
            raise ValueError(f"invalid reasoning-gym settings: {exc}") from exc

    def tasks(self, n: int, *, seed: int) -> list[Task]:
        dataset = self._composite(n, seed=seed)
        out = []
        for i in range(n):
            entry = dataset[i]
            messages = [
                {"role": "system", "content": self.system_prompt},
                {"role": "user", "content": entry["question"]},
            ]
            meta = {"type": entry["metadata"]["source_dataset"], "entry": entry, "messages": messages}
            out.append(Task(f"rg-{seed}-{i}", render_prompt(messages, self.chat_template), str(entry["answer"]), meta))
        return out

    def score(self, task: Task, completion: str) -> float:
        entry = task.meta["entry"]
        answer = _library().utils.extract_answer(completion, tag_name=self.config.answer_tag)
        return float(self.verifiers[entry["metadata"]["source_dataset"]].score_answer(answer=answer, entry=entry))


def from_spec(
    argument: str, *, chat_template: str = "", settings: ReasoningGymConfig | None = None
) -> ReasoningGymEnvironment:
    """Build the source from ``ENV_ENVIRONMENT=reasoning_gym:<argument>``."""
    config = settings or read_source_settings("reasoning_gym")
    return ReasoningGymEnvironment(parse_weighted(argument), config, chat_template)


register(Kind.ENV_SOURCE, "reasoning_gym", "env_space.sources.reasoning_gym:from_spec", env_prefix="ENV_RG",
         settings="env_space.sources.reasoning_gym:ReasoningGymConfig", summary="reasoning-gym generators with weights",
         package="reasoning-gym", requires=("reasoning_gym", "sympy"),
         example="reasoning_gym:leg_counting=2,basic_arithmetic")
