"""The Hub's request budget: counting a role's requests by class and kind, and pacing them.

The Hub limits requests per user or token in fixed 5-minute windows, separately for the API
(every ``/api/...`` endpoint, the Xet token endpoints and the events feed included) and for the
resolvers (``/resolve/...``); over the limit it answers 429 with ``RateLimit`` /
``RateLimit-Policy`` headers. The roles of one deployment usually share one token, so they share
one budget. :class:`RequestMeter` is one role's view of it:

- it counts every request the role's :class:`~rlsync.bucket.hf.HfBucket` makes, by
  :class:`RequestClass` and kind (``"GET tree"``, ``"POST batch"``, ...), over the last window;
- it paces the role to its share of the tier's limits (:class:`BudgetConfig`: tier, total weight of
  the roles sharing the token, the role's weight, target fraction; the trainer, whose publishes are
  the product, weighs :data:`TRAINER_WEIGHT`) with a token bucket per class, so a role slows down evenly instead of
  spending its share in a burst and then stalling for the rest of the window; when the Hub's
  ``RateLimit`` header shows the token has budget to spare (other roles idle: the token has spent
  less than the fleet's target pace allowed so far in the window), a busy role may also take up to
  its ``weight/share`` of that surplus at once, so together the roles never spend ahead of the target pace;
- listing pages may take only :attr:`RequestMeter.LISTING_SHARE` of that pace, so a prefix flooded
  with keys never leaves a role without requests to read and write;
- it reads the Hub's ``RateLimit`` headers whenever they come: when the whole token's remaining
  budget is low (other processes share it too) it waits for the window to reset, and a 429 holds
  every request of the role until the time the server gave, never longer than one window
  (:func:`rlsync.retry.retry_after_seconds`: an absurd ``Retry-After`` holds no role forever).

:attr:`RequestMeter.short` tells the roles that the budget is short (the trainer then publishes
less often, replicas take larger batches); :attr:`RequestMeter.pacing` says why, for the panels.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import re
import threading
import time
from typing import Any, Callable, Mapping

from ..errors import ConfigurationError
from ..retry import ratelimit_info, retry_after_seconds
from ..roles import Role

__all__ = [
    "BudgetConfig", "HUB_LIMITS", "LISTING_KIND", "RequestClass", "RequestMeter", "TRAINER_WEIGHT", "Tier", "WINDOW_S",
    "classify",
]  # fmt: skip

logger = logging.getLogger(__name__)

#: The Hub's rate-limit window, in seconds (fixed windows).
WINDOW_S = 300.0


class Tier(str, enum.Enum):
    """A Hub account tier (its rate limits are in :data:`HUB_LIMITS`)."""

    FREE = "free"
    PRO = "pro"
    TEAM = "team"
    ENTERPRISE = "enterprise"


class RequestClass(str, enum.Enum):
    """How the Hub counts a request: against the API limit or the resolver limit."""

    API = "api"
    RESOLVER = "resolver"


#: Requests per 5-minute window (hub-docs ``rate-limits.md``, September 2025).
HUB_LIMITS: dict[Tier, dict[RequestClass, int]] = {
    Tier.FREE: {RequestClass.API: 1000, RequestClass.RESOLVER: 5000},
    Tier.PRO: {RequestClass.API: 2500, RequestClass.RESOLVER: 12000},
    Tier.TEAM: {RequestClass.API: 3000, RequestClass.RESOLVER: 20000},
    Tier.ENTERPRISE: {RequestClass.API: 6000, RequestClass.RESOLVER: 50000},
}

_KINDS = (
    (re.compile(r"/resolve/"), "resolve"),
    (re.compile(r"/xet-read-token"), "xet-read-token"),
    (re.compile(r"/xet-write-token"), "xet-write-token"),
    (re.compile(r"/api/buckets/[^/]+/[^/]+/(tree|paths-info|batch|events)\b"), None),
    (re.compile(r"/api/whoami"), "whoami"),
    (re.compile(r"/api/telemetry"), "telemetry"),
    (re.compile(r"/api/agent-harnesses"), "agent-registry"),
    (re.compile(r"/api/buckets/[^/]+/[^/]+$"), "bucket"),
)


#: The trainer's default weight (:attr:`BudgetConfig.weight`): its publishes are the product, so it paces
#: to twice an other role's part of the budget and takes twice its part of what the token has to spare.
TRAINER_WEIGHT = 2.0

#: The kind of a listing page (``GET /api/buckets/{id}/tree``), paced within :attr:`RequestMeter.LISTING_SHARE`.
LISTING_KIND = "GET tree"


def classify(method: str, path: str) -> tuple[RequestClass | None, str]:
    """How the Hub counts a request to `path`, and its kind for the counts.

    Args:
        method (`str`): The HTTP method.
        path (`str`): The URL path.

    Returns:
        `tuple`: ``(class, kind)``; the class is `None` for a request the Hub does not count
        (Xet storage, another host's path).
    """
    cls = RequestClass.RESOLVER if "/resolve/" in path else RequestClass.API if path.startswith("/api/") else None
    for pattern, kind in _KINDS:
        match = pattern.search(path)
        if match:
            return cls, f"{method} {kind or match[1]}"
    return cls, f"{method} other"


def scaled_limit(tier: Tier, cls: RequestClass, window_s: float) -> int:
    """The tier's limit for `cls`, scaled to a window of `window_s` seconds (tests shorten it)."""
    return max(1, round(HUB_LIMITS[tier][cls] * window_s / WINDOW_S))


@dataclasses.dataclass
class BudgetConfig:
    """A role's share of the Hub's request budget.

    Entry points read it from `HUB_<FIELD>` then `<ROLE>_HUB_<FIELD>` variables with
    [`~rlsync.bucket.settings.BucketSettings.from_env`].

    Args:
        tier (`Tier`, *optional*, defaults to free): The account tier of the token (env `HUB_TIER`).
        share (`int`, *optional*, defaults to 5): The total weight of the roles and replicas sharing the
            token; each paces itself to `weight / share` of the limits (env `HUB_SHARE`; the default is
            the demo's trainer, weighing :data:`TRAINER_WEIGHT`, the env and two replicas).
        weight (`float`, *optional*, defaults to 1): This role's part of `share`: its pace and its part of
            what the token has to spare are `weight / share` of the fleet's (env `HUB_WEIGHT`, per role
            `<ROLE>_HUB_WEIGHT`; [`~rlsync.bucket.settings.BucketSettings.from_env`] gives the trainer
            :data:`TRAINER_WEIGHT` unless set). The weights of all roles on a token must add up to at
            most `share`, so the fleet stays within `target`.
        target (`float`, *optional*, defaults to 0.8): Fraction of the limits the fleet aims at, the
            rest a margin for panels and retries (env `HUB_TARGET`).
        window_s (`float`, *optional*, defaults to 300): The rate-limit window; the limits scale with
            it (env `HUB_WINDOW_S`; only tests against the stand-in shorten it).
        enabled (`bool`, *optional*, defaults to True): Pace (counting is always on) (env `HUB_PACING`).
    """

    tier: Tier = Tier.FREE
    share: int = 5
    weight: float = 1.0
    target: float = 0.8
    window_s: float = WINDOW_S
    enabled: bool = dataclasses.field(default=True, metadata={"env": "pacing"})

    def __post_init__(self) -> None:
        self.tier = Tier(self.tier)
        if self.share < 1 or not 0 < self.weight <= self.share or not 0 < self.target <= 1 or self.window_s <= 0:
            raise ConfigurationError(
                f"invalid budget: weight {self.weight} of share {self.share}, target {self.target}, "
                f"window {self.window_s}s"
            )

    def limit(self, cls: RequestClass) -> int:
        """The tier's limit for `cls` over :attr:`window_s`."""
        return scaled_limit(self.tier, cls, self.window_s)

    @property
    def part(self) -> float:
        """This role's part of the fleet's budget (`weight / share`)."""
        return self.weight / self.share

    def allowance(self, cls: RequestClass) -> float:
        """This role's share of `cls` requests per window."""
        return self.limit(cls) * self.target * self.part


class _TokenBucket:
    """`rate` requests per second with bursts up to `capacity`: at most `capacity + rate * w` in any `w` seconds."""

    def __init__(self, rate: float, capacity: float, now: float) -> None:
        self.rate = rate
        self.capacity = max(1.0, capacity)
        self.level = self.capacity
        self.at = now

    def refill(self, now: float) -> float:
        self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
        self.at = now
        return self.level

    def wait_s(self, now: float) -> float:
        """Seconds until one request may go (0: now)."""
        level = self.refill(now)
        return 0.0 if level >= 1.0 - 1e-6 else (1.0 - level) / self.rate


class RequestMeter:
    """Counts one role's Hub requests and paces them to its share of the budget (thread-safe).

    Args:
        config ([`BudgetConfig`], *optional*): The budget; defaults to `BudgetConfig()`.
        role ([`~rlsync.roles.Role`], *optional*): The role, for the panel and the logs.
        clock (`Callable[[], float]`, *optional*): Monotonic clock (tests pass a fake one).
        sleep (`Callable[[float], None]`, *optional*): Called with each wait.
    """

    #: Longest a single wait for budget may last (the server's own reset time bounds it too).
    MAX_WAIT_S = 60.0
    #: Share of a window a burst may use; the rest is paced evenly.
    BURST = 0.1
    #: Share of a class's pace that listing pages may take (the rest stays for reads and writes).
    LISTING_SHARE = 0.5

    def __init__(
        self,
        config: BudgetConfig | None = None,
        *,
        role: Role | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.config = config if config is not None else BudgetConfig()
        self.role = role
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        now = clock()
        self._buckets = {
            cls: _TokenBucket(
                self.config.allowance(cls) * (1 - self.BURST) / self.config.window_s,
                self.config.allowance(cls) * self.BURST,
                now,
            )
            for cls in RequestClass
        }
        self._listing = {
            cls: _TokenBucket(bucket.rate * self.LISTING_SHARE, bucket.capacity * self.LISTING_SHARE, now)
            for cls, bucket in self._buckets.items()
        }
        self._log: collections.deque[tuple[float, RequestClass, str]] = collections.deque()
        self.totals: collections.Counter[str] = collections.Counter()  # by kind, since the start
        self.class_totals: collections.Counter[RequestClass] = collections.Counter()
        self.throttled = 0
        self.waited_s = 0.0
        self._held_until = 0.0
        self._server: dict[RequestClass, tuple[int, int | None, float]] = {}  # remaining, limit, reset at
        self._spare: dict[RequestClass, _TokenBucket] = {}  # this role's part of what the token has to spare
        self._surplus: dict[RequestClass, float] = {}  # what the token had to spare at its last answer
        self.pacing = ""

    # -- used by the transport -------------------------------------------------------------------

    def acquire(self, cls: RequestClass | None, *, listing: bool = False) -> float:
        """Wait until a request of class `cls` fits the budget; returns the seconds waited.

        A listing page (`listing`) must also fit the listing share (:attr:`LISTING_SHARE` of the
        class's), so that listing a flooded prefix never takes the role's whole share: reads and
        writes always keep the rest.

        Does nothing when `cls` is `None` or pacing is off (beyond a 429's hold, always kept).
        """
        if cls is None:
            return 0.0
        waited = 0.0
        while True:
            with self._lock:
                now = self._clock()
                wait, why = self._held_until - now, "the Hub answered 429"
                borrowed = False
                if self.config.enabled:
                    paced = self._buckets[cls].wait_s(now)
                    spare = self._spare.get(cls)
                    if paced > 0 and spare is not None:  # the token has budget to spare: take a share of it
                        borrow = spare.wait_s(now)
                        paced, borrowed = min(paced, borrow), borrow == 0
                    if paced > wait:
                        wait, why = paced, f"{cls.value} share ({self.config.allowance(cls):.0f} per {self.config.window_s:g}s) spent"
                    listed = self._listing[cls].wait_s(now) if listing else 0.0
                    if listed > wait:
                        wait, why = listed, f"listing share ({self.LISTING_SHARE:.0%} of the {cls.value} share) spent"
                    server = self._server_wait(cls, now)
                    if server > wait:
                        wait, why = server, f"the token's {cls.value} budget is nearly spent (RateLimit header)"
                if wait <= 0:
                    if self.config.enabled:
                        (self._spare[cls] if borrowed else self._buckets[cls]).level -= 1.0
                        if listing:
                            self._listing[cls].level -= 1.0
                    if waited:
                        self.waited_s += waited
                    return waited
                wait = min(wait, self.MAX_WAIT_S)
                self.pacing = (
                    f"pacing {wait:.1f}s: {why} ({self.config.tier.value} tier, "
                    f"{self.config.weight:g} of {self.config.share} sharing)"
                )
            self._sleep(wait)
            waited += wait

    def _server_wait(self, cls: RequestClass, now: float) -> float:
        """Wait until the reset when the token's remaining budget (all its users) is down to a reserve."""
        seen = self._server.get(cls)
        if seen is None:
            return 0.0
        remaining, limit, reset_at = seen
        reserve = max(1, (limit or self.config.limit(cls)) // 50)
        return reset_at - now if remaining <= reserve and reset_at > now else 0.0

    def record(self, method: str, path: str, status: int | None, headers: Mapping[str, str] | None) -> None:
        """Count one request made and read the rate-limit headers of its response."""
        cls, kind = classify(method, path)
        with self._lock:
            now = self._clock()
            self._log.append((now, cls, kind))
            self.totals[kind] += 1
            if cls is not None:
                self.class_totals[cls] += 1
            self._trim(now)
            if headers is not None:
                self._observe(headers, now)
            if status == 429:
                self.throttled += 1
                hold = retry_after_seconds(headers, self.config.window_s) if headers is not None else None
                self._held_until = max(self._held_until, now + (hold if hold is not None else 1.0))
        if status == 429:
            logger.warning("%s: the Hub answered 429 to %s; holding requests", self.role or "bucket", kind)

    def _observe(self, headers: Mapping[str, str], now: float) -> None:
        info = ratelimit_info(headers)  # None also for a number too large to use
        if info is None:
            return
        try:
            cls = RequestClass(info.resource_type)
        except ValueError:
            return
        reset_in = min(float(info.reset_in_seconds), self.config.window_s)  # a server's answer never holds a role past a window
        self._server[cls] = (info.remaining, info.limit, now + reset_in)
        # What the fleet's pace allowed the whole token so far in this window (the target share of the
        # limit, shaped as the roles' own shares: a burst, then pro rata over the elapsed part) and nobody
        # spent: the idle roles' unspent shares. A busy role may take its weight/share of it at once (each
        # response sets it again from the token's own count), so the token never spends ahead of that
        # line; the roles' own shares keep the rest of the window, so a window ends within the target
        # plus the bursts.
        limit = info.limit or self.config.limit(cls)
        elapsed = max(0.0, self.config.window_s - reset_in)
        line = self.BURST + (1 - self.BURST) * elapsed / self.config.window_s
        surplus = self.config.target * limit * line - max(0, limit - info.remaining)
        self._surplus[cls] = surplus
        part = surplus * self.config.part
        if part < 1.0:
            self._spare.pop(cls, None)
        else:
            spare = _TokenBucket(self.config.target * limit / self.config.window_s * self.config.part, part, now)
            self._spare[cls] = spare

    def _trim(self, now: float) -> None:
        while self._log and self._log[0][0] < now - self.config.window_s:
            self._log.popleft()

    # -- read by the roles and panels ------------------------------------------------------------

    def count(self, cls: RequestClass) -> int:
        """Requests of class `cls` over the last window."""
        with self._lock:
            self._trim(self._clock())
            return sum(1 for _, c, _ in self._log if c is cls)

    @property
    def short(self) -> bool:
        """Whether the budget is short: the role has used more than half its share of the last window
        while the token has nothing to spare (others use their shares), is being held after a 429, or
        the token's remaining budget is low."""
        with self._lock:
            now = self._clock()
            if self._held_until > now:
                return True
            self._trim(now)
            for cls in RequestClass:
                used = sum(1 for _, c, _ in self._log if c is cls)
                spare = self._surplus.get(cls, 0.0) * self.config.part >= 1.0  # at least one request for this role
                if used > self.config.allowance(cls) / 2 and not spare or self._server_wait(cls, now) > 0:
                    return True
                seen = self._server.get(cls)
                if seen is not None and seen[2] > now and seen[0] < (seen[1] or self.config.limit(cls)) // 5:
                    return True
            return False

    def snapshot(self) -> dict[str, Any]:
        """The counts for ``metrics/`` and ``status/``: per class over the last window, the limits,
        totals by kind, 429s, time spent waiting and the pacing notice."""
        short = self.short
        with self._lock:
            now = self._clock()
            self._trim(now)
            window = collections.Counter(c.value for _, c, _ in self._log if c is not None)
            recent_pacing = self.pacing if short else ""
            return {
                "tier": self.config.tier.value,
                "share": 1 / self.config.part,  # the role paces to 1/share of the limits (its weight included)
                "window_s": self.config.window_s,
                **{cls.value: window[cls.value] for cls in RequestClass},
                **{f"{cls.value}_limit": self.config.limit(cls) for cls in RequestClass},
                "by_kind": dict(self.totals),
                "throttled": self.throttled,
                "waited_s": round(self.waited_s, 3),
                "short": short,
                "pacing": recent_pacing,
            }
