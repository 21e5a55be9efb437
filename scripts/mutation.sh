#!/usr/bin/env bash
# Mutation testing of the sync library's core (format, codecs/, detect, hashing, protocol/, bucket/) with mutmut.
# Not part of CI. Configuration: [tool.mutmut] in pyproject.toml.
#
#   bash scripts/mutation.sh                        # the whole core
#   bash scripts/mutation.sh 'rlsync.codecs*'       # one package or module (mutant-name globs)
#   bash scripts/mutation.sh results                # survivors; `bash scripts/mutation.sh show NAME` for a diff
#
# mutmut names a mutant by its file's path and puts only ./ or src/ of its copy on sys.path, so the library's
# shared/rlsync would be named shared.rlsync.* and imported from the editable install instead of the mutated
# copy. The run therefore works in .mutation/ (git-ignored): a copy of the tree with the library at src/rlsync.
# Results are cached in .mutation/mutants/: a second run only re-tests mutants of functions that changed.
#
# MUTATION_JOBS (default 2) sets the parallel mutants, MUTATION_NICE (default 15) the niceness.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
# fewer, derandomized property-test examples per mutant; the library's thread pool kept to one thread per mutant
export HYPOTHESIS_PROFILE=quick HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 RLSYNC_THREADS=1
unset PYTHONPATH  # the tests must import the mutated copy, not this tree
work=.mutation
mkdir -p "$work/src"
for part in tests benchmarks testing trainer_space rollout_space env_space app.py; do
    rm -rf "${work:?}/$part" && cp -a "$part" "$work/$part"  # -a keeps the times mutmut's cache compares
done
rm -rf "$work/src/rlsync" && cp -a shared/rlsync "$work/src/rlsync"
sed 's#shared/rlsync#src/rlsync#g' pyproject.toml > "$work/pyproject.toml"
cd "$work"
case "${1:-run}" in
    results|show|browse) exec mutmut "$@" ;;
esac
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
