"""A completion's policy versions, from the weight-version labels vLLM gives its tokens.

vLLM labels every generated token with the weight version its engine held when it sampled the token
(the ``weight_version`` of ``/finish_weight_update``: :class:`~rlsync.vllm.client.BucketSyncClient`
gives the bucket step) and returns the labels of a finished completion as spans over its tokens
(``weight_versions`` of each choice of ``/inference/v1/generate``, served with ``--enable-scale-out``).
Under the ``keep`` pause (:class:`~rlsync.vllm.client.PauseMode`) a completion may span updates:
:func:`completion_versions` gives its first and last version, which a sample records
(:class:`~rlsync.scores.Sample`'s ``version`` and ``last_version``); the trainer's staleness counts from
the first, the oldest. The server's answer is checked like any input: a label that is not a bucket
step (``"default"``: the checkpoint the server started from, before its first sync) is refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["CompletionVersions", "completion_versions"]

#: Longest label read as a step (the bucket's steps fit in 19 digits).
MAX_LABEL_DIGITS = 19


@dataclasses.dataclass(frozen=True)
class CompletionVersions:
    """The policy versions that sampled one completion's tokens.

    Attributes:
        first: The version of its first token (the oldest: what staleness counts from).
        last: The version of its last token.
    """

    first: int
    last: int

    @property
    def spans_update(self) -> bool:
        """Whether an update was applied while the completion was generated."""
        return self.last != self.first


def _step(label: Any) -> int:
    if not isinstance(label, str) or not label.isdigit() or not label.isascii() or len(label) > MAX_LABEL_DIGITS:
        raise ValueError(f"weight version {str(label)[:40]!r} is not a bucket step (sync the server before generating)")
    return int(label)


def completion_versions(spans: Any) -> CompletionVersions:
    """The first and last version of a completion from vLLM's ``weight_versions`` spans.

    Args:
        spans: The spans, in token order, each ``{"version": label, "start": int, "end": int}`` (as JSON).

    Returns:
        The versions of the first and last span.

    Raises:
        ValueError: Not a non-empty list of spans, a label is not a bucket step, or the versions go back.
    """
    if not isinstance(spans, list) or not spans or not all(isinstance(s, dict) for s in spans):
        raise ValueError("weight_versions is not a non-empty list of spans (is the server labelling its tokens?)")
    steps = [_step(s.get("version")) for s in spans]
    if any(b < a for a, b in zip(steps, steps[1:])):
        raise ValueError(f"weight versions go back within one completion: {steps[:8]}")
    return CompletionVersions(first=steps[0], last=steps[-1])
