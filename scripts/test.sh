#!/usr/bin/env bash
# The whole test suite, as CI runs it: installs what it needs, then lint, Rust tests, Python
# tests (benchmarks run once each as smoke tests), and the benchmark command in quick mode.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== set-up: scripts/setup.sh (skips what is up to date)"
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

echo "== rust: fmt, clippy, tests"
cargo fmt --all --check
cargo clippy --workspace --all-targets --release -- -D warnings
cargo test -p tokencache-core --release

echo "== python: ruff, mypy"
ruff check .
ruff format --check .
mypy

echo "== main job's cache demo and the benchmark command, quick mode"
python -m tokencache --lengths 512 2048 --rounds 2
python -m tokencache_bench --quick --out bench-out/quick

# Last, so that pytest's summary line closes the output.
echo "== python: tests and benchmark smoke tests"
python -m pytest -q
