#!/usr/bin/env bash
# Install everything tokencache needs into ./.venv and build the extension, printing each step
# with the seconds it took. A second run skips what is up to date:
#  - pip work, while requirements/*.txt, integrations/pyproject.toml, this script and the torch
#    pin hash to the stamp .venv/.tokencache-setup/pip;
#  - the maturin build, while rust/, Cargo.toml, Cargo.lock, pyproject.toml, python/tokencache
#    and the toolchain hash to the stamp .venv/.tokencache-setup/build and the module exists.
# FRESH_VENV=1 ignores the packages already on the machine (a fresh-machine rehearsal);
# SETUP_FORCE=1 ignores the stamps; TORCH_INDEX_URL=<index> takes torch from another index
# (https://download.pytorch.org/whl/cpu has a CPU-only build; PyPI has none).
set -euo pipefail

TORCH_PIN=2.13.0
PY=.venv/bin/python
STAMPS=.venv/.tokencache-setup
export PIP_DISABLE_PIP_VERSION_CHECK=1

T0=$SECONDS
STEP_T0=$SECONDS
step() {
  STEP_T0=$SECONDS
  printf 'setup [%4ds] %s\n' "$((SECONDS - T0))" "$*"
}
took() { printf 'setup [%4ds]   %s (%d s)\n' "$((SECONDS - T0))" "$*" "$((SECONDS - STEP_T0))"; }

# pip, printing one line per package it collects, downloads or installs (SHOW: a regex of the
# lines to print). The whole output goes to $STAMPS/pip.log; its end is shown if pip fails.
SHOW_PIP='^(Collecting|Downloading|Processing|Successfully|ERROR|WARNING)'
pip_install() {
  local rc=0
  "$PY" -m pip install --progress-bar off "$@" 2>&1 | tee -a "$STAMPS/pip.log" |
    show_lines "${SHOW:-$SHOW_PIP}" || rc=$?
  if [ "$rc" != 0 ]; then
    echo "setup: pip failed (exit $rc); the end of $STAMPS/pip.log:" >&2
    tail -n 40 "$STAMPS/pip.log" >&2
    exit "$rc"
  fi
}

# The lines of stdin that match $1, as they come (awk may buffer its input), plus counts.
show_lines() {
  local line ok=0 words
  while IFS= read -r line; do
    if [[ $line =~ $1 ]]; then
      printf '    %s\n' "${line:0:110}"
    elif [[ $line == "Installing collected packages"* ]]; then
      read -ra words <<<"$line"
      printf '    installing %d packages\n' "$((${#words[@]} - 3))"
    elif [[ $line == "Requirement already satisfied"* ]]; then
      ok=$((ok + 1))
    fi
  done
  if [ "$ok" != 0 ]; then printf '    %d requirements already satisfied\n' "$ok"; fi
}

# sha256 over the names and contents of the NUL-separated files on stdin, in a stable order.
hash_files() { sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1; }

