"""Test tooling, not shipped: fault injectors and stand-ins for the tests, the soak and the benchmarks.

- :mod:`testing.faulty`: :class:`~testing.faulty.FaultyBucket`, a bucket wrapper injecting latency,
  errors, throttling, cut-short uploads and lagging listings;
- :mod:`testing.hub`: a local stand-in for the Hugging Face Hub's bucket API and Xet storage;
- :mod:`testing.soak`: the soak harness (``python -m testing.soak``).

The sync library (``shared/rlsync``) and the Space folders never import this package
(``tests/library/test_layout.py``); it lives at the repository root, outside the ``rlsync`` distribution.
"""
