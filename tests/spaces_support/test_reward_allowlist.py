"""Reward functions come from the built-ins, the operator's allow-list or the Space's own code, never
from any dotted path typed into the env panel (issue 26 critical 8: ``rewards=shutil.rmtree`` was accepted)."""

from __future__ import annotations

import json
import shutil
import uuid

import datasets
import pytest

from env_space.sources import open_environment
from env_space.simulator import EnvConfig
from env_space.sources import rewards
from env_space.sources.settings import DatasetSourceConfig
from rlsync.roles import Role
from rlsync.spaces.role_control import RoleRunner


@pytest.fixture
def dataset(tmp_path, monkeypatch):
    monkeypatch.delenv(rewards.ALLOW_ENV, raising=False)
    monkeypatch.delenv(rewards.REWARDS_ENV, raising=False)
    path = tmp_path / "math"
    datasets.Dataset.from_dict({"prompt": ["1+1?"], "answer": ["2"]}).save_to_disk(str(path))
    return str(path)


@pytest.mark.parametrize("name", ["shutil.rmtree", "os.system", "subprocess.run", "env_space.simulator.EnvSimulator", "rlsync.cli.main"])
def test_dotted_paths_outside_the_allow_list_are_refused_before_any_import(dataset, monkeypatch, name):
    calls = []
    monkeypatch.setattr(shutil, "rmtree", lambda *a, **k: calls.append(a))
    with pytest.raises(ValueError, match="is not allowed.*ENV_REWARD_ALLOW"):
        open_environment(f"dataset:{dataset}", settings=DatasetSourceConfig(rewards=name, reward_isolation="thread"))
    assert calls == []


def test_env_panel_start_with_a_hostile_reward_fails_and_runs_nothing(dataset, tmp_path, monkeypatch):
    """What the env panel's Start does with a reward typed into its form: the role fails to build."""
    from env_space.simulator import EnvSimulator

    calls = []
    monkeypatch.setattr(shutil, "rmtree", lambda *a, **k: calls.append(a))
    runner = RoleRunner(Role.ENV, lambda config: [EnvSimulator(config)])
    settings = json.dumps({"rewards": "shutil.rmtree", "reward_isolation": "thread"})
    config = EnvConfig(bucket=str(tmp_path / "bucket"), environment=f"dataset:{dataset}", source_settings=settings)
    runner.start(config, wait=True)
    assert runner.state == "failed" and "is not allowed" in runner.error and calls == []


def test_the_operators_allow_list_and_the_spaces_own_code_are_accepted(dataset, monkeypatch):
    monkeypatch.setenv(rewards.ALLOW_ENV, "trl.rewards.accuracy_reward")
    rewards.check_reward_name("trl.rewards.accuracy_reward")
    monkeypatch.setenv(rewards.REWARDS_ENV, "math_verify=1,trl.rewards.think_format_reward=0.5")
    rewards.check_reward_name("trl.rewards.think_format_reward")
    module = f"space_rewards_{uuid.uuid4().hex[:8]}"
    path = rewards.SPACE_REPO / f"{module}.py"
    path.write_text("def brevity(prompts, completions, **kw):\n    return [1.0 / (1 + len(c)) for c in completions]\n")
    try:
        monkeypatch.syspath_prepend(str(rewards.SPACE_REPO))
        assert rewards.is_space_code(module)
        env = open_environment(f"dataset:{dataset}", settings=DatasetSourceConfig(rewards=f"{module}.brevity", reward_isolation="thread"))
        [task] = env.tasks(1, seed=0)
        assert env.score(task, "abc") == 0.25
    finally:
        path.unlink()
    with pytest.raises(ValueError, match="is not allowed"):
        rewards.check_reward_name("trl.rewards.get_soft_overlong_punishment")
