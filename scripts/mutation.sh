#!/usr/bin/env bash
# Mutation testing of the sync library's core (format, codecs/, detect, hashing, protocol/, bucket/) with mutmut.
# Not part of CI. Configuration: [tool.mutmut] in pyproject.toml. Results are cached in mutants/ (git-ignored):
# a second run only re-tests mutants of functions that changed.
#
#   bash scripts/mutation.sh                        # the whole core
#   bash scripts/mutation.sh 'rlsync.codecs*'       # one package or module (mutant-name globs)
#   .venv/bin/mutmut results                        # survivors; `.venv/bin/mutmut show NAME` for a diff
#
# MUTATION_JOBS (default 2) sets the parallel mutants, MUTATION_NICE (default 15) the niceness.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
# fewer, derandomized property-test examples per mutant; the library's thread pool kept to one thread per mutant
export HYPOTHESIS_PROFILE=quick HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 RLSYNC_THREADS=1
unset PYTHONPATH  # the tests must import the mutated copy under mutants/, not this tree
nice -n "${MUTATION_NICE:-15}" mutmut run --max-children "${MUTATION_JOBS:-2}" "$@"
mutmut export-cicd-stats >/dev/null
python - <<'PY'
import json

s = json.load(open("mutants/mutmut-cicd-stats.json"))
killed = s["killed"] + s["timeout"]
tested = killed + s["survived"] + s["no_tests"] + s["suspicious"] + s["segfault"]
print(f"kill rate {100 * killed / max(tested, 1):.1f}%: {killed} of {tested} mutants killed "
      f"({s['timeout']} by timeout); {s['survived']} survived, {s['no_tests']} not reached by any test")
PY
