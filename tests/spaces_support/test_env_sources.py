"""Environment sources: reasoning-gym and datasets + TRL-style rewards, each scoring as the library itself does,
and hostile reward functions that raise, hang or return NaN without stopping the environment."""

from __future__ import annotations

import collections
import math
import textwrap
import time

import datasets
import pytest
import reasoning_gym
from math_verify import parse, verify
from reasoning_gym.utils import extract_answer

from env_space.simulator import EnvConfig, EnvSimulator
from env_space.sources import open_environment, parse_weighted
from env_space.sources.rewards import format_reward
from env_space.sources.settings import DatasetSourceConfig, ReasoningGymConfig
from rlsync.layout import rollout_key, score_key, task_key
from rlsync.spaces.exchange import Sample, get_json, read_samples, write_samples

RG_SPEC = "reasoning_gym:leg_counting=2,basic_arithmetic"


def _completions(answer: str) -> dict[str, str]:
    """Scripted completions: correct, wrong, malformed (no answer tag)."""
    return {
        "correct": f"Let me count.\n<answer>{answer}</answer>",
        "wrong": f"<answer>{answer}9</answer>",
        "malformed": f"The answer is {answer}",
    }


# -- reasoning-gym ------------------------------------------------------------------------


def test_reasoning_gym_tasks_are_seeded_and_mix_two_generators():
    env = open_environment(RG_SPEC, settings=ReasoningGymConfig())
    a, b, c = env.tasks(40, seed=7), env.tasks(40, seed=7), env.tasks(40, seed=8)
    assert [(t.task_id, t.prompt, t.answer) for t in a] == [(t.task_id, t.prompt, t.answer) for t in b]
    assert [t.prompt for t in a] != [t.prompt for t in c]
    assert len({t.task_id for t in a}) == 40
    kinds = [t.meta["type"] for t in a]
    assert set(kinds) == {"leg_counting", "basic_arithmetic"}
    assert kinds.count("leg_counting") > kinds.count("basic_arithmetic")  # weight 2 vs 1
    # the task is the library's own entry for (seed, index) of its composite dataset
    library = reasoning_gym.create_dataset("composite", size=40, seed=7, datasets=env.specs)
    assert [t.answer for t in a] == [str(library[i]["answer"]) for i in range(40)]
    assert all(library[i]["question"] in t.prompt and "<answer>" in t.prompt for i, t in enumerate(a))


def test_reasoning_gym_scores_as_the_library_does():
    env = open_environment(RG_SPEC, settings=ReasoningGymConfig())
    seen = {"correct": [], "wrong": [], "malformed": []}
    for task in env.tasks(30, seed=1):
        entry = task.meta["entry"]
        verifier = reasoning_gym.create_dataset(entry["metadata"]["source_dataset"], size=1, seed=0)
        for kind, completion in _completions(task.answer).items():
            ours = env.score(task, completion)
            assert ours == verifier.score_answer(answer=extract_answer(completion), entry=entry), (task.task_id, kind)
            seen[kind].append(ours)
    assert all(s == 1.0 for s in seen["correct"])
    assert all(s < 1.0 for s in seen["wrong"]) and all(s == 0.0 for s in seen["malformed"])


def test_reasoning_gym_difficulty_and_overrides_reach_the_generators():
    easy = open_environment("reasoning_gym:leg_counting", settings=ReasoningGymConfig(level=0))
    hard = open_environment(
        "reasoning_gym:leg_counting",
        settings=ReasoningGymConfig(level=3, overrides='{"leg_counting": {"max_animals": 2}}'),
    )
    easy_n = [t.meta["entry"]["metadata"]["num_animals"] for t in easy.tasks(50, seed=0)]
    hard_tasks = hard.tasks(50, seed=0)
    assert max(t.meta["entry"]["metadata"]["num_animals"] for t in hard_tasks) <= 2  # the override
    assert max(sum(t.meta["entry"]["metadata"]["animals"].values()) for t in hard_tasks) > max(easy_n) * 4  # the level
    with pytest.raises(ValueError, match="unknown reasoning-gym generators"):
        open_environment("reasoning_gym:no_such_generator", settings=ReasoningGymConfig())
    with pytest.raises(ValueError, match="not selected"):
        open_environment(
            "reasoning_gym:leg_counting", settings=ReasoningGymConfig(overrides='{"basic_arithmetic": {}}')
        )


