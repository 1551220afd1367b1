#!/usr/bin/env bash
# The main job on its built-in default: installs what it needs, then runs offline.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null
export PATH="$PWD/.venv/bin:$PATH" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python -m tokencache "$@"
