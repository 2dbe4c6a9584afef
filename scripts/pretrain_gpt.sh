#!/usr/bin/env bash
# The main job: GPT pretraining on Megatron-Core with ntp-megatron.
#   scripts/pretrain_gpt.sh [--config FILE] [--set key=value ...] [--inject-failure SPEC] [Megatron-style flags]
# With no arguments: configs/main_job.yaml, the tiny CPU demo (2 replicas × TP2 on 4 gloo ranks, mock data, NTP on)
# for 120 iterations with one failure: launch rank 3 is SIGKILLed in the backward pass of iteration 15; its replica
# re-forms at TP1 and trains on; 2 s later a warm spare takes its place, is admitted at an iteration boundary, and
# the replica is back at TP2 for the rest of the run. Validation loss every 40 iterations (4 batches) and at the end.
# The same job with other settings: scripts/pretrain_gpt.sh --config configs/main_job.yaml --train-iters 300.
# With arguments and no --config: the default config (configs/tiny_cpu.yaml), no failure.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"  # paths stay relative to the caller's directory
if [ $# -eq 0 ]; then
  set -- --config "$ROOT/configs/main_job.yaml"
fi
exec "$PY" -m ntp_megatron.launch.launcher "$@"