def test_weighted_lists_parse_and_reject():
    assert parse_weighted("a=2, b ,c=0.5") == {"a": 2.0, "b": 1.0, "c": 0.5}
    for bad in ("a,a", "a=0", "a=-1", "a=nan", "=2", ""):
        with pytest.raises(ValueError):
            parse_weighted(bad)


# -- datasets + reward functions -------------------------------------------------------------


USER_REWARDS = """
def brevity(prompts, completions, answer, **columns):
    return [1.0 / (1 + len(c)) for c in completions]

def hostile(prompts, completions, **columns):
    text = completions[0]
    if "raise" in text:
        raise RuntimeError("user bug")
    if "sleep" in text:
        import time
        time.sleep(3)
    if "nan" in text:
        return [float("nan")]
    if "many" in text:
        return [1.0, 1.0]
    if "spin" in text:
        while True:  # CPU-bound, never returns: only a process can be stopped
            pass
    if "exit" in text:
        import os
        os._exit(3)  # the process dies under the call
    return [0.5]
"""


@pytest.fixture
def local_dataset(tmp_path, monkeypatch):
    """A small math dataset saved with save_to_disk, and a user module of reward functions on sys.path."""
    path = tmp_path / "math"
    datasets.Dataset.from_dict({
        "question": ["What is 1/2 + 1/4?", "Compute 2^10.", "Solve x + 3 = 5 for x.", "What is 0.1 * 30?"],
        "answer": ["\\frac{3}{4}", "1024", "2", "3"],
        "topic": ["fractions", "powers", "algebra", "decimals"],
    }).save_to_disk(str(path))  # fmt: skip
    (tmp_path / "user_rewards.py").write_text(textwrap.dedent(USER_REWARDS))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("ENV_REWARD_ALLOW", "user_rewards.brevity,user_rewards.no_such_function")  # the operator's list
    return str(path)


def _dataset_env(path: str, rewards: str, **kw):
    config = DatasetSourceConfig(prompt_column="question", type_column="topic", rewards=rewards, **kw)
    return open_environment(f"dataset:{path}", settings=config)


def test_dataset_tasks_are_seeded_rows_of_the_split(local_dataset):
    env = _dataset_env(local_dataset, "math_verify", system_prompt="Put the answer in <answer></answer>.")
    rows = datasets.load_from_disk(local_dataset)
    tasks = env.tasks(12, seed=3)
    assert tasks == env.tasks(12, seed=3) and tasks != env.tasks(12, seed=4)
    for t in tasks:
        row = rows[int(t.task_id.rsplit("-", 1)[1])]
        assert t.prompt.startswith("Put the answer") and row["question"] in t.prompt
        assert t.answer == row["answer"] and t.meta["type"] == row["topic"]


def test_dataset_math_verify_and_user_reward_score_as_the_libraries_do(local_dataset):
    import user_rewards

    env = _dataset_env(local_dataset, "math_verify=1,user_rewards.brevity=0.5")
    for task in env.tasks(8, seed=0):
        reference = task.answer
        scripted = {
            "correct": f"so the result is ${reference}$",
            "wrong": "so the result is $7/9$",
            "malformed": "no idea",
        }
        for kind, completion in scripted.items():
            expected = (
                float(verify(parse(reference), parse(completion)))
                + 0.5 * user_rewards.brevity([task.meta["row"]["question"]], [completion], answer=[reference])[0]
            )
            assert env.score(task, completion) == pytest.approx(expected, abs=0), (task.task_id, kind)
        assert env.score(task, scripted["correct"]) > env.score(task, scripted["wrong"])


def test_builtin_exact_match_and_format(local_dataset):
    env = _dataset_env(local_dataset, "exact_match,format=0.25")
    task = next(t for t in env.tasks(20, seed=0) if t.answer == "1024")
    assert env.score(task, "<answer> 1024 </answer>") == 1.25
    assert env.score(task, "1024") == 1.0  # no tag: the whole completion is the answer; format fails
    assert env.score(task, "<answer>1023</answer>") == 0.25
    assert env.score(task, "<answer>1024</answer> and more text") == 1.0  # format: the tag must end it
    assert format_reward(["p"], ["<answer>1</answer><answer>2</answer>"]) == [0.0]


