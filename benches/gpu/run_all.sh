#!/usr/bin/env bash
# The GPU checks, for a session that is lent the device machine (one H200, no network). Here:
# bash benches/gpu/prepare_carry.sh; then ONE device call, carry [".whl"], timeout_s 590:
# bash benches/gpu/device.sh all (installs the wheels, then this script), or, with the wheels
# installed already:
#   bash benches/gpu/run_all.sh all        # the parts below, at most GPU_ALL_S (540 s)
# A session's device time is short (15 minutes, a start included) and an idle machine goes back
# within a minute, so one call that does everything beats two. Or one part per call, with a
# longer budget:
#   bash benches/gpu/run_all.sh decode     # decode_step.py, at most ~5.5 minutes
#   bash benches/gpu/run_all.sh engine     # engine_step.py + host_path.py, at most ~3.5 minutes
#   bash benches/gpu/run_all.sh routing    # routing_step.py, shared prompt, at most ~6.5 minutes
#   bash benches/gpu/run_all.sh reasoning  # routing_step.py --workload reasoning, ~8.5 minutes
#   bash benches/gpu/run_all.sh reasoning-32b  # the same with a Qwen3-32B large model
#   bash benches/gpu/run_all.sh warm       # warm_start.py, at most 5 minutes
#   bash benches/gpu/run_all.sh clock      # tools/clock_check.py over $OUT's rows (seconds, CPU)
# `all`, in the order of what matters most, each part's target rows first: decode (decode and
# catch-ups on every path, graphs included, Qwen3-0.6B / 8B / 32B) 120 s for starting rows, at
# most 150; reasoning with Qwen3-8B (tokencache, the 8B alone, naive-sglang; 2048 new tokens,
# p = 0.1) 140 s, at most 190; reasoning with Qwen3-32B (tokencache, the 32B alone) 70 s, at
# most 110; warm (RoutedEngine.warm_up's time and the first request's TTFT) at most 80; the
# engine step and the shared-prompt routing rows only if time is left; last the clock check
# (the GPU clock priced against the run's own rows, its error and the break-even rate, on the
# host: seconds). Each part runs even
# when the one before fails; its rows say what it measured. Results land in $OUT
# (markdown + JSON: what comes back from the device machine) and in benches/gpu/results/
# (GPU_RESULTS). Each script refuses clearly when no CUDA device is present; GPU_SMOKE=1 runs
# every part with --smoke instead (tiny models on the CPU: the CPU rehearsal,
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
warm() { # $1: hard limit (s)
  stamp "warm (limit $1 s)"
  OUT="$OUT" timeout "$1" "$PY" benches/gpu/warm_start.py ${SMOKE[@]+"${SMOKE[@]}"} 2>&1 |
    tee "$OUT/warm_start.md"
  return "${PIPESTATUS[0]}"
}
routing() { # $1: workload, $2: budget (s) for starting rows, $3: grace (s), $4: hard limit (s),
  # then routing_step.py's arguments ($MD_TAG: a suffix for its markdown's name)
  stamp "routing $1${MD_TAG:-} (budget $2 s, grace $3 s, limit $4 s)"
  local md=routing_step
  [ "$1" = shared-prompt ] || md="routing_step-$1"
  md="$md${MD_TAG:-}"
  OUT="$OUT" timeout "$4" "$PY" benches/gpu/routing_step.py --workload "$1" --results "$RESULTS" \
    --budget-s "$2" --grace-s "$3" "${@:5}" ${SMOKE[@]+"${SMOKE[@]}"} 2>&1 | tee "$OUT/$md.md"
  local rc=${PIPESTATUS[0]}
  keep
  return "$rc"
}
clock_check() { # the GPU clock priced against this run's serving rows, with its own forwards
  stamp "clock check"
  "$PY" -m tokencache_routing clock-check "$OUT" --break-even 2>&1 |
    tee "$OUT/clock_check.md"
  return "${PIPESTATUS[0]}"
}
case "$part" in
  decode) decode 270 330 ;;
  engine) engine 150 210 ;;
  routing) routing shared-prompt 300 60 390 --contexts 8192 2048 ;;
  reasoning) routing reasoning 380 90 500 ;;
  reasoning-32b) MD_TAG=-32b routing reasoning 380 90 500 --large qwen3-32b ;;
  warm) warm 300 ;;
  clock) clock_check ;;
  all)
    rc=0
    decode 120 150 || rc=$?
    routing reasoning 140 40 190 --dispatches tokencache naive-sglang || rc=$?
    MD_TAG=-32b routing reasoning 70 30 110 --large qwen3-32b --dispatches tokencache || rc=$?
    warm 80 || rc=$?
    left=$((TOTAL - (SECONDS - start)))
    if [ "$left" -gt 60 ]; then # the rest of the time: the engine step, then shared prompts
      engine $((left / 3)) $((left / 2)) --host-path-quick || rc=$?
      left=$((TOTAL - (SECONDS - start)))
      [ "$left" -gt 40 ] && { routing shared-prompt $((left - 30)) 15 $((left - 5)) \
        --contexts 8192 --rates 0.1 || rc=$?; }
    else
      stamp "engine and shared-prompt routing not run: ${left} s left of ${TOTAL}"
    fi
    clock_check || rc=$?
    stamp "done (rc $rc)"
    exit "$rc"
    ;;
  *)
    echo "usage: run_all.sh all|decode|reasoning|reasoning-32b|warm|engine|routing|clock" >&2
    exit 2
    ;;
esac
