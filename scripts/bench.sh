#!/usr/bin/env bash
# Benchmarks (not tests): NTP vs plain Megatron-Core step time, measured side by side in one run.
#   scripts/bench.sh [--iters N] [--rounds R] [--out runs/bench/bench.json] [--full | --smoke]
#                    [--only step-time|recovery|control-plane|slow-rank|init|memory|checkpoint-stall]
# Also: NTP's failure recovery against restart-from-checkpoint, the checkpoint stall (sync vs async save), and
# one rank's model initialisation, Megatron replay vs layout-free (time, peak RSS), per-rank training state with the
# distributed optimizer vs plain Megatron-Core's, re-forming ranks' peaks, recovery with the groups a failure did not
# touch kept vs every group made anew, the control plane's load test (one store against two levels), and a slow rank
# rebalanced and a degraded replica boosted.
# With no arguments every part runs with its headline ratio in about 10 minutes; --full runs every part as
# docs/benchmarks.md measured it (over 20 minutes: the control plane at 4K/10K ranks, the slow rank's long schedule);
# --only PART runs one part (with --full, as its section measured it). ntp_megatron/bench/sizes.py has the sizes.
# Prints a table of ratios and writes JSON (its degraded_step_time_ratio section is goodput-simulator calibration).
# --smoke: every part once at its smallest size (what the test suite runs; its figures mean nothing).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"  # paths stay relative to the caller's directory
exec "$PY" -m ntp_megatron.bench "$@"
