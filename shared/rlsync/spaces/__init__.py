"""Space support: what the three Spaces share besides the sync library (panels, settings, role runner, bucket exchange, deploy, tiny model).

Importing it turns off the libraries' telemetry for the process (nothing may phone home, and on the
Hub every request counts against the token's rate limits): ``HF_HUB_DISABLE_TELEMETRY=1`` (which
also stops huggingface_hub's agent-registry fetch) and ``GRADIO_ANALYTICS_ENABLED=False``, unless the
environment set them; an already imported huggingface_hub is switched too.
"""

import os as _os
import sys as _sys

_os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
_os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
if "huggingface_hub.constants" in _sys.modules and _os.environ["HF_HUB_DISABLE_TELEMETRY"] == "1":
    _sys.modules["huggingface_hub.constants"].HF_HUB_DISABLE_TELEMETRY = True
