#!/usr/bin/env bash
# Run the whole test suite (expects scripts/setup.sh to have run).
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# the tiny offline model is built once (deterministically, no download) and cached
python -c "from env_space.environments import get_environment; from rlsync.spaces.tiny_model import tiny_model_path; print('tiny model:', tiny_model_path(environments=get_environment))"
# two workers, each test file on one (module fixtures such as a vLLM engine start once); `-n 0` runs serially.
# Times of both: docs/testing.md
python -m pytest -q -n 2 --dist loadfile "$@"
