"""The trainer Space: owns the weights, learns from scored rollouts, publishes to the bucket."""

import importlib.util
import os
import sys

if importlib.util.find_spec("rlsync") is None:  # a Space's upload, rlsync not installed: the copy it ships in shared/
    sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "shared"))
