#!/usr/bin/env bash
# The GPU checks, for a session that is lent the device machine (one H200, no network). Bring
# the built wheel along (carry: dist/, or the .venv), then one device call per part (each fits
# the 10-minute limit of a call):
#   bash benches/gpu/run_all.sh decode    # decode_step.py, at most ~5 minutes
#   bash benches/gpu/run_all.sh routing   # routing_step.py, at most ~6 minutes
# Results land in $OUT (markdown + JSON) and in benches/gpu/results/. Each script refuses
# clearly when no CUDA device is present.
set -euo pipefail
cd "$(dirname "$0")/../.."
part=${1:-decode}
OUT=${OUT:-bench-out/gpu}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/device.txt"
export PYTHONPATH="$PWD/integrations${PYTHONPATH:+:$PYTHONPATH}"
case "$part" in
  decode) OUT="$OUT" timeout 330 python benches/gpu/decode_step.py 2>&1 | tee "$OUT/decode_step.md" ;;
  routing) OUT="$OUT" timeout 390 python benches/gpu/routing_step.py --results --budget-s 300 \
    2>&1 | tee "$OUT/routing_step.md" ;;
  *) echo "usage: run_all.sh decode|routing" >&2; exit 2 ;;
esac
