"""The environment Space: publishes tasks, scores completions, writes rewards."""

import importlib.util
import os
import sys

if importlib.util.find_spec("rlsync") is None:  # a Space's upload, rlsync not installed: the copy it ships in shared/
    sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "shared"))
