#!/usr/bin/env bash
# Cluster-scale goodput simulator (docs/simulator.md).
#   scripts/simulate_goodput.sh [CONFIG] [--set k=v ...] [--out DIR]
#   e.g. scripts/simulate_goodput.sh configs/sim/paper_fig6.yaml
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"  # paths stay relative to the caller's directory
exec "$PY" -m ntp_megatron.sim "$@"
