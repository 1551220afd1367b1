#!/usr/bin/env bash
# Every GPU check in one call, for a session that is lent the device machine (one H200, no
# network). Bring the built wheel along (carry: dist/, or the .venv), then:
#   bash benches/gpu/run_all.sh          # results land in $OUT (markdown + JSON)
# Each script refuses clearly when no CUDA device is present.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench-out/gpu}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/device.txt"
export PYTHONPATH="$PWD/integrations${PYTHONPATH:+:$PYTHONPATH}"
OUT="$OUT" timeout 400 python benches/gpu/decode_step.py 2>&1 | tee "$OUT/decode_step.md"
if [ -f benches/gpu/routing_step.py ]; then
  OUT="$OUT" timeout 150 python benches/gpu/routing_step.py 2>&1 | tee "$OUT/routing_step.md"
fi
