#!/usr/bin/env bash
# A soak (a tool, not a test; the suite never runs it): one CPU job for as long as it is told, with failures drawn at
# random among kill, exit, hang, spin and slow (--inject-failure random:mtbf=S,seed=K,kinds=...), warm spares and
# rejoins, against the failure-free run of the same config and iterations.
#   scripts/soak.sh [--iters N | --duration S] [--mtbf 7] [--seed 3] [--kinds kill+exit+hang+spin+slow]
#                   [--tp 2] [--dp 3] [--warm-spares 2] [--rejoin-after-s 1] [--max-failures M]
#                   [--config FILE] [--set key=value ...] [--reference METRICS.jsonl] [--run-dir runs/soak] [--out FILE]
# Reports failures injected, fired, absorbed and lost by kind, re-formations, generations, time degraded, goodput,
# the exit code, the loss against the failure-free run (relative 1e-5 per iteration), and RSS, threads and fds of the
# launcher and the ranks per generation (/proc). A table, and JSON (default runs/soak/soak.json). Exit 0 only if
# nothing was lost, nothing leaked and the loss is equal. A lost host is not drawn yet (it needs several launchers).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"  # paths stay relative to the caller's directory
exec "$PY" -m ntp_megatron.bench.soak "$@"
