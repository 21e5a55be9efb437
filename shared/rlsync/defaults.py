"""Defaults shared by the library and the Spaces' settings, each defined here once.

Torch-free, so a settings dataclass can use them without importing torch.
"""

#: Publishes per anchor of the fixed anchor policy (:class:`~rlsync.protocol.FixedInterval`).
DEFAULT_ANCHOR_INTERVAL = 10
#: The adaptive anchor policy's bound on a new replica's catch-up, in anchors (:class:`~rlsync.protocol.Adaptive`).
DEFAULT_MAX_CATCHUP_RATIO = 2.0
#: The delta codec used unless one is chosen: the smallest files of every codec measured
#: (docs/codecs.md), on CPU its compiled class pass and on an accelerator the class order on the device.
DEFAULT_CODEC = "classrice"
