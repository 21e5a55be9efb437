"""The anchor-policy registry (rlsync.protocol.policy): a policy registers its name and settings once,
and the control object's parser, the trainer's settings and the panels' form all follow it."""

from __future__ import annotations

import dataclasses

import pytest

from rlsync.errors import FormatError
from rlsync.errors import ConfigurationError
from rlsync.protocol.policy import AnchorPolicy, policy_class, policy_from_json, policy_names, policy_to_json
from rlsync.spaces.anchor_policy import current_policy, describe_policy, make_policy, setting_fields
from rlsync.spaces.snapshots import Snapshot
from trainer_space.config import TrainerConfig  # imported before a test registers a policy: its help lists the tree's


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
def registered(scratch_registry):
    return scratch_registry.register(scratch_registry.Kind.ANCHOR_POLICY, "every-other", EveryOther).load()


def test_the_built_in_policies_are_found_in_their_package():
    assert policy_names()[:2] == ["fixed", "adaptive"]


def test_a_registered_policy_reaches_the_parser_the_form_and_the_trainer_settings(registered):
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


def test_a_name_is_taken_once(scratch_registry):
    @dataclasses.dataclass
    class Impostor(AnchorPolicy):
        name = "fixed"

        def wants_anchor(self, manifest) -> bool:
            return True

        def describe(self) -> str:
            return "impostor"

    with pytest.raises(ConfigurationError, match="taken"):
        scratch_registry.register(scratch_registry.Kind.ANCHOR_POLICY, "fixed", Impostor)


def test_a_policy_that_is_not_a_dataclass_of_its_name_is_refused_when_used(scratch_registry):
    scratch_registry.register(scratch_registry.Kind.ANCHOR_POLICY, "plain", AnchorPolicy)  # not a dataclass
    scratch_registry.register(scratch_registry.Kind.ANCHOR_POLICY, "alias", EveryOther)  # named "every-other"
    for name in ("plain", "alias"):
        with pytest.raises(ConfigurationError, match="dataclass of its settings named so"):
            policy_class(name)
    with pytest.raises(FormatError, match="unknown anchor policy"):
        policy_class("none-such")
