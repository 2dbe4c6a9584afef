#!/usr/bin/env bash
# Benchmarks (not tests): NTP vs plain Megatron-Core step time, measured side by side in one run.
#   scripts/bench.sh [--iters N] [--rounds R] [--out runs/bench/bench.json] [--only checkpoint-stall|init|memory|recovery|control-plane] [--smoke]
# Also: NTP's failure recovery against restart-from-checkpoint, the checkpoint stall (sync vs async save), and
# one rank's model initialisation at TP 1..8, Megatron replay vs layout-free (time, peak RSS), per-rank training
# state with the distributed optimizer vs plain Megatron-Core's, re-forming ranks' peaks, and recovery at TP2 and
# TP4 x DP2 with the groups a failure did not touch kept vs every group made anew (--only recovery), and the control
# plane's load test at 1K/4K/10K simulated ranks, one store against two levels (--only control-plane).
# Prints a table of ratios and writes JSON (its degraded_step_time_ratio section is goodput-simulator calibration).
# --smoke: every part once at its smallest size (what the test suite runs; its figures mean nothing).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"  # paths stay relative to the caller's directory
exec "$PY" -m ntp_megatron.bench "$@"
