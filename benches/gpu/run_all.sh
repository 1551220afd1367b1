#!/usr/bin/env bash
# The GPU checks, for a session that is lent the device machine (one H200, no network). Here:
# bash benches/gpu/prepare_carry.sh; then ONE device call, carry [".whl"], timeout_s 590:
# bash benches/gpu/device.sh all (installs the wheels, then this script), or, with the wheels
# installed already:
#   bash benches/gpu/run_all.sh all        # the four parts below, at most GPU_ALL_S (540 s)
# A session's device time is short (15 minutes, a start included) and an idle machine goes back
# within a minute, so one call that does everything beats two. Or one part per call, with a
# longer budget:
#   bash benches/gpu/run_all.sh decode     # decode_step.py, at most ~5.5 minutes
#   bash benches/gpu/run_all.sh engine     # engine_step.py + host_path.py, at most ~3.5 minutes
#   bash benches/gpu/run_all.sh routing    # routing_step.py, shared prompt, at most ~6.5 minutes
#   bash benches/gpu/run_all.sh reasoning  # routing_step.py --workload reasoning, ~8.5 minutes
# `all`, target rows first in every part (issue 19): decode (runner decode at batch 32 x 2048,
# Qwen3-0.6B <= 3 ms, 8B <= 8 ms) 130 s for starting rows, at most 170; engine (the engine's
# step <= 1.2x the runner's, overlap on and off) 50 s, at most 80; routing, shared prompt, p = 0.1,
# 8192 then 2048 (tokencache >= 1.5x naive at 8192) 70 s, at most 105; reasoning (2048 new
# tokens, tokencache >= 5x naive-sglang) what is left, at most until GPU_ALL_S. Each part runs
# even when the one before fails; its rows say what it measured. Results land in $OUT
# (markdown + JSON: what comes back from the device machine) and in benches/gpu/results/
# (GPU_RESULTS). Each script refuses clearly when no CUDA device is present; GPU_SMOKE=1 runs
# every part with --smoke instead (tiny models on the CPU, ~1 minute: the CPU rehearsal,
# tests/routing/test_gpu_script_smoke.py).
set -uo pipefail
cd "$(dirname "$0")/../.."
part=${1:-all}
OUT=${OUT:-bench-out/gpu}
TOTAL=${GPU_ALL_S:-540} # `all`: everything ends by then (device.sh's install comes before)
RESULTS=${GPU_RESULTS:-benches/gpu/results}
PY=${PYTHON:-python3}
SMOKE=()
[ -n "${GPU_SMOKE:-}" ] && SMOKE=(--smoke)
mkdir -p "$OUT" "$RESULTS"
start=$SECONDS
nvidia-smi --query-gpu=name,memory.total --format=csv 2>&1 | tee "$OUT/device.txt"
export PYTHONPATH="$PWD/integrations${PYTHONPATH:+:$PYTHONPATH}"
keep() { # the named result files of $OUT, also in $RESULTS
  find "$OUT" -maxdepth 1 -name '*-[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]*.json' \
    -exec cp -f {} "$RESULTS"/ \;
}
stamp() { echo "== run_all.sh: $1 at $((SECONDS - start)) s" | tee -a "$OUT/run_all.log"; }
decode() { # $1: budget (s) for starting rows, $2: hard limit (s)
  stamp "decode (budget $1 s, limit $2 s)"
  OUT="$OUT" timeout "$2" "$PY" benches/gpu/decode_step.py --budget-s "$1" \
    ${SMOKE[@]+"${SMOKE[@]}"} 2>&1 | tee "$OUT/decode_step.md"
  local rc=${PIPESTATUS[0]}
  keep
  return "$rc"
}
engine() { # the engine's decode step beside the runner's (overlap on and off), then the host
  # path on this CPU; $1: budget (s), $2: hard limit (s), then engine_step.py's arguments
  stamp "engine (budget $1 s, limit $2 s)"
  OUT="$OUT" timeout "$2" "$PY" benches/gpu/engine_step.py --budget-s "$1" "${@:3}" \
    ${SMOKE[@]+"${SMOKE[@]}"} 2>&1 | tee "$OUT/engine_step.md"
  local rc=${PIPESTATUS[0]}
  keep
  return "$rc"
}
routing() { # $1: workload, $2: budget (s) for starting rows, $3: grace (s), $4: hard limit (s),
  # then routing_step.py's arguments
  stamp "routing $1 (budget $2 s, grace $3 s, limit $4 s)"
  local md=routing_step
  [ "$1" = shared-prompt ] || md="routing_step-$1"
  OUT="$OUT" timeout "$4" "$PY" benches/gpu/routing_step.py --workload "$1" --results "$RESULTS" \
    --budget-s "$2" --grace-s "$3" "${@:5}" ${SMOKE[@]+"${SMOKE[@]}"} 2>&1 | tee "$OUT/$md.md"
  local rc=${PIPESTATUS[0]}
  keep
  return "$rc"
}
case "$part" in
  decode) decode 270 330 ;;
  engine) engine 150 210 ;;
  routing) routing shared-prompt 300 60 390 --contexts 8192 2048 ;;
  reasoning) routing reasoning 380 90 500 ;;
  all)
    rc=0
    decode 130 170 || rc=$?
    engine 50 80 --host-path-quick || rc=$?
    routing shared-prompt 70 25 105 --contexts 8192 2048 --rates 0.1 || rc=$?
    left=$((TOTAL - (SECONDS - start)))
    if [ "$left" -gt 60 ]; then # the rest of the time: reasoning's limit ends with TOTAL
      routing reasoning $((left - 60)) 45 $((left - 5)) || rc=$?
    else
      stamp "reasoning not run: ${left} s left of ${TOTAL}"
      rc=1
    fi
    stamp "done (rc $rc)"
    exit "$rc"
    ;;
  *)
    echo "usage: run_all.sh all|decode|engine|routing|reasoning" >&2
    exit 2
    ;;
esac
