#!/usr/bin/env bash
# The test suite: pure unit tests plus multi-process gloo runs of the real training stack.
#   scripts/test.sh [pytest args]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$ROOT"
exec "$PY" -m pytest "$@"
