#!/usr/bin/env bash
# The one accelerator check (under 8 minutes on one H200): writes $OUT/gpu_check.json.
# JAX, flax and optax are on that machine; this installs the project without deps.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp}"
python -m pip install --quiet --no-deps -e . >/dev/null 2>&1 || export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python -c "import jax; print(jax.__version__, jax.devices())"
timeout 470 python experiments/gpu_check.py --out="$OUT/gpu_check.json" 2>&1 | tail -40
cat "$OUT/gpu_check.json"
