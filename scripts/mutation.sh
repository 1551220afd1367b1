#!/usr/bin/env bash
# Mutation testing (not in CI: far too slow for it). Runs on a clean export of HEAD in a
# scratch folder, never in the work tree (mutmut writes a mutants/ copy, cargo-mutants builds
# in its own copy), so it can run beside other work; results and a summary land in $OUT.
#
#   bash scripts/mutation.sh python [MODULE...] [-- PYTEST_ARGS...]
#       mutmut on integrations/tokencache_routing/core/MODULE.py (default: sampling, the
#       scheduler's modules (SCHEDULER_MODULES below) and batch; rng, routers and holdback too
#       if named; a MODULE with a folder, drivers/events or sim/clock, is taken under
#       tokencache_routing/ instead of core/), against the routing tests named in
#       TESTS_<module> below (PYTEST_ARGS are added to pytest's). MUTANTS narrows to mutant
#       names, e.g. MUTANTS='tokencache_routing.core.sampling.x__draw*' (mutmut's own naming).
#   bash scripts/mutation.sh serve [MODULE...] [-- PYTEST_ARGS...]
#       the same for integrations/tokencache_serve/MODULE.py (default: generation protocol
#       errors textstream), against the server tests named in TESTS_serve_<module> below
#       (names like tokencache_serve.protocol.x__common__mutmut_3).
#   bash scripts/mutation.sh rust [CARGO_MUTANTS_ARGS...]
#       cargo mutants on rust/tokencache-core (paths from the repository root, e.g.
#       --file rust/tokencache-core/src/cell.rs --re 'NodeCell::(pin|unpin)').
#
# Environment: OUT (default /tmp/tokencache-mutation), JOBS (parallel mutants, default 1),
# TIMEOUT_S (wall limit of each module's run, default 3600; partial results are kept),
# MUT_TIMEOUT_MULTIPLIER / MUT_TIMEOUT_CONSTANT (mutmut's per-mutant limit, default 3 / 20: a
# mutant's tests are stopped, verdict "timeout", after (T + constant) * multiplier wall seconds,
# T their clean duration; mutmut's own defaults, 15 / 1, let a hung mutant run ~13 minutes).
# SAMPLE=N or N/K (python, serve): a systematic sample, every Nth mutant of the module in
# mutmut's generation order (source order, then mutant number) from index K (default 0); the
# names go to $OUT/sample-<module>.txt and are run instead of MUTANTS (with MUTANTS set, the
# sample is drawn from the mutants its globs match).
# Tools: mutmut and its dependencies pinned in requirements/optional/mutation.txt (installed
# into .venv on first use), cargo-mutants (`cargo install cargo-mutants --locked --version
# 27.1.0`). Record what a run killed in docs/MUTATION.md with its commit and scope.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${OUT:-/tmp/tokencache-mutation}"
JOBS="${JOBS:-1}"
TIMEOUT_S="${TIMEOUT_S:-3600}"
MUT_TIMEOUT_MULTIPLIER="${MUT_TIMEOUT_MULTIPLIER:-3}"
MUT_TIMEOUT_CONSTANT="${MUT_TIMEOUT_CONSTANT:-20}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PY="$ROOT/.venv/bin/python"
[ -x "$PY" ] || PY=python3

# The tests that exercise each module quickly (the engine-level ones are slower: kept to the
# files that pin the module's promises).
TESTS_sampling="tests/routing/test_sampling.py tests/routing/test_sampling_draws.py tests/routing/test_routers.py tests/routing/test_epilogue_routing.py"
# (no test that runs a bench in a subprocess: the child cannot import mutmut's trampoline)
TESTS_events="tests/routing/test_overlap.py tests/routing/test_host_path.py tests/routing/test_clock.py"
TESTS_clock="tests/routing/test_clock.py tests/routing/test_tp_cost.py"
TESTS_routers="tests/routing/test_routers.py tests/routing/test_epilogue_routing.py"
TESTS_rng="tests/routing/test_sampling_rng.py tests/routing/test_sampling.py tests/routing/test_routers.py"
TESTS_scheduler="tests/routing/test_scheduler_mutants.py tests/routing/test_scheduling_rules.py tests/routing/test_admission.py tests/routing/test_abort.py tests/routing/test_catchup_holdback.py tests/routing/test_chunked_prefill.py tests/routing/test_launch_policy.py tests/routing/test_finish_reason.py"
# The scheduler's modules (core/scheduler.py only composes them): the scheduler's tests, plus
# those that pin each module's own promises.
SCHEDULER_MODULES="request_lists admission batch_planning forward_finishing launch_policy scheduler_config"
TESTS_request_lists="$TESTS_scheduler tests/routing/test_failures.py"
TESTS_admission="$TESTS_scheduler"
TESTS_batch_planning="$TESTS_scheduler tests/routing/test_overlap.py tests/routing/test_launch_policy.py"
TESTS_forward_finishing="$TESTS_scheduler tests/routing/test_finish_reason.py tests/routing/test_failures.py tests/routing/test_overlap.py"
TESTS_launch_policy="tests/routing/test_launch_policy.py tests/routing/test_scheduler_mutants.py"
TESTS_scheduler_config="tests/routing/test_launch_policy.py tests/routing/test_engine_config.py tests/routing/test_chunked_prefill.py tests/routing/test_scheduler_mutants.py"
TESTS_holdback="tests/routing/test_overlaps_prefill.py tests/routing/test_catchup_holdback.py tests/routing/test_admission.py"
TESTS_batch="tests/routing/test_catchup_holdback.py tests/routing/test_admission.py tests/routing/test_slot_rows.py tests/routing/test_exactness.py tests/routing/test_overlap.py tests/routing/test_chunked_prefill.py tests/routing/test_forward_lifecycle.py tests/routing/test_host_path.py"

