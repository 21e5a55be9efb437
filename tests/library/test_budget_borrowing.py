"""Issue 31 (Hub rate): a busy role takes its part of what idle roles left unspent at once, never
spending ahead of the fleet's target pace, and is not "short" (the trainer would publish less often)
while the token has budget to spare."""

from __future__ import annotations

from rlsync.bucket.budget import BudgetConfig, RequestClass, RequestMeter, Tier

POLICY = '"fixed window";"api";q=1000;w=300'


def meter_at(now: list[float], slept: list[float]) -> RequestMeter:
    return RequestMeter(BudgetConfig(tier=Tier.FREE, share=4, target=0.8), clock=lambda: now[0],
                        sleep=lambda s: (slept.append(s), now.__setitem__(0, now[0] + s)))  # fmt: skip


def answer(meter: RequestMeter, remaining: int, reset_s: int) -> None:
    headers = {"RateLimit": f'"api";r={remaining};t={reset_s}', "RateLimit-Policy": POLICY}
    meter.record("POST", "/api/buckets/a/b/batch", 200, headers)


def test_a_busy_role_takes_its_part_of_the_unspent_pace_at_once_and_no_more():
    now, slept = [150.0], []
    meter = meter_at(now, slept)
    for _ in range(110):  # its own share's burst and more: half a window of its own pace (more than half its allowance)
        meter.acquire(RequestClass.API)
        meter.record("POST", "/api/buckets/a/b/batch", 200, None)
    assert slept and meter.short  # paced to its own share, nothing known to spare
    slept.clear()
    # half the window gone, the token spent 110 of 1,000: the fleet's pace (80%: a 10% burst, then pro rata)
    # allowed 440, 330 unspent
    answer(meter, remaining=890, reset_s=150)
    assert not meter.short  # others idle: no reason to publish less often
    taken = 0
    while not slept:
        meter.acquire(RequestClass.API)
        taken += 1
    assert 330 // 4 <= taken <= 330 // 4 + 2  # its quarter of the surplus at once (the others may take theirs)
    slept.clear()
    answer(meter, remaining=560, reset_s=150)  # all roles took theirs: 440 spent, the line reached
    meter.acquire(RequestClass.API)
    assert slept and meter.short  # back to its own pace, and short again
