#!/usr/bin/env bash
# The GPU check of the shared-prompt grid, one command from the repository root (docs/benchmarks.md):
#     bash benchmarks/gpu_check.sh
# bf16, a Qwen2.5-0.5B-shaped model built from its config (no download), one table printed, results written to
# ${OUT:-/tmp}/gpu_check.{json,txt}. The grid stops starting rows after GPU_CHECK_BUDGET seconds (default 300) and
# the whole command is cut at GPU_CHECK_TIMEOUT (default 350): what was measured is already on disk.
# Needs trl 1.16 and datasets importable; with WHEELS=<folder of wheels> they are installed from it first.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
if ! "$PY" -c "import trl, datasets" 2>/dev/null; then
  if [ -n "${WHEELS:-}" ]; then
    "$PY" -m pip install -q --no-index --find-links "$WHEELS" trl datasets || exit 2
  else
    echo "gpu_check: trl and datasets are not importable: install the carried wheels or set WHEELS=<folder>" >&2
    exit 2
  fi
fi
"$PY" -c "import torch, transformers, trl; print('gpu_check: torch', torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__)"
timeout --signal=INT --kill-after=15 "${GPU_CHECK_TIMEOUT:-350}" \
  "$PY" -m benchmarks.gpu_check --budget "${GPU_CHECK_BUDGET:-300}" --out "${OUT:-/tmp}" "$@"
