#!/usr/bin/env bash
# The GPU checks, for a session that is lent the device machine (one H200, no network). Here:
# bash benches/gpu/prepare_carry.sh; then ONE device call, carry [".whl"], timeout_s 590:
# bash benches/gpu/device.sh all (installs the wheels, then this script), or, with the wheels
# installed already:
#   bash benches/gpu/run_all.sh all       # both below, shorter budgets, at most ~9.5 minutes
# A session's device time is short (15 minutes, a start included) and an idle machine goes back
# within a minute, so one call that does everything beats two. Or one part per call:
#   bash benches/gpu/run_all.sh decode    # decode_step.py, at most ~5.5 minutes
#   bash benches/gpu/run_all.sh routing   # routing_step.py, at most ~6.5 minutes
#   bash benches/gpu/run_all.sh engine    # engine_step.py + host_path.py, at most ~2 minutes
# Results land in $OUT (markdown + JSON) and in benches/gpu/results/. Each script refuses
# clearly when no CUDA device is present.
set -euo pipefail
cd "$(dirname "$0")/../.."
part=${1:-all}
OUT=${OUT:-bench-out/gpu}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/device.txt"
export PYTHONPATH="$PWD/integrations${PYTHONPATH:+:$PYTHONPATH}"
decode() { # $1: budget (s) for starting rows, $2: hard limit (s)
  OUT="$OUT" timeout "$2" python benches/gpu/decode_step.py --budget-s "$1" 2>&1 |
    tee "$OUT/decode_step.md"
}
engine() { # the engine's decode step beside the runner's, then the host path on this CPU
  OUT="$OUT" timeout "$1" python benches/gpu/engine_step.py 2>&1 | tee "$OUT/engine_step.md"
}
routing() {
  OUT="$OUT" timeout "$2" python benches/gpu/routing_step.py --results --budget-s "$1" 2>&1 |
    tee "$OUT/routing_step.md"
}
case "$part" in
  decode) decode 270 330 ;;
  routing) routing 300 390 ;;
  engine) engine 150 ;;
  # Each part runs even when the one before fails (its rows say what it measured).
  all) rc=0; decode 170 220 || rc=$?; engine 90 || rc=$?; routing 200 250 || rc=$?; exit "$rc" ;;
  *) echo "usage: run_all.sh all|decode|routing|engine" >&2; exit 2 ;;
esac
