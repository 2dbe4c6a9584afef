#!/usr/bin/env bash
# The NTP equivalence property test on fresh random cases (the suite runs a fixed, derandomized set):
#   scripts/fuzz_equivalence.sh --examples 100 [--seed S] [--log runs/fuzz/cases.jsonl]
# Every case is a real NTP job and plain Megatron-Core at TP1 (see tests/jobs/equivalence/test_ntp_equivalence.py). One line
# per case goes to the log (case, outcome, worst differences, seconds); a summary is printed at the end.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
examples=100
seed=""
log="$ROOT/runs/fuzz/cases.jsonl"
while [ $# -gt 0 ]; do
  case "$1" in
    --examples) examples="$2"; shift 2 ;;
    --seed) seed="$2"; shift 2 ;;
    --log) log="$(realpath -m "$2")"; shift 2 ;;
    -h|--help) sed -n 2,5p "$0"; exit 0 ;;
    *) echo "fuzz_equivalence.sh: unknown argument '$1' (allowed: --examples N, --seed S, --log FILE)" >&2; exit 2 ;;
  esac
done
case "$examples" in ''|*[!0-9]*) echo "fuzz_equivalence.sh: --examples must be a positive integer, got '$examples'" >&2; exit 2 ;; esac
mkdir -p "$(dirname "$log")"
: > "$log"
cd "$ROOT"
status=0
NTP_FUZZ_EXAMPLES="$examples" NTP_FUZZ_LOG="$log" "$PY" -m pytest -q -p no:cacheprovider \
  "tests/jobs/equivalence/test_ntp_equivalence.py::test_ntp_computes_plain_megatron_tp1" \
  --hypothesis-seed="${seed:-$RANDOM$RANDOM}" --hypothesis-show-statistics || status=$?
"$PY" - "$log" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
ok = [r for r in rows if r["ok"]]
print(f"\nfuzz_equivalence: {len(rows)} cases run, {len(ok)} passed, {len(rows) - len(ok)} failed")
if ok:
    for key in ("loss", "grad_norm", "l2", "peak"):
        print(f"  worst {key:<9} over passing cases: {max(r['worst'][key] for r in ok):.2e}")
    print(f"  cases that clipped: {sum(r['clipped'] for r in ok)}; degraded topologies: "
          f"{sum(bool(r['case']['dead']) for r in ok)}; with overlap: {sum(r['case']['overlap'] for r in ok)}")
for r in rows:
    if not r["ok"]:
        print(f"  FAILED {r['case']}\n    {r['error'][:500]}")
PY
exit $status
