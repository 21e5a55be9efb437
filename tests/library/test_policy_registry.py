"""The anchor-policy registry (rlsync.protocol.policy): a policy registers its name and settings once,
and the control object's parser, the trainer's settings and the panels' form all follow it."""

from __future__ import annotations

import dataclasses

import pytest

from rlsync.errors import FormatError
from rlsync.protocol.policies import base as registry
from rlsync.protocol.policy import AnchorPolicy, policy_from_json, policy_names, policy_to_json, register_policy
from rlsync.spaces.anchor_policy import current_policy, describe_policy, make_policy, setting_fields
from rlsync.spaces.snapshots import Snapshot


@dataclasses.dataclass
class EveryOther(AnchorPolicy):
    """A test policy: an anchor when the newest version is a multiple of ``period``."""

    period: int = dataclasses.field(default=2, metadata={"label": "Period (publishes)", "minimum": 1})
    name = "every-other"

    def wants_anchor(self, manifest) -> bool:
        return (manifest.step + 1) % self.period == 0

    def describe(self) -> str:
        return f"every {self.period}"


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    policy_names()  # the built-ins discovered first
    return register_policy(EveryOther)


def test_the_built_in_policies_are_found_in_their_package():
    assert policy_names()[:2] == ["fixed", "adaptive"]


def test_a_registered_policy_reaches_the_parser_the_form_and_the_trainer_settings(registered):
    from trainer_space.config import TrainerConfig

    assert "every-other" in policy_names()
    assert policy_from_json(policy_to_json(EveryOther(5))) == EveryOther(5)
    with pytest.raises(FormatError):  # exactly its own keys
        policy_from_json(b'{"policy": "every-other", "period": 5, "interval": 3}')
    assert "period" in [f.name for f in setting_fields()]  # one input on the panels' form
    assert make_policy("every-other", {"period": 4.0, "interval": 9.0}) == EveryOther(4)
    with pytest.raises(ValueError):
        make_policy("every-other", {"period": 2.5})  # an int setting must be whole
    info = current_policy(Snapshot(), EveryOther(3))
    assert info["period"] == 3 and info["interval"] == 10 and "every 3" in describe_policy(info)
    config = TrainerConfig(anchor_policy="every-other", anchor_settings='{"period": 7}')
    assert config.policy() == EveryOther(7)
    with pytest.raises(ValueError):
        TrainerConfig(anchor_policy="no-such").policy()


def test_a_name_is_taken_once():
    @dataclasses.dataclass
    class Impostor(AnchorPolicy):
        name = "fixed"

        def wants_anchor(self, manifest) -> bool:
            return True

        def describe(self) -> str:
            return "impostor"

    with pytest.raises(ValueError, match="taken"):
        register_policy(Impostor)
