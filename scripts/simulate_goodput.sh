#!/usr/bin/env bash
# Cluster-scale goodput simulator (docs/sim.md). Usage: scripts/simulate_goodput.sh [CONFIG] [--set k=v ...] [--out DIR]
# e.g. scripts/simulate_goodput.sh configs/sim/study_b_nvl32_boost.yaml
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
if [ ! -x "$ROOT/.venv/bin/ntp-sim" ]; then
    echo "simulate_goodput.sh: creating $ROOT/.venv" >&2
    python3 -m venv "$ROOT/.venv"
    "$ROOT/.venv/bin/pip" install -q -e "$ROOT"
fi
exec "$ROOT/.venv/bin/python" -m ntp_megatron.sim "$@"
