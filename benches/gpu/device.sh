#!/usr/bin/env bash
# On the device machine (one call, carry [".whl"] from prepare_carry.sh, timeout_s 590):
#   bash benches/gpu/device.sh all   # <= 540 s after the install; or one part, with a longer
#                                    # budget: decode / engine / routing / reasoning (run_all.sh)
# Installs the carried wheels into /tmp/site (no network there), then runs run_all.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
if ! ls .whl/tokencache-*.whl >/dev/null 2>&1; then
  echo "device.sh: no .whl/tokencache-*.whl; run benches/gpu/prepare_carry.sh here first" >&2
  exit 2
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c "import tokencache, torch, triton; print('tokencache', tokencache.__version__, \
'torch', torch.__version__, 'triton', triton.__version__)"
exec bash benches/gpu/run_all.sh "${1:-all}"
