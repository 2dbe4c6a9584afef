#!/usr/bin/env bash
# The test suite: pure unit tests plus multi-process gloo runs of the real training stack.
#   scripts/test.sh                the whole suite: the unit tier on one worker process per core, then the job tier
#                                  in one process (its jobs use every core, and some of them time what they watch)
#   scripts/test.sh [pytest args]  one pytest run with these arguments, e.g. -m unit -n auto, or a test's path
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$ROOT"
if [ "$#" -gt 0 ]; then
  exec "$PY" -m pytest "$@"
fi
unit=0
"$PY" -m pytest tests/unit -n auto || unit=$?  # the tiers by their folders: neither collects the other's modules
job=0
"$PY" -m pytest tests/jobs || job=$?
echo "scripts/test.sh: unit tier exit $unit, job tier exit $job"
[ "$unit" -eq 0 ] && [ "$job" -eq 0 ]
