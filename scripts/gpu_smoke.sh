#!/usr/bin/env bash
# First check of the GPU path on one GPU node. NOT RUN by this project (no GPU was available): run it first.
#   NTP_PYTHON=/path/to/python scripts/gpu_smoke.sh [--out DIR] [--cpu]
# Uses the Python of your GPU environment (default: python3 on PATH) with this project installed into it
# (`pip install -e <repo>` keeps the environment's torch). Each step is a short job; the script stops at the
# first failure and says which step failed. Steps:
#   1. environment: torch, CUDA, NCCL, GPU count, Transformer Engine and Apex present or not
#   2. NCCL + bf16: plain Megatron-Core, TP2 on 2 GPUs, 20 iterations; the loss must fall
#   3. Transformer Engine layers (when installed): step 2 with --transformer-impl transformer_engine
#   4. NTP + NCCL + bf16: two replicas of different widths, TP2 + TP1 (3 GPUs: slot 1 of replica 1 left out), with
#      state checksums: every TP rank of every replica must report the same bits after every iteration
#   5. a live kill on NCCL: the job of step 4, launch rank 1 (replica 0, slot 1) SIGKILLed in the backward pass of
#      iteration 8; every communicator is aborted and every group made fresh, replica 0 re-forms at TP1, replica 1
#      keeps its model and optimizer, and the run reaches its last iteration with every rank's checksums agreeing
# --cpu runs the same steps on CPU with gloo (no GPU needed): a check of this script, not of the GPU path.
set -euo pipefail
PY="${NTP_PYTHON:-python3}"
OUT="runs/gpu_smoke"
DEVICE=(--set training.device=cuda --set parallel.backend=nccl)
CPU=0
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --cpu) CPU=1; DEVICE=(--set training.device=cpu --set parallel.backend=gloo); shift ;;
    *) echo "gpu_smoke.sh: unknown argument '$1' (allowed: --out DIR, --cpu)" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
step() { echo; echo "== gpu_smoke: $*"; }
fail() { echo "gpu_smoke: FAILED at step: $*" >&2; exit 1; }

step "1. environment"
"$PY" - <<'PY' || fail "1 (environment: is ntp-megatron installed in this Python? pip install -e <repo>)"
import importlib.util, torch
import ntp_megatron  # noqa: F401
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {torch.cuda.nccl.version() if torch.cuda.is_available() else None}")
print(f"GPUs: {torch.cuda.device_count()}; Transformer Engine: {importlib.util.find_spec('transformer_engine') is not None}; "
      f"Apex: {importlib.util.find_spec('apex') is not None}")
PY
GPUS="$("$PY" -c 'import torch; print(torch.cuda.device_count())')"
if [ "$CPU" = 1 ]; then GPUS=3; elif [ "$GPUS" -lt 2 ]; then fail "1 (needs at least 2 visible GPUs, found $GPUS)"; fi
HAS_TE="$("$PY" -c 'import importlib.util; print(int(importlib.util.find_spec("transformer_engine") is not None))')"
[ "$CPU" = 0 ] || HAS_TE=0
COMMON=("${DEVICE[@]}" --bf16
        --train-iters 20 --lr-warmup-iters 2 --log-interval 5 --set logging.tensorboard_dir=)

loss_falls() {  # metrics file: the last iteration's loss below the first's
  "$PY" - "$1" <<'PY'
import json, sys
losses = [r["lm_loss"] for r in map(json.loads, open(sys.argv[1])) if r.get("kind") == "iteration"]
print(f"lm loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} iterations")
sys.exit(0 if losses and losses[-1] < losses[0] else 1)
PY
}

step "2. NCCL + bf16: plain Megatron-Core TP2"
"$PY" -m ntp_megatron.launch.launcher "${COMMON[@]}" --set ntp.enabled=false --tensor-model-parallel-size 2 \
  --data-parallel-size 1 --run-dir "$OUT/plain_tp2" || fail "2 (plain TP2, NCCL, bf16)"
loss_falls "$OUT/plain_tp2/metrics.jsonl" || fail "2 (the loss did not fall)"

if [ "$HAS_TE" = 1 ]; then
  step "3. Transformer Engine layers"
  "$PY" -m ntp_megatron.launch.launcher "${COMMON[@]}" --set ntp.enabled=false --tensor-model-parallel-size 2 \
    --data-parallel-size 1 --transformer-impl transformer_engine --run-dir "$OUT/plain_te" || fail "3 (Transformer Engine layers)"
  loss_falls "$OUT/plain_te/metrics.jsonl" || fail "3 (the loss did not fall)"
else
  step "3. Transformer Engine layers: skipped (not installed)"
fi

checksums_agree() {  # metrics file: every rank reports the same checksums at every iteration
  "$PY" - "$1" <<'PY'
import json, sys
views = {}
for r in map(json.loads, open(sys.argv[1])):
    if r.get("kind") == "state_checksums":
        views.setdefault(r["iteration"], set()).add(json.dumps(r["checksums"], sort_keys=True))
bad = [it for it, seen in views.items() if len(seen) != 1]
print(f"checksums: {len(views)} iterations, every rank's view; {len(bad)} with disagreeing views")
sys.exit(1 if bad or not views else 0)
PY
}

step "4. NTP: two replicas of different widths on NCCL, bf16"
[ "$GPUS" -ge 3 ] || { echo "gpu_smoke: step 4 needs 3 GPUs (TP2 + TP1); skipped"; exit 0; }
"$PY" -m ntp_megatron.launch.launcher "${COMMON[@]}" --set ntp.enabled=true --tensor-model-parallel-size 2 \
  --data-parallel-size 2 --set 'ntp.dead_slots=[1:1]' --set logging.state_checksums=true --run-dir "$OUT/ntp" \
  || fail "4 (NTP job)"
loss_falls "$OUT/ntp/metrics.jsonl" || fail "4 (the loss did not fall)"
checksums_agree "$OUT/ntp/metrics.jsonl" || fail "4 (TP ranks of a replica disagree)"

step "5. a live kill on NCCL: replica 0 re-forms at TP1, replica 1 goes on"
"$PY" -m ntp_megatron.launch.launcher "${COMMON[@]}" --set ntp.enabled=true --tensor-model-parallel-size 2 \
  --data-parallel-size 2 --set 'ntp.dead_slots=[1:1]' --set logging.state_checksums=true \
  --inject-failure kill:rank=1,iter=8,phase=backward --run-dir "$OUT/ntp_kill" || fail "5 (NTP job with a live kill)"
"$PY" - "$OUT/ntp_kill/metrics.jsonl" <<'PY' || fail "5 (no re-formation at TP [1, 1], or iterations missing)"
import json, sys
records = [json.loads(line) for line in open(sys.argv[1])]
reformed = [r for r in records if r.get("event") == "reformed"]
iterations = sorted({r["iteration"] for r in records if r.get("kind") == "iteration"})
kept = [r for r in records if r.get("kind") == "reform_rank" and r["generation"] == 1 and r["replica"] == 1]
print(f"re-formed: {[(r['generation'], r['tp_per_replica'], round(r['recovery_s'], 2)) for r in reformed]}; "
      f"iterations {iterations[:1]}..{iterations[-1:]}; replica 1 made {[r['groups_made'] for r in kept]}")
sys.exit(0 if reformed and reformed[-1]["tp_per_replica"] == [1, 1] and iterations == list(range(1, 21)) else 1)
PY
checksums_agree "$OUT/ntp_kill/metrics.jsonl" || fail "5 (ranks disagree after the re-formation)"
echo; echo "gpu_smoke: all steps passed (outputs in $OUT)"
