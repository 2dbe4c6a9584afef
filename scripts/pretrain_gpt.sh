#!/usr/bin/env bash
# The main job: GPT pretraining on Megatron-Core with ntp-megatron.
#   scripts/pretrain_gpt.sh [--config FILE] [--set key=value ...] [--metrics-file PATH] [Megatron-style flags]
# With no arguments: configs/tiny_cpu.yaml (2 replicas × TP2 on 4 gloo ranks, mock data, 50 iterations).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$ROOT"
exec "$PY" -m ntp_megatron.launcher "$@"
