#!/usr/bin/env bash
# Mutation testing of the estimators, the alignment convention, the staleness buffer and,
# since 2026-11-26 (issue 36), the sampling core, the plan, the partition rules and the
# pipeline's core modules.
#
# mutmut (configured in pyproject.toml, [tool.mutmut]) rewrites each function of
#   asyncopd_jax/estimators/*, asyncopd_jax/alignment.py, asyncopd_jax/pipeline/staleness.py,
#   asyncopd_jax/sampling/*, asyncopd_jax/scale/plan.py, asyncopd_jax/models/partitioning.py,
#   asyncopd_jax/pipeline/{spool,snapshots,rollout,producer,placement}.py
# into many small mutants (an operator flipped, a constant changed, an argument dropped, ...)
# and runs, for each mutant, the fast tests that call that function. A mutant that no test
# notices "survives": either a test is missing, or the mutant is equivalent to the original.
# The current scores are in docs/testing.md; every run and survivor in docs/log/mutation-history.md.
#
# Not part of CI. The first three targets take about two hours on 2 cores; the newer ones
# add about 5,000 mutants whose tests compile small models (10-60 s a mutant): days for all
# of them, so they are scored by a random sample (docs/testing.md, "Sampled scores"):
#   bash tools/mutation.sh            # full run (a fresh mutants/ directory)
#   bash tools/mutation.sh --resume   # continue or re-check an earlier run
#   bash tools/mutation.sh --resume 'asyncopd_jax.estimators.logspace.*'
#                                     # only the mutants whose names match (fnmatch patterns)
#   python tools/mutation_sample.py 30 asyncopd_jax.sampling. > sample.txt
#   bash tools/mutation.sh --resume $(cat sample.txt)
#                                     # a random sample of one area (seed 36), and its score
set -euo pipefail
cd "$(dirname "$0")/.."

python -c "import mutmut" 2>/dev/null || python -m pip install --quiet -e ".[test,mutation]"
if [ "${1:-}" = "--resume" ]; then shift; else rm -rf mutants; fi

# Tests run on the CPU with the 8 virtual devices of tests/conftest.py; one XLA thread pool
# per mutant process keeps the parallel workers from oversubscribing the cores.
export JAX_PLATFORMS=cpu
mutmut run --max-children "${MUTMUT_CHILDREN:-$(nproc)}" "$@" || true

# The score: killed (a test failed, or the mutant hung past the timeout) over all mutants.
# A mutant no test reaches counts as a survivor.
mutmut export-cicd-stats >/dev/null
python - <<'PY'
import json
s = json.load(open("mutants/mutmut-cicd-stats.json"))
killed = s["killed"] + s["timeout"] + s["segfault"]
checked = killed + s["survived"] + s["no_tests"] + s["suspicious"]
print(f"mutants: {s['total']}  checked: {checked}  killed: {killed} (timeouts: {s['timeout']})  "
      f"survived: {s['survived']}  no tests: {s['no_tests']}  suspicious: {s['suspicious']}")
print(f"mutation score of the checked mutants: {100 * killed / max(checked, 1):.1f} %"
      + ("" if checked == s["total"] else f"  ({s['total'] - checked} not checked yet: rerun with --resume)"))
PY
echo "survivors (mutmut show NAME prints the diff):"
mutmut results | grep -v ": not checked$" || true