def test_conversational_prompts_get_trl_style_completions(tmp_path, monkeypatch):
    def spy(prompts, completions, **columns):  # runs in a confined child: it answers with what it saw
        return [
            float(prompts == [[{"role": "user", "content": "hi"}]])
            + 2 * float(completions == [[{"role": "assistant", "content": "hello"}]])
            + 4 * float(columns["answer"] == ["x"] and "prompt" not in columns)
        ]

    monkeypatch.setattr("env_space.sources.rewards.BUILTIN_REWARDS", {"spy": spy})
    path = str(tmp_path / "chat")
    datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": "hi"}]], "answer": ["x"]}).save_to_disk(path)
    env = open_environment(f"dataset:{path}", settings=DatasetSourceConfig(rewards="spy", reward_isolation="thread"))
    task = env.tasks(1, seed=0)[0]
    assert env.score(task, "hello") == 7.0  # prompts, completions and columns as TRL passes them


def test_dataset_source_rejects_bad_settings(local_dataset):
    with pytest.raises(ValueError, match="missing columns"):
        _dataset_env(local_dataset, "math_verify", answer_column="solution")
    with pytest.raises(ValueError, match="cannot be imported"):
        _dataset_env(local_dataset, "user_rewards.no_such_function")
    with pytest.raises(ValueError, match="dotted path"):
        _dataset_env(local_dataset, "nonsense")


# -- robustness: hostile user code inside the running simulator ---------------------------


def _rollouts(bucket, batch: int, completions: list[str]) -> None:
    doc = get_json(bucket, task_key(batch))
    samples = [Sample(t["task_id"], t["prompt"], c, [1], [2], [-0.5], 0) for t in doc["tasks"] for c in completions]
    write_samples(bucket, rollout_key(batch, "r0"), samples, batch=batch)


HOSTILE = {  # completion -> (reward, failure reason); "spin" and "exit" only where a process can take them
    "fine": (0.5, None),
    "raise": (-1.0, "error:RuntimeError"),
    "sleep": (-1.0, "timeout"),
    "nan": (-1.0, "non_finite"),
    "many": (-1.0, "not one value per completion"),
    "spin": (-1.0, "timeout"),
    "exit": (-1.0, "worker_died"),
}


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_hostile_reward_function_is_bounded_counted_and_never_stops_the_env(
    local_dataset, bucket, monkeypatch, isolation
):
    monkeypatch.setenv("ENV_DATASET_PROMPT_COLUMN", "question")
    monkeypatch.setenv("ENV_DATASET_REWARDS", "user_rewards.hostile,exact_match")
    monkeypatch.setenv("ENV_DATASET_REWARD_TIMEOUT_S", "0.3")
    monkeypatch.setenv("ENV_DATASET_TYPE_COLUMN", "topic")
    monkeypatch.setenv("ENV_DATASET_REWARD_ISOLATION", isolation)
    config = EnvConfig(
        bucket=str(bucket.root), environment=f"dataset:{local_dataset}", tasks_per_batch=2, failure_reward=-1.0
    )
    env = EnvSimulator(config, bucket=bucket)
    batch = env.publish_tasks()
    completions = [c for c in HOSTILE if isolation == "process" or c not in ("spin", "exit")]
    _rollouts(bucket, batch, completions)
    start = time.monotonic()
    assert env.score_rollouts() == 2 * len(completions)
    assert time.monotonic() - start < 30  # the 3 s sleeps and endless loops are cut at the bound, not waited out
    rewards = {s.completion: s.reward for s in read_samples(bucket, score_key(batch, "r0"))[1]}
    assert rewards == {c: HOSTILE[c][0] for c in completions}
    expected = collections.Counter(HOSTILE[c][1] for c in completions if HOSTILE[c][1])
    assert env.failures.as_dict() == {f"score: reward user_rewards.hostile: {r}": 2 * n for r, n in expected.items()}
    env.step()  # the loop goes on and publishes the counts
    metrics = get_json(bucket, "metrics/env.json")
    assert sum(metrics["failures"].values()) == 2 * sum(expected.values())
    topics = {"dataset / fractions", "dataset / powers", "dataset / algebra", "dataset / decimals"}
    assert set(metrics["by_type"]) <= topics
    assert sum(v["count"] for v in metrics["by_type"].values()) == 2 * len(completions)
    if isolation == "process":
        assert env.environment.worker.restarts == 6  # killed after each sleep and spin, replaced after each exit
    env.stop()


