#!/usr/bin/env bash
# The main job: GPT pretraining on Megatron-Core with ntp-megatron.
#   scripts/pretrain_gpt.sh [--config FILE] [--set key=value ...] [--inject-failure SPEC] [Megatron-style flags]
# With no arguments: configs/tiny_cpu.yaml (2 replicas × TP2 on 4 gloo ranks, mock data, NTP on) for 120
# iterations, with one failure: launch rank 3 is SIGKILLed in the backward pass of iteration 15; its replica
# re-forms at TP1 and trains on; a replacement process starts 2 s later, is admitted at an iteration boundary,
# and the replica is back at TP2 for the rest of the run. Validation loss every 40 iterations (4 batches) and at the end.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"  # paths stay relative to the caller's directory
if [ $# -eq 0 ]; then
  set -- --train-iters 120 --eval-interval 40 --eval-iters 4 --inject-failure "kill:rank=3,iter=15,phase=backward" \
    --set ntp.rejoin_after_s=2
fi
exec "$PY" -m ntp_megatron.launcher "$@"
