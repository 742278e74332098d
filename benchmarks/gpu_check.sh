#!/usr/bin/env bash
# The GPU check of the exact savings, one command from the repository root (docs/benchmarks.md, "GPU check"):
#     bash benchmarks/gpu_check.sh
# bf16, Qwen2.5-0.5B- and 1.5B-shaped models built from their configs (no download), UltraFeedback- and HH-shaped
# lengths, checkpointing on/off: stock DPOTrainer vs padding_free, + share_prompt, + common prefix, + prefix 0.5.
# One table printed; results in ${OUT:-/tmp}/gpu_check.{json,txt}. The grid stops starting rows after GPU_CHECK_BUDGET
# seconds (default 420) and the command is cut at GPU_CHECK_TIMEOUT (default 470): what was measured is on disk.
# trl and datasets, when not importable, are installed from the wheels carried in benchmarks/wheels (or WHEELS=<dir>),
# without an index and without resolving dependencies: each carried wheel whose distribution is not installed yet.
# Fetch them once, on a machine with network, for the device's Python (docs/benchmarks.md):
#     pip download --no-deps --only-binary=:all: --python-version 3.11 --platform manylinux2014_x86_64 \
#         -d benchmarks/wheels trl==1.16.0 datasets==4.7.0 'dill>=0.3.0,<0.4.1' 'multiprocess<0.70.19' xxhash \
#         'fsspec>=2023.1.0,<=2026.2.0' pandas psutil
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
WHEELS="${WHEELS:-benchmarks/wheels}"
if ! "$PY" -c "import trl, datasets" 2>/dev/null; then
  if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    echo "gpu_check: trl/datasets are not importable and $WHEELS holds no wheels (see the pip download line above)" >&2
    exit 2
  fi
  missing=$("$PY" - "$WHEELS" <<'PYEOF'
import glob, importlib.metadata as md, os, sys
for wheel in sorted(glob.glob(os.path.join(sys.argv[1], "*.whl"))):
    name = os.path.basename(wheel).split("-")[0]
    try:
        md.version(name)
    except md.PackageNotFoundError:
        print(wheel)
PYEOF
)
  # shellcheck disable=SC2086
  [ -z "$missing" ] || "$PY" -m pip install -q --no-index --no-deps $missing || exit 2
  "$PY" -c "import trl, datasets" || { echo "gpu_check: trl/datasets still fail to import (a dependency missing?)" >&2; exit 2; }
fi
"$PY" -c "import torch, transformers, trl; print('gpu_check: torch', torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__)"
timeout --signal=INT --kill-after=15 "${GPU_CHECK_TIMEOUT:-470}" \
  "$PY" -m benchmarks.gpu_check --budget "${GPU_CHECK_BUDGET:-420}" --out "${OUT:-/tmp}" "$@"