def test_hostile_scorer_is_bounded_for_any_environment(bucket, monkeypatch):
    """The simulator's own bound covers verifiers and environments too, not only reward functions."""
    env = EnvSimulator(
        EnvConfig(bucket=str(bucket.root), environment="reverse", tasks_per_batch=1, score_timeout_s=0.3), bucket=bucket
    )
    original = env.environment.score

    def hostile(task, completion):
        if completion == "raise":
            raise KeyError("bug")
        if completion == "sleep":
            time.sleep(3)
        if completion == "nan":
            return math.nan
        if completion == "inf":
            return -math.inf
        return original(task, completion)

    monkeypatch.setattr(env.environment, "score", hostile)
    batch = env.publish_tasks()
    answer = env.environment.tasks(1, seed=get_json(bucket, task_key(batch))["seed"])[0].answer
    _rollouts(bucket, batch, [answer, "raise", "sleep", "nan", "inf"])
    assert env.score_rollouts() == 5
    rewards = [s.reward for s in read_samples(bucket, score_key(batch, "r0"))[1]]
    assert rewards == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert env.failures.as_dict() == {"score: error:KeyError": 1, "score: timeout": 1, "score: non_finite": 2}


def test_simulator_publishes_and_scores_reasoning_gym_through_the_bucket(bucket):
    config = EnvConfig(bucket=str(bucket.root), environment=RG_SPEC, tasks_per_batch=4)
    env = EnvSimulator(config, bucket=bucket)
    batch = env.publish_tasks()
    doc = get_json(bucket, task_key(batch))
    assert doc["env"] == "reasoning_gym:leg_counting=2,basic_arithmetic=1"
    assert all("answer" not in t for t in doc["tasks"])  # answers stay in the environment
    tasks = {t.task_id: t for t in env.environment.tasks(4, seed=doc["seed"])}
    samples = []
    for t in doc["tasks"]:
        for completion in _completions(tasks[t["task_id"]].answer).values():
            samples.append(Sample(t["task_id"], t["prompt"], completion, [1], [2], [-0.5], 0))
    samples.append(
        Sample(
            doc["tasks"][0]["task_id"], "a prompt that was never published", "<answer>1</answer>", [1], [2], [0.0], 0
        )
    )
    write_samples(bucket, rollout_key(batch, "r0"), samples, batch=batch)
    assert env.score_rollouts() == 12  # the sample with a foreign prompt is dropped and counted
    scored = read_samples(bucket, score_key(batch, "r0"))[1]
    assert [s.reward for s in scored][::3] == [1.0] * 4 and all(s.reward == 0.0 for s in scored[2::3])
    assert env.failures.as_dict() == {"rollouts: unknown task or changed prompt": 1}
    env.step()
    by_type = get_json(bucket, "metrics/env.json")["by_type"]
    assert set(by_type) <= {"reasoning_gym / leg_counting", "reasoning_gym / basic_arithmetic"}
    assert sum(v["count"] for v in by_type.values()) == 12


@pytest.mark.parametrize("module, cls, prefix", [
    ("env_space.sources.settings", "ReasoningGymConfig", "ENV_RG"),
    ("env_space.sources.settings", "DatasetSourceConfig", "ENV_DATASET"),
    ("env_space.sources.settings", "OpenEnvConfig", "ENV_OPENENV"),
])  # fmt: skip
def test_readme_documents_every_source_setting(module, cls, prefix):
    import importlib
    from pathlib import Path

    from rlsync.spaces.settings import settings_table

    readme = (Path(__file__).resolve().parents[2] / "env_space" / "README.md").read_text(encoding="utf-8")
    for variable, default, _ in settings_table(getattr(importlib.import_module(module), cls), prefix):
        assert f"| `{variable}` | `{default}` |" in readme, variable


def test_chat_template_renders_the_published_prompts(tmp_path, bucket):
    """ENV_CHAT_TEMPLATE: the prompts replicas get are the tokenizer's chat rendering of the source's messages."""
    from rlsync.spaces.tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    tokenizer.save_pretrained(tmp_path / "tok")
    config = EnvConfig(
        bucket=str(bucket.root), environment=RG_SPEC, chat_template=str(tmp_path / "tok"), tasks_per_batch=3
    )
    env = EnvSimulator(config, bucket=bucket)
    doc = get_json(bucket, task_key(env.publish_tasks()))
    for published, task in zip(doc["tasks"], env.environment.tasks(3, seed=doc["seed"])):
        messages = task.meta["messages"]
        assert [m["role"] for m in messages] == ["system", "user"] and "<answer>" in messages[0]["content"]
        assert published["prompt"] == tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        assert published["prompt"].startswith("<|system|>") and published["prompt"].endswith("<|assistant|>")
    tokenizer.chat_template = None
    tokenizer.save_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match="no chat template"):
        open_environment(RG_SPEC, chat_template=str(tmp_path / "plain"), settings=ReasoningGymConfig())


