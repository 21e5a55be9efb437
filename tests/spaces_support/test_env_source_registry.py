"""Adding an environment source is one new file: a module that registers its ``from_spec`` and settings dataclass
in :mod:`rlsync.registry` is found by the registry, gets its settings from its variables and the panel's JSON,
opens as an environment the simulator serves, and has its form on the panel.

The scratch source is written into a package of its own (not into ``env_space/sources/``, which other tests
read at the same time), added as a home of the registry (:func:`rlsync.registry.add_home`), as
``env_space.sources`` adds itself on import.
"""

from __future__ import annotations

import sys
import textwrap

import pytest

from env_space.sources import open_environment
from env_space.sources import settings

SCRATCH_SOURCE = '''
"""A scratch source: ``echo:<word>`` asks to repeat a word ``times`` times."""

import dataclasses

from env_space.environments import Environment, Task
from env_space.sources.settings import read_source_settings
from rlsync.registry import Kind, register

register(
    Kind.ENV_SOURCE, "echo", "scratch_sources.echo:from_spec", settings="scratch_sources.echo:EchoConfig",
    env_prefix="ENV_ECHO", package="nothing", example="echo:hello",
)


@dataclasses.dataclass
class EchoConfig:
    """Settings of the echo source (``ENV_ECHO_<FIELD>``)."""

    times: int = dataclasses.field(default=2, metadata={"help": "how often to repeat the word"})


class EchoEnvironment(Environment):
    def __init__(self, word: str, config: EchoConfig) -> None:
        self.word, self.config, self.name = word, config, f"echo:{word}"

    def tasks(self, n, *, seed):
        answer = " ".join([self.word] * self.config.times)
        return [Task(f"echo-{seed}-{i}", f"repeat {self.word} {self.config.times} times", answer, {}) for i in range(n)]

    def score(self, task, completion):
        return float(completion.strip() == task.answer)


def from_spec(argument, *, chat_template="", settings=None):
    return EchoEnvironment(argument, settings or read_source_settings("echo"))
'''


@pytest.fixture
def scratch_source(tmp_path, monkeypatch, scratch_registry):
    """The registry after reading a package holding one new file, the scratch source."""
    package = tmp_path / "scratch_sources"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "echo.py").write_text(textwrap.dedent(SCRATCH_SOURCE))
    (package / "helper.py").write_text("raise AssertionError('a module is read, not imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    scratch_registry.add_home("scratch_sources")
    try:
        yield scratch_registry.get(scratch_registry.Kind.ENV_SOURCE, "echo")
    finally:  # the registry is restored by scratch_registry
        for name in [m for m in sys.modules if m == "scratch_sources" or m.startswith("scratch_sources.")]:
            del sys.modules[name]


def test_one_new_file_registers_a_source_with_its_settings(scratch_source, monkeypatch):
    assert "scratch_sources.echo" not in sys.modules  # read, not imported, until used
    assert (scratch_source.target, scratch_source.details["example"], scratch_source.env_prefix) == (
        "scratch_sources.echo:from_spec", "echo:hello", "ENV_ECHO",
    )  # fmt: skip
    config_class = scratch_source.settings_class()
    assert settings.EchoConfig is config_class  # the module names its settings class, as it does the built-ins'
    monkeypatch.setenv("ENV_ECHO_TIMES", "4")
    assert settings.source_settings("echo:hi") == config_class(times=4)
    assert settings.source_settings("echo:hi", '{"times": 3}') == config_class(times=3)
    with pytest.raises(ValueError, match="unknown echo settings"):
        settings.source_settings("echo:hi", '{"loud": true}')


def test_the_new_source_opens_and_the_simulator_serves_it(scratch_source, bucket):
    from env_space.simulator import EnvConfig, EnvSimulator

    env = open_environment("echo:hi", settings=scratch_source.settings_class()(times=3))
    task = env.tasks(1, seed=0)[0]
    assert task.prompt == "repeat hi 3 times" and env.score(task, "hi hi hi") == 1.0
    simulator = EnvSimulator(EnvConfig(bucket=str(bucket.root), environment="echo:hi", source_settings='{"times": 2}'), bucket)
    batch = simulator.publish_tasks()
    served = simulator.environment.tasks(1, seed=batch)[0]
    assert simulator.environment.config.times == 2 and served.answer == "hi hi"  # the panel's JSON over the default
    assert simulator.score_sample(served, "hi hi") == 1.0 and simulator.score_sample(served, "hi") == 0.0
    simulator.close()


def test_the_panel_offers_the_new_source_and_its_form(scratch_source):
    gr = pytest.importorskip("gradio")

    from env_space.app import build_panel, make_runner
    from env_space.simulator import EnvConfig

    with gr.Blocks():
        panel = build_panel(make_runner(), EnvConfig(environment="echo:hello"))
    assert list(panel["source_forms"]["echo"]) == ["times"]
    offered = [choice[1] if isinstance(choice, tuple) else choice for choice in panel["form"]["environment"].choices]
    assert "echo:hello" in offered
