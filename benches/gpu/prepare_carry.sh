#!/usr/bin/env bash
# Here, before a GPU session's device call: fills .whl/ (git-ignored) with what the device
# machine lacks, tokencache's abi3 wheel (maturin, release) and the wheels of carry.txt (cp312
# manylinux, pip download --no-deps), and checks the 64 MiB that a call may carry. Then one
# device call, carry [".whl"], timeout_s 590:  bash benches/gpu/device.sh all
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
MATURIN=$(command -v .venv/bin/maturin || command -v maturin || true)
if [ -z "$MATURIN" ]; then
  echo "prepare_carry: maturin not found (bash scripts/setup.sh installs it)" >&2
  exit 1
fi
rm -rf .whl
mkdir -p .whl
echo "== tokencache wheel (maturin build --release)"
"$MATURIN" build --release --quiet -i "$PY" -o .whl
echo "== carry.txt wheels (cp312 manylinux)"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl -r benches/gpu/carry.txt
count=$(find .whl -name '*.whl' | wc -l)
kib=$(du -sk .whl | cut -f1)
# What travels besides: tracked and untracked-not-ignored files.
# (du fails on a tracked file deleted from the tree; what exists is still summed.)
tree_kib=$( (git ls-files -z --cached --others --exclude-standard | xargs -0 du -ck 2>/dev/null ||
  true) | tail -n 1 | cut -f1)
echo "== .whl: $count wheels, $((kib / 1024)) MiB; with the working tree $(((kib + tree_kib) / 1024)) MiB"
if [ $((kib + tree_kib)) -gt $((62 * 1024)) ]; then
  echo "prepare_carry: over 62 MiB; a device call carries 64 MiB in all" >&2
  exit 1
fi