def test_source_settings_come_from_variables_then_the_json_overrides(monkeypatch, bucket):
    from env_space.sources.settings import source_settings

    monkeypatch.setenv("ENV_RG_LEVEL", "2")
    monkeypatch.setenv("ENV_RG_ANSWER_TAG", "final")
    assert source_settings(RG_SPEC) == ReasoningGymConfig(level=2, answer_tag="final")
    assert source_settings(RG_SPEC, '{"level": 0}') == ReasoningGymConfig(level=0, answer_tag="final")
    assert source_settings("reverse") is None
    for spec, bad in ((RG_SPEC, '{"nope": 1}'), (RG_SPEC, "[1]"), ("reverse", '{"level": 1}')):
        with pytest.raises(ValueError):
            source_settings(spec, bad)
    config = EnvConfig(
        bucket=str(bucket.root), environment="reasoning_gym:leg_counting", source_settings='{"level": 0}'
    )
    env = EnvSimulator(config, bucket=bucket)
    assert env.environment.config.level == 0 and env.environment.config.answer_tag == "final"
    task = env.environment.tasks(1, seed=0)[0]
    assert env.score_sample(task, f"<final>{task.answer}</final>") == 1.0


def test_trl_reward_helper_by_dotted_path_scores_as_trl_does(tmp_path, monkeypatch):
    """TRL's own accuracy_reward, named by dotted path, gets what GRPOTrainer would pass it."""
    trl_rewards = pytest.importorskip("trl.rewards")
    monkeypatch.setenv("ENV_DATASET_REWARDS", "trl.rewards.accuracy_reward")  # the operator's setting allows it
    path = str(tmp_path / "chat-math")
    datasets.Dataset.from_dict({
        "prompt": [[{"role": "user", "content": "What is 1/3 of 1?"}], [{"role": "user", "content": "Half of 1?"}]],
        "solution": ["\\frac{1}{3}", "\\frac{1}{2}"],
    }).save_to_disk(path)  # fmt: skip
    config = DatasetSourceConfig(answer_column="solution", rewards="trl.rewards.accuracy_reward")
    env = open_environment(f"dataset:{path}", settings=config)
    for task in env.tasks(6, seed=0):
        for completion in ("so \\boxed{\\frac{1}{3}}", "so \\boxed{\\frac{1}{2}}", "no idea"):
            expected = trl_rewards.accuracy_reward([[{"role": "assistant", "content": completion}]], [task.answer])[0]
            assert env.score(task, completion) == expected
        assert env.score(task, f"so \\boxed{{{task.answer}}}") == 1.0


def test_a_source_registers_once_its_name_module_package_example_and_settings(monkeypatch, scratch_registry):
    """One registry: the settings form, the spec's module and the install hint all come from the entry."""
    import dataclasses

    from env_space.sources import open_environment
    from env_space.sources import settings as registry
    from rlsync.errors import ConfigurationError

    @dataclasses.dataclass
    class FakeConfig:
        size: int = 1

    kind = scratch_registry.Kind.ENV_SOURCE
    scratch_registry.register(
        kind, "fake", "no_such_module_xyz:from_spec", settings=FakeConfig, env_prefix="ENV_FAKE", package="fake-pkg",
        example="fake:1",
    )  # fmt: skip
    monkeypatch.setenv("ENV_FAKE_SIZE", "2")
    assert registry.read_source_settings("fake") == FakeConfig(2)
    assert registry.source_settings("fake:1", '{"size": 3}') == FakeConfig(3)
    with pytest.raises(ImportError, match="pip install fake-pkg"):
        open_environment("fake:1", settings=FakeConfig())
    with pytest.raises(ConfigurationError, match="taken"):
        scratch_registry.register(kind, "fake", "m:from_spec", package="p", example="fake:2", env_prefix="E")
    with pytest.raises(KeyError, match="unknown environment source 'nope'"):
        open_environment("nope:1")
    names = [s.name for s in registry.sources()]
    assert {"reasoning_gym", "dataset", "openenv", "fake"} <= set(names)
