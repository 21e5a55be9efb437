"""The anchor policies, one module each; each registers itself in :mod:`rlsync.registry` (``Kind.ANCHOR_POLICY``),
which reads this package's modules, so a new policy is one new file."""
