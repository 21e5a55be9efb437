"""Issue 31 (Hub rate): roles have weights. The trainer, whose publishes are the product, paces to a
larger part of the token's budget and takes a larger part of what the token has to spare, while the
fleet as a whole (weights adding up to `HUB_SHARE`) stays within the target of the limit."""

from __future__ import annotations

import pytest

from rlsync.errors import ConfigurationError
from rlsync.roles import Role
from rlsync.bucket import BucketSettings
from rlsync.bucket.budget import TRAINER_WEIGHT, BudgetConfig, RequestClass, RequestMeter, Tier
from rlsync.bucket.settings import role_weight

POLICY = '"fixed window";"api";q=1000;w=300'
SHARE = 6  # app.py with 2 replicas: the trainer (2), the env, the panel and two replicas


def meter_at(now: list[float], weight: float) -> RequestMeter:
    config = BudgetConfig(tier=Tier.FREE, share=SHARE, weight=weight, target=0.8)
    return RequestMeter(config, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))


def spend(weight: float, seconds: float) -> int:
    """API requests a role of `weight` makes as fast as its own pace lets it in `seconds` (nothing to spare)."""
    now = [0.0]
    meter, made = meter_at(now, weight), 0
    while True:
        meter.acquire(RequestClass.API)
        if now[0] > seconds:
            return made
        made += 1


def test_the_trainer_paces_to_its_weight_and_the_fleet_stays_within_the_target():
    trainer, other = spend(TRAINER_WEIGHT, 300), spend(1, 300)
    assert TRAINER_WEIGHT > 1
    assert abs(trainer - TRAINER_WEIGHT * other) <= TRAINER_WEIGHT  # twice an other role's requests
    # a whole window of every role at its pace: the weights add up to the share, the fleet to the target
    fleet = trainer + (SHARE - TRAINER_WEIGHT) * other
    assert 0.8 * 1000 * 0.95 <= fleet <= 0.8 * 1000 + SHARE


def answer(meter: RequestMeter, remaining: int, reset_s: int) -> None:
    headers = {"RateLimit": f'"api";r={remaining};t={reset_s}', "RateLimit-Policy": POLICY}
    meter.record("POST", "/api/buckets/a/b/batch", 200, headers)


def borrowed(weight: float) -> int:
    """Requests a busy role of `weight` takes at once from the token's surplus, beyond its own share."""
    now = [150.0]
    meter = meter_at(now, weight)
    while meter.acquire(RequestClass.API) == 0:  # its own burst, until it has to wait
        pass
    # half the window gone, the token spent 110 of 1,000: the fleet's pace (80%: a 10% burst, then pro
    # rata) allowed 440, so 330 are unspent
    answer(meter, remaining=890, reset_s=150)
    taken = 0
    while meter.acquire(RequestClass.API) == 0:
        taken += 1
    return taken


def test_the_trainer_takes_its_weights_part_of_the_spare_and_the_fleet_no_more_than_the_spare():
    trainer, other = borrowed(TRAINER_WEIGHT), borrowed(1)
    assert 330 * TRAINER_WEIGHT / SHARE - 1 <= trainer <= 330 * TRAINER_WEIGHT / SHARE + 2
    assert 330 / SHARE - 1 <= other <= 330 / SHARE + 2
    assert trainer + (SHARE - TRAINER_WEIGHT) * other <= 330 + SHARE  # together: what the token had to spare


def test_the_roles_weights_from_the_environment():
    assert BucketSettings.from_env(Role.TRAINER, {}).budget.weight == TRAINER_WEIGHT
    assert BucketSettings.from_env(Role.ENV, {}).budget.weight == role_weight(Role.ROLLOUT, {}) == 1.0
    # the default share is the demo's fleet: the trainer, the env and two replicas
    assert BudgetConfig().share == TRAINER_WEIGHT + 3
    assert BucketSettings.from_env(Role.TRAINER, {"TRAINER_HUB_WEIGHT": "1"}).budget.weight == 1.0
    assert BucketSettings.from_env(Role.ENV, {"HUB_WEIGHT": "1.5", "HUB_SHARE": "7"}).budget.weight == 1.5
    with pytest.raises(ValueError, match="TRAINER_HUB_WEIGHT"):
        role_weight(Role.TRAINER, {"TRAINER_HUB_WEIGHT": "most"})
    with pytest.raises(ValueError, match="weight"):
        BudgetConfig(share=4, weight=5)  # more than the whole fleet's budget


def test_a_share_smaller_than_the_roles_weight_is_refused_at_start_naming_the_variables_and_a_share_that_works():
    with pytest.raises(ConfigurationError) as info:
        BucketSettings.from_env(Role.TRAINER, {"HUB_SHARE": "1"})  # the trainer's default weight is 2
    message = str(info.value)
    assert "invalid budget" in message and "HUB_WEIGHT or TRAINER_HUB_WEIGHT, default 2" in message
    assert message.endswith("more than HUB_SHARE=1, the weights of every role on the token added up: set HUB_SHARE=2 or more")
    assert BucketSettings.from_env(Role.TRAINER, {"HUB_SHARE": "2"}).budget.share == 2  # the value it names works
    with pytest.raises(ConfigurationError, match="HUB_SHARE=3 or more"):
        BucketSettings.from_env(Role.ROLLOUT, {"HUB_SHARE": "2", "ROLLOUT_HUB_WEIGHT": "2.5"})
    with pytest.raises(ConfigurationError, match="^invalid budget: weight -1.0 of share 5"):
        BucketSettings.from_env(Role.ENV, {"HUB_WEIGHT": "-1"})  # nothing to suggest: the plain refusal


def test_the_panel_shows_the_trainers_larger_part():
    snapshot = meter_at([0.0], TRAINER_WEIGHT).snapshot()
    assert snapshot["share"] == SHARE / TRAINER_WEIGHT  # the panel's line: "1/3 share", 1,000 / 3 API