packages() {
  local stamp
  stamp="$(printf '%s\0' requirements/*.txt integrations/pyproject.toml scripts/setup.sh |
    hash_files) torch==$TORCH_PIN ${TORCH_INDEX_URL:-pypi} $("$PY" --version)"
  if [ "${SETUP_FORCE:-0}" != 1 ] && [ "$(cat "$STAMPS/pip" 2>/dev/null)" = "$stamp" ]; then
    step "2-4. packages: up to date (requirements/*.txt unchanged since $STAMPS/pip), skipped"
    return
  fi
  rm -f "$STAMPS/pip"
  : >"$STAMPS/pip.log"
  if [ ! -f "$STAMPS/installed-once" ]; then
    echo "setup: first run: pip fills .venv with about 5.7 GB (torch and its 2.7 GB of CUDA" \
      "libraries, triton, SGLang, transformers, ...), a few minutes on a fast link; later runs" \
      "and everything else then work offline."
  fi

  # torch first and pinned: nothing installed after it may replace it. Only when missing:
  # re-resolving it would swap SGLang's triton 3.9.0 for torch's own pin and back.
  step "2. torch==$TORCH_PIN"
  if "$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_PIN')" 2>/dev/null; then
    took "already installed"
  else
    pip_install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==$TORCH_PIN"
    took "installed"
  fi
  # PyPI's Linux torch wheel requires the nvidia-* CUDA packages and loads them when imported,
  # GPU or not (without them `import torch` fails: libcublasLt not found).
  local nv
  nv=$(du -shc "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"/nvidia* \
    2>/dev/null | tail -n 1 | cut -f1) || true
  if [ -n "$nv" ] && [ "$nv" != 0 ]; then
    echo "setup: note: $nv of .venv are NVIDIA CUDA libraries (nvidia-*). PyPI has no CPU-only" \
      "torch and torch loads them at import even without a GPU; where" \
      "https://download.pytorch.org/whl/cpu is reachable, TORCH_INDEX_URL=<that> avoids them."
  fi

  step "3. pinned lists requirements/*.txt (the *-nodeps.txt ones with --no-deps)"
  local normal=() nodeps=() f
  for f in requirements/*.txt; do
    case "$f" in
      *-nodeps.txt) nodeps+=(-r "$f") ;;
      *) normal+=(-r "$f") ;;
    esac
  done
  pip_install "${normal[@]}"
  pip_install --no-deps "${nodeps[@]}"
  "$PY" -c "import torch; assert torch.__version__.startswith('$TORCH_PIN'), torch.__version__"
  took "done"

  step "4. integrations, editable (entry points: tokencache, tokencache-bench, SGLang plugin)"
  pip_install --no-build-isolation --no-deps -e integrations
  took "done"
  echo "$stamp" >"$STAMPS/pip"
  touch "$STAMPS/installed-once"
}

system_tools() {
  # SGLang compiles its KV-event page hash (C++ with OpenSSL) on first use, in the tests.
  if [ ! -f /usr/include/openssl/sha.h ] && command -v apt-get >/dev/null 2>&1; then
    step "5. libssl-dev (apt-get)"
    (apt-get update -qq && apt-get install -y -qq libssl-dev) >/dev/null ||
      echo "setup: could not install libssl-dev" >&2
    took "done"
  fi
  if command -v rustup >/dev/null 2>&1 &&
    ! { cargo fmt --version && cargo clippy --version; } >/dev/null 2>&1; then
    step "5. rustfmt and clippy (rustup)"
    rustup component add rustfmt clippy >/dev/null 2>&1 || true
    took "done"
  fi
}

# The extension, built by maturin (release profile) and installed editable. Rebuilt whenever any
# input changed, the stamp is missing or the module is not there: a stale module would test old
# code.
extension() {
  local stamp native
  stamp="$({
    find rust python/tokencache -type f ! -path '*/target/*' ! -path '*/__pycache__/*' \
      ! -name '*.so' ! -name '*.pyd' -print0
    printf '%s\0' Cargo.toml Cargo.lock pyproject.toml
  } | hash_files) $(rustc --version 2>/dev/null || echo no-rustc) $("$PY" --version)"
  native=$(find python/tokencache -maxdepth 1 -name '_native*.so' -print -quit)
  if [ "${SETUP_FORCE:-0}" != 1 ] && [ -n "$native" ] &&
    [ "$(cat "$STAMPS/build" 2>/dev/null)" = "$stamp" ]; then
    step "6. extension: up to date (rust/, python/tokencache unchanged since $STAMPS/build), skipped"
    return
  fi
  step "6. extension: cargo build --release through maturin (about a minute from scratch)"
  rm -f "$STAMPS/build"
  : >"$STAMPS/pip.log"
  # -v passes cargo's "Compiling ..." lines through, so a long build shows progress.
  SHOW='Compiling |Finished |Built wheel|^error|^ERROR' \
    pip_install -v --no-build-isolation --no-deps -e .
  echo "$stamp" >"$STAMPS/build"
  took "built"
}

main() {
  cd "$(dirname "$0")/.."
  step "1. virtual environment .venv"
  if [ ! -x "$PY" ]; then
    if [ "${FRESH_VENV:-0}" = 1 ]; then
      python3 -m venv .venv
    else
      python3 -m venv --system-site-packages .venv
    fi
    took "created ($("$PY" --version))"
  else
    took "exists ($("$PY" --version))"
  fi
  mkdir -p "$STAMPS"
  packages
  system_tools
  extension
  local version
  version=$("$PY" -c "import tokencache; print(tokencache.__version__)")
  step "tokencache $version ready, set-up took $((SECONDS - T0)) s"
}

# Everything runs from main, so bash has read the whole file before it starts: editing this
# script while it runs cannot change what the running copy does.
main "$@"
exit