# The server's modules: the files that pin each module's promises (the server runs in a thread
# of the test process, on the tiny models; each list ~10-25 s clean).
TESTS_serve_generation="tests/serve/test_generation_units.py tests/serve/test_openai_api.py tests/serve/test_conformance.py tests/serve/test_isolation.py tests/serve/test_engine_failure.py tests/serve/test_shutdown.py tests/serve/test_disconnect.py tests/serve/test_threaded_mode.py"
TESTS_serve_protocol="tests/serve/test_protocol_units.py tests/serve/test_errors.py tests/serve/test_fuzz.py"
TESTS_serve_errors="tests/serve/test_errors.py tests/serve/test_engine_failure.py tests/serve/test_shutdown.py tests/serve/test_conformance.py"
TESTS_serve_textstream="tests/serve/test_textstream.py tests/serve/test_isolation.py tests/serve/test_openai_api.py tests/serve/test_conformance.py"

export_head() {  # $1: folder; the committed tree only (nothing uncommitted is tested)
  rm -rf "$1" && mkdir -p "$1"
  git -C "$ROOT" archive HEAD | tar -x -C "$1"
}

# run_mutmut KIND PACKAGE_DIR TESTS_PREFIX MODULE... [-- PYTEST_ARGS...]: KIND names the folder
# under $OUT and the tests' folder (routing, serve), PACKAGE_DIR the mutated modules' folder
# under integrations/ (tokencache_routing/core, tokencache_serve).
run_mutmut() {
  local kind="$1" pkgdir="$2" prefix="$3" modules=() extra=()
  shift 3
  while [ $# -gt 0 ]; do
    if [ "$1" = "--" ]; then shift; extra=("$@"); break; fi
    modules+=("$1"); shift
  done
  if ! "$PY" -c "import mutmut" 2>/dev/null; then
    "$PY" -m pip install -q -r "$ROOT/requirements/optional/mutation.txt"
  fi
  local src="$OUT/src" work="$OUT/$kind" pkg="${pkgdir%%/*}"
  export_head "$src"
  for m in "${modules[@]}"; do
    # mutmut names mutants by their path from where it runs, and the tests import the
    # packages by name: lay the packages out at the top of a folder of their own.
    local d="$work/$m"
    rm -rf "$d" && mkdir -p "$d/tests"
    cp -r "$src/integrations/tokencache_routing" "$src/integrations/tokencache_models" "$d/"
    [ "$pkg" = tokencache_routing ] || cp -r "$src/integrations/$pkg" "$d/"
    cp -r "$src/tests/$kind" "$d/tests/"
    cp -r "$src/benches" "$d/"  # tests/routing/test_host_path.py imports benches/host_path.py
    local tests_var="$prefix$m" tests also="tokencache_models/ benches/"
    tests="${!tests_var:-tests/$kind}"
    [ "$pkg" = tokencache_routing ] || also="tokencache_routing/ $also"
    {
      echo "[mutmut]"
      echo "paths_to_mutate = $pkg/"
      echo "only_mutate = $pkgdir/$m.py"
      echo "also_copy ="
      for a in $also tests/; do echo "    $a"; done
      echo "tests_dir ="
      for t in $tests; do echo "    $t"; done
      # One argument a line: mutmut hands a one-line value to pytest as a single argument.
      echo "pytest_add_cli_args ="
      for a in -p no:cacheprovider -q -x "${extra[@]}"; do echo "    $a"; done
      # Forking mutmut's own process (which ran torch) deadlocked children on torch's thread
      # pool: every mutant "timed out". A fresh forkserver that imports nothing costs ~14 s
      # per mutant (torch imported each time) but is sound.
      echo "process_isolation = forkserver"
      echo "forkserver_warmup = none"
      # The per-mutant limit: mutmut sends SIGXCPU after (T + constant) * multiplier wall
      # seconds, T the summed clean durations (call phase only) of the mutant's tests. The
      # constant covers what T leaves out: the child's ~10 s torch import and test setup.
      echo "timeout_multiplier = $MUT_TIMEOUT_MULTIPLIER"
      echo "timeout_constant = $MUT_TIMEOUT_CONSTANT"
    } > "$d/setup.cfg"
    local names="${MUTANTS:-}"
    if [ -n "${SAMPLE:-}" ]; then
      # Generate the mutants only (the first thing `mutmut run` does), then take every Nth
      # name in the order mutmut wrote them (its .meta file: source order, then mutant number),
      # of those matching MUTANTS' globs when it is set (one function's mutants, sampled).
      local step="${SAMPLE%%/*}" start=0
      [[ "$SAMPLE" != */* ]] || start="${SAMPLE#*/}"
      (cd "$d" && "$PY" - "$pkgdir/$m.py" "$step" "$start" "$OUT/sample-$m.txt" "$names" \
          > generate.log 2>&1) <<'EOF'
import fnmatch, json, sys
import mutmut.__main__ as mm

mm.set_mutant_under_test("mutant_generation")
mm.makedirs("mutants", exist_ok=True)
mm.copy_src_dir()
mm.copy_also_copy_files()
mm.setup_source_paths()
mm.create_mutants(1)
keys = list(json.load(open(f"mutants/{sys.argv[1]}.meta"))["exit_code_by_key"])
if globs := sys.argv[5].split():
    keys = [k for k in keys if any(fnmatch.fnmatchcase(k, g) for g in globs)]
step, start = int(sys.argv[2]), int(sys.argv[3])
with open(sys.argv[4], "w") as f:  # mutmut prints what it copies: the names go to a file
    f.write(" ".join(keys[start::step]) + "\n")
print(f"sample: {len(keys[start::step])} of {len(keys)} mutants (every {step}th from {start})")
EOF
      tail -n 1 "$d/generate.log"
      names="$(cat "$OUT/sample-$m.txt")"
    fi
    echo "== mutmut: integrations/$pkgdir/$m.py against $tests"
    # shellcheck disable=SC2086  # names: globs or names for mutmut, unquoted on purpose
    (cd "$d" && timeout "$TIMEOUT_S" "$PY" -m mutmut run --max-children "$JOBS" $names \
        > run.log 2>&1) || true
    (cd "$d" && "$PY" -m mutmut results --all true > "$OUT/mutmut-$m.txt" 2>&1) || true
    "$PY" - "$OUT/mutmut-$m.txt" "$m" "$names" <<'EOF'
import collections, fnmatch, sys
lines = [line for line in open(sys.argv[1]) if "__mutmut_" in line]
pats = sys.argv[3].split()
if pats:  # count only what was asked for
    lines = [ln for ln in lines if any(fnmatch.fnmatch(ln.split(": ")[0].strip(), p) for p in pats)]
counts = collections.Counter(line.rsplit(": ", 1)[-1].strip() for line in lines)
done = sum(v for k, v in counts.items() if k != "not checked")
detected = counts.get("killed", 0) + counts.get("timeout", 0)
print(f"{sys.argv[2]}: {dict(counts)}; detected (killed + timeout) {detected} of {done} checked"
      + (f" ({100 * detected / done:.0f}%)" if done else ""))
EOF
  done
}

run_python() {
  local args=("$@")
  # shellcheck disable=SC2206  # SCHEDULER_MODULES: names split into words on purpose
  [ $# -gt 0 ] && [ "$1" != "--" ] || args=(sampling $SCHEDULER_MODULES batch "$@")
  local modules=() extra=() m
  while [ ${#args[@]} -gt 0 ]; do
    if [ "${args[0]}" = "--" ]; then extra=("${args[@]}"); break; fi
    modules+=("${args[0]}"); args=("${args[@]:1}")
  done
  for m in "${modules[@]}"; do  # one run per module: a module's folder names its package
    if [[ "$m" == */* ]]; then
      run_mutmut routing "tokencache_routing/${m%/*}" TESTS_ "${m##*/}" "${extra[@]}"
    else
      run_mutmut routing tokencache_routing/core TESTS_ "$m" "${extra[@]}"
    fi
  done
}

run_serve() {
  local args=("$@")
  [ $# -gt 0 ] && [ "$1" != "--" ] || args=(generation protocol errors textstream "$@")
  run_mutmut serve tokencache_serve TESTS_serve_ "${args[@]}"
}

run_rust() {
  command -v cargo-mutants >/dev/null || { echo "cargo install cargo-mutants --locked --version 27.1.0"; exit 1; }
  local src="$OUT/rust"
  export_head "$src"
  echo "== cargo mutants: rust/tokencache-core $*"
  (cd "$src" && timeout "$TIMEOUT_S" cargo mutants -p tokencache-core -j "$JOBS" \
      --output "$OUT" --no-shuffle "$@" > "$OUT/cargo-mutants.log" 2>&1) || true
  tail -n 3 "$OUT/cargo-mutants.log"
  for f in caught missed timeout unviable; do
    [ -f "$OUT/mutants.out/$f.txt" ] && echo "$f: $(wc -l < "$OUT/mutants.out/$f.txt")"
  done
}

mkdir -p "$OUT"
case "${1:-}" in
  python) shift; run_python "$@" ;;
  serve) shift; run_serve "$@" ;;
  rust) shift; run_rust "$@" ;;
  *) sed -n 2,32p "$0"; exit 2 ;;
esac
