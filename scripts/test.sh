#!/usr/bin/env bash
# The test suite: pure unit tests plus multi-process gloo runs of the real training stack.
#   scripts/test.sh                the whole suite: the unit tier on one worker process per core, then the job tier
#                                  two jobs at a time, then the job tests that time what they watch, one at a time
#   scripts/test.sh [pytest args]  one pytest run with these arguments, e.g. -m unit -n auto, or a test's path
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$ROOT"
if [ "$#" -gt 0 ]; then
  exec "$PY" -m pytest "$@"
fi
unit=0
"$PY" -m pytest tests/unit -n auto || unit=$?  # the tiers by their folders: neither collects the other's modules
# The job tier: two jobs at a time (a job leaves a third of the cores idle: start-up, waits), a file's tests on one
# worker (they share its reference runs); then the timed tests alone.
job=0
"$PY" -m pytest tests/jobs -m "not timed" -n 2 --dist loadfile --no-loadscope-reorder || job=$?  # longest files first (tests/conftest.py)
timed=0
"$PY" -m pytest tests/jobs -m timed || timed=$?
echo "scripts/test.sh: unit tier exit $unit, job tier exit $job, timed jobs exit $timed"
[ "$unit" -eq 0 ] && [ "$job" -eq 0 ] && [ "$timed" -eq 0 ]
