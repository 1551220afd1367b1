#!/usr/bin/env bash
# Install everything tokencache needs into ./.venv and build the extension. Idempotent: a second
# run only rebuilds what changed. Uses the packages already on the machine when there are some.
set -euo pipefail
cd "$(dirname "$0")/.."

# FRESH_VENV=1 ignores what the machine already has (a fresh-machine rehearsal).
if [ ! -x .venv/bin/python ]; then
  if [ "${FRESH_VENV:-0}" = 1 ]; then python3 -m venv .venv; else python3 -m venv --system-site-packages .venv; fi
fi
PY=.venv/bin/python
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip_install() { "$PY" -m pip install -q "$@"; }

# torch first and pinned: nothing installed after it may replace it (see SGLANG.md). Only when
# missing: re-resolving it would swap SGLang's triton 3.9.0 for torch's own pin and back.
if ! "$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
  pip_install "torch==2.13.0"
fi

normal=() nodeps=()
for f in requirements/*.txt; do
  case "$f" in
    *-nodeps.txt) nodeps+=(-r "$f") ;;
    *) normal+=(-r "$f") ;;
  esac
done
pip_install "${normal[@]}"
pip_install --no-deps "${nodeps[@]}"
"$PY" -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"

# SGLang compiles its KV-event page hash (C++ with OpenSSL) on first use, in the tests.
if [ ! -f /usr/include/openssl/sha.h ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && apt-get install -y -qq libssl-dev) >/dev/null || echo "setup: could not install libssl-dev" >&2
fi

if command -v rustup >/dev/null 2>&1; then
  rustup component add rustfmt clippy >/dev/null 2>&1 || true
fi

# The extension (maturin, release profile) and the integrations, both editable.
pip_install --no-build-isolation -e .
pip_install --no-build-isolation --no-deps -e integrations
"$PY" -c "import tokencache; print('tokencache', tokencache.__version__, 'ready')"
