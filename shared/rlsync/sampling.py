"""What a sampler can report: bounds on the untrusted samples replicas write.

A replica reports, for every completion token, the log-probability its sampler
drew it with. TRL's GRPO loss takes ``exp(log_prob - old_log_prob)``; an old
log-probability of -200 makes that ratio overflow float32 (``exp(88.7)``), the
loss goes NaN and the step is lost. No sampler draws a token of probability
below ``exp(MIN_SAMPLED_LOGPROB)`` (about 2e-22) in practice: a billion tokens a
second would meet one every few thousand years. Anything lower is a lie, and
refused. At the bound, ``exp(50)`` is about 5e21, which keeps the ratio, times
any advantage a group within :data:`MAX_GROUP_SIZE` can give, finite in float32
and bfloat16.

Groups: samples of one task form a group whose advantages are normalised
within it. A one-member group always has advantage 0 (it takes a batch slot and
teaches nothing), and one outlier in a group of ``n`` gets advantage
``sqrt(n - 1)``: 64 in a group of 4,096. Groups outside
``[MIN_GROUP_SIZE, MAX_GROUP_SIZE]`` are degenerate and dropped.
"""

from __future__ import annotations

import math

MIN_SAMPLED_LOGPROB = -50.0
MIN_GROUP_SIZE = 2
MAX_GROUP_SIZE = 128


def sampled_logprob_ok(value: float) -> bool:
    """Whether ``value`` is a log-probability a sampler can report: finite, in ``[MIN_SAMPLED_LOGPROB, 0]``."""
    return math.isfinite(value) and MIN_SAMPLED_LOGPROB <= value <= 0.0


def degenerate_group(size: int, max_size: int = MAX_GROUP_SIZE) -> bool:
    """Whether a group of ``size`` samples is too small to compare or too large to normalise safely."""
    return not MIN_GROUP_SIZE <= size <= max_size
