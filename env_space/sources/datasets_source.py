"""A dataset scored by TRL-style reward functions: ``ENV_ENVIRONMENT=dataset:openai/gsm8k``.

The argument names a Hub dataset (loaded with ``datasets.load_dataset(name, subset, split=...)``)
or a local folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` (loaded
with ``datasets.load_from_disk``). Batch seed ``s`` draws rows at random (with
replacement) from the split, task id ``ds-<s>-<i>-<row>``. The prompt column is a
string (wrapped as a user message, after the optional system prompt) or a list of
chat messages (TRL's conversational form); it is rendered with ``ENV_CHAT_TEMPLATE``.

The reward is TRL's: the weighted sum of the reward functions' values
(``ENV_DATASET_REWARDS=math_verify=1,format=0.2,my_pkg.rewards.brevity=0.5``), skipping a
function that returns ``None`` for the sample. Each function call is bounded by
``reward_timeout_s`` and runs in a child process that is killed when a call overstays
(``reward_isolation=process``, :mod:`.reward_worker`) or in a forked, confined child per
call (``thread``, :func:`env_space.isolation.call_bounded`); one that raises, overstays, returns a
non-finite value or the wrong number of values fails the sample with that reason,
and the simulator scores it ``failure_reward``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import TYPE_CHECKING, Any

from env_space.bounded import ScoringFailure, finite_reward
from env_space.isolation import call_bounded, modules_of, start_scoring_server
from env_space.environments import Environment, Scoring, Task
from rlsync.registry import Kind, register

from . import parse_weighted
from .prompts import render_prompt
from .reward_worker import RewardWorker
from .settings import read_source_settings

if TYPE_CHECKING:  # imported when used: the registry imports this module for its settings only
    import datasets

    from .rewards import RewardFunction

__all__ = ["DatasetEnvironment", "DatasetSourceConfig", "from_spec", "load_split"]

_NOT_COLUMNS = ("prompt", "completion", "completion_ids", "prompts", "completions")  # as TRL: not passed by name


@dataclasses.dataclass
class DatasetSourceConfig:
    """Settings of the dataset source (environment variables ``ENV_DATASET_<FIELD>``)."""

    subset: str = dataclasses.field(default="", metadata={"help": "dataset configuration name, e.g. main for gsm8k"})
    split: str = dataclasses.field(default="train", metadata={"help": "split to draw prompts from"})
    prompt_column: str = dataclasses.field(default="prompt", metadata={"help": "column with the prompt (text or chat messages)"})
    answer_column: str = dataclasses.field(default="answer", metadata={"help": "column with the reference answer"})
    type_column: str = dataclasses.field(default="", metadata={"help": "column naming the task type for the panel ('' = none)"})
    rewards: str = dataclasses.field(
        default="math_verify", metadata={"help": "reward functions with weights: NAME[=W],... (built-in or module.function)"}
    )
    system_prompt: str = dataclasses.field(default="", metadata={"help": "system message put before string prompts ('' = none)"})
    answer_tag: str = dataclasses.field(default="answer", metadata={"help": "tag of the final answer for exact_match and format"})
    reward_timeout_s: float = dataclasses.field(default=5.0, metadata={"help": "time bound of one reward function call"})
    reward_isolation: str = dataclasses.field(
        default="process",
        metadata={"help": "process (one confined worker, killed when a call overstays) or thread (a confined fork per call)"},
    )


def load_split(name: str, subset: str, split: str) -> datasets.Dataset:
    """A local ``save_to_disk`` folder, or a Hub dataset, as one split.

    Raises:
        ValueError: The split is missing.
    """
    import datasets

    if os.path.isdir(name):
        loaded = datasets.load_from_disk(name)
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise ValueError(f"{name} has splits {list(loaded)}, not {split!r}")
            loaded = loaded[split]
        return loaded
    return datasets.load_dataset(name, subset or None, split=split)


class DatasetEnvironment(Environment):
    """Prompts from a dataset, rewards from TRL-style reward functions.

    Args:
        dataset: The split to draw from.
        name: Display name (the dataset's id or path).
        config: Columns, reward functions, prompt settings.
        chat_template: Model id or path whose chat template renders the prompt (``""``: plain).

    Raises:
        ValueError: A missing column, an empty dataset, or a reward that cannot be loaded.
    """

    scoring = Scoring.SELF_BOUNDED  # each reward call runs confined (reward worker, or call_bounded)

    def __init__(
        self, dataset: datasets.Dataset, name: str, config: DatasetSourceConfig | None = None, chat_template: str = ""
    ) -> None:
        from .rewards import load_reward

        self.config = config or DatasetSourceConfig()
        self.dataset = dataset
        self.name = f"dataset:{name}"
        self.chat_template = chat_template
        columns = [self.config.prompt_column, self.config.answer_column] + (
            [self.config.type_column] if self.config.type_column else []
        )
        missing = [c for c in columns if c not in dataset.column_names]
        if missing or len(dataset) == 0:
            raise ValueError(f"{name}: missing columns {missing} (has {dataset.column_names}) or no rows")
        self.rewards: list[tuple[str, float, RewardFunction]] = [
            (
                reward,
                weight,
                load_reward(reward, answer_column=self.config.answer_column, answer_tag=self.config.answer_tag),
            )
            for reward, weight in parse_weighted(self.config.rewards).items()
        ]
        self.conversational = isinstance(dataset[0][self.config.prompt_column], list)
        if self.config.reward_isolation not in ("process", "thread"):
            raise ValueError(f"reward_isolation must be process or thread, got {self.config.reward_isolation!r}")
        self.worker = (
            RewardWorker([r for r, _, _ in self.rewards], self.config.answer_column, self.config.answer_tag)
            if self.config.reward_isolation == "process"
            else None
        )
        if self.worker is None:  # each call's confined child comes from the scoring server, warm
            start_scoring_server([m for _, _, fn in self.rewards for m in modules_of(fn)])

    def _messages(self, prompt: Any) -> list[dict[str, Any]]:
        system = [{"role": "system", "content": self.config.system_prompt}] if self.config.system_prompt else []
        if isinstance(prompt, list):
            return prompt if any(m.get("role") == "system" for m in prompt) else system + prompt
        return system + [{"role": "user", "content": str(prompt)}]

    def tasks(self, n: int, *, seed: int) -> list[Task]:
        rng = self.rng(seed)
        rows = [rng.randrange(len(self.dataset)) for _ in range(n)]
        out = []
        for i, index in enumerate(rows):
            row = self.dataset[index]
            messages = self._messages(row[self.config.prompt_column])
            kind = str(row[self.config.type_column]) if self.config.type_column else self.name.partition(":")[2]
            meta = {"type": kind, "row": row, "messages": messages}
            out.append(
                Task(
                    f"ds-{seed}-{i}-{index}",
                    render_prompt(messages, self.chat_template),
                    str(row[self.config.answer_column]),
                    meta,
                )
            )
        return out

    def score(self, task: Task, completion: str) -> float:
        row = task.meta["row"]
        prompt = row[self.config.prompt_column]
        done = [{"role": "assistant", "content": completion}] if self.conversational else completion
        columns = {k: [v] for k, v in row.items() if k not in _NOT_COLUMNS}
        total, applied = 0.0, 0
        for name, weight, fn in self.rewards:
            kwargs = {"prompts": [prompt], "completions": [done], **columns}  # by keyword, as TRL calls
            if self.worker is not None:
                result = self.worker.call(name, self.config.reward_timeout_s, **kwargs)
            else:
                result = call_bounded(functools.partial(fn, **kwargs), timeout_s=self.config.reward_timeout_s)
            if result.ok and (not isinstance(result.value, (list, tuple)) or len(result.value) != 1):
                raise ScoringFailure(f"reward {name}: not one value per completion")
            if result.ok and result.value[0] is None:
                continue
            if result.ok:
                result = finite_reward(result.value[0])
            if not result.ok:
                raise ScoringFailure(f"reward {name}: {result.failure}")
            total += weight * result.value
            applied += 1
        if not applied:
            raise ScoringFailure("no reward function applies")
        return total

    def close(self) -> None:
        """Stop the reward worker process (if any)."""
        if self.worker is not None:
            self.worker.close()


def from_spec(
    argument: str, *, chat_template: str = "", settings: DatasetSourceConfig | None = None
) -> DatasetEnvironment:
    """Build the source from ``ENV_ENVIRONMENT=dataset:<name or path>``."""
    config = settings or read_source_settings("dataset")
    return DatasetEnvironment(load_split(argument, config.subset, config.split), argument, config, chat_template)


register(Kind.ENV_SOURCE, "dataset", "env_space.sources.datasets_source:from_spec", env_prefix="ENV_DATASET",
         settings="env_space.sources.datasets_source:DatasetSourceConfig", package="datasets math-verify",
         summary="a Hub dataset or one saved with save_to_disk, scored by TRL-style reward functions",
         requires=("datasets", "math_verify"), example="dataset:openai/gsm8k")
