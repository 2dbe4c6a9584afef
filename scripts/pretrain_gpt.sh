#!/usr/bin/env bash
# The main job: GPT pretraining on Megatron-Core with ntp-megatron.
#   scripts/pretrain_gpt.sh [--config FILE] [--set key=value ...] [--inject-failure SPEC] [Megatron-style flags]
# With no arguments: configs/tiny_cpu.yaml (2 replicas × TP2 on 4 gloo ranks, mock data, 50 iterations, NTP on)
# and one injected failure: launch rank 3 is SIGKILLed in the backward pass of iteration 25; its replica re-forms
# at TP1 and the run goes on to iteration 50.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$ROOT"
if [ $# -eq 0 ]; then
  set -- --inject-failure "kill:rank=3,iter=25,phase=backward"
fi
exec "$PY" -m ntp_megatron.launcher "$@"
