#!/usr/bin/env bash
# The GPU check, one command from the repository root (docs/benchmarks.md, "GPU check"):
#     bash benchmarks/gpu_check.sh [--rows REGEX] [other benchmarks/gpu_check.py options]
# bf16, Qwen2.5 0.5B/1.5B/3B/7B-LoRA-shaped models built from their configs (no download), UltraFeedback-shaped lengths.
# Per row: optimizer-step wall time, GPU busy time, kernel launches and host synchronisations (torch.profiler), peak
# memory, tokens/s, and agreement with stock beside the stock-kernel noise floor (eager against SDPA). Rows: stock,
# noise, defaults, exact preset, each estimator at 0.5, prompt groups, 8 pairs x accumulation 4, the largest
# micro-batch under 80 GiB, then 3B and 7B-LoRA (benchmarks/gpu_check.py's docstring).
# One table printed; ${OUT:-/tmp}/gpu_check.txt (the table) and gpu_check.json (the raw rows), rewritten after every row.
# No row starts after GPU_CHECK_BUDGET seconds (default 380; the rest are listed as skipped) and the command is cut
# with SIGINT at GPU_CHECK_TIMEOUT (default 445: the whole check stays under 8 minutes): what was measured is on disk.
# trl and datasets, when not importable, are installed from the wheels carried in benchmarks/wheels (or WHEELS=<dir>)
# into GPU_CHECK_SITE (default ${TMPDIR:-/tmp}/gpu_check_site, put on PYTHONPATH), without an index and without
# resolving dependencies: each carried wheel whose distribution is not installed yet. Fetch them once, on a machine
# with network, for the device's Python (3.12 on the project's H200 machine; torch 2.11 + cu130, transformers 5.17):
#     pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#         -d benchmarks/wheels trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
# (add xxhash, fsspec, pandas, psutil or peft if the device lacks them; without peft the 7B-LoRA rows are skipped).
set -u
cd "$(dirname "$0")/.."
SITE="${GPU_CHECK_SITE:-${TMPDIR:-/tmp}/gpu_check_site}"
export PYTHONPATH=".:$SITE${PYTHONPATH:+:$PYTHONPATH}"
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
  [ -z "$missing" ] || "$PY" -m pip install -q --no-index --no-deps --target "$SITE" $missing || exit 2
  "$PY" -c "import trl, datasets" || { echo "gpu_check: trl/datasets still fail to import (a dependency missing?)" >&2; exit 2; }
fi
timeout --signal=INT --kill-after=10 "${GPU_CHECK_TIMEOUT:-445}" \
  "$PY" -m benchmarks.gpu_check --budget "${GPU_CHECK_BUDGET:-380}" --out "${OUT:-/tmp}" "$@"
