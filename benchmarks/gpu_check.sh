#!/usr/bin/env bash
# The GPU check, one command from the repository root (docs/benchmarks.md, "GPU check"):
#     GPU_CHECK_COMMIT=<commit> bash benchmarks/gpu_check.sh          # the device's command (timeout_s 360)
#     GPU_CHECK_COMMIT=<commit> bash benchmarks/gpu_check.sh --rest   # the rerun slot when the first ended well
#     GPU_CHECK_COMMIT=<commit> bash benchmarks/gpu_check.sh --big    # a later lease: 3B and 7B-LoRA rows alone
#     bash benchmarks/gpu_check.sh --dry-run --warmup 1 --steps 1     # everything up to the GPU, on CPU
# Other arguments go to benchmarks/gpu_check.py (--rows REGEX, --list, --budget S, ...; its docstring has the rows).
# Results: gpu_check.json (raw rows), gpu_check.txt (the table) and gpu_check.log (this output) in $OUT, where the
# device machine hands files back, else out/gpu_check (GPU_CHECK_OUT overrides both); each row is written as it ends.
# Time: no row starts after GPU_CHECK_BUDGET seconds (default 270, counted after the imports); at GPU_CHECK_TIMEOUT
# (default 320) the run gets SIGINT, finishes its current step, lists the rest as skipped and writes the table; 15 s
# later it is killed. The whole command stays under 6 minutes: a 15-minute device lease holds its start (1-2 min),
# the run and one rerun. Exit status: 0 done (rows past the budget listed as skipped), 130 stopped by
# GPU_CHECK_TIMEOUT or a signal (the table written; never timeout's 124, which the device tool reads as its own
# limit), 137 killed, 2 no CUDA device, 3 wheels missing.
# The device machine (Python 3.12, torch 2.11 + cu130, transformers 5.17, accelerate 1.15, peft) has no trl,
# datasets, dill or multiprocess and no network: the four wheels committed in benchmarks/wheels (WHEELS=<dir>
# overrides) are installed with `pip install --no-index --no-deps --target` into GPU_CHECK_SITE (default
# ${TMPDIR:-/tmp}/gpu_check_site), put first on PYTHONPATH, each unless that exact version is installed already.
set -u
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
WHEELS="${WHEELS:-benchmarks/wheels}"
SITE="${GPU_CHECK_SITE:-${TMPDIR:-/tmp}/gpu_check_site}"
RESULTS="${GPU_CHECK_OUT:-${OUT:-out/gpu_check}}"
REQUIRED="trl-1.16.0 datasets-5.2.0 dill-0.4.1 multiprocess-0.70.19"  # PITFALLS.md: what the device lacks
export PYTHONPATH=".:$SITE${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$RESULTS"
LOG="$RESULTS/gpu_check.log"
say() { echo "$*" | tee -a "$LOG"; }

if ! "$PY" -c "import trl, datasets" 2>/dev/null; then
  wheels=() missing=()
  for dist in $REQUIRED; do
    found=$(ls "$WHEELS/$dist"-*.whl 2>/dev/null | head -1)
    if [ -n "$found" ]; then wheels+=("$found"); else missing+=("$dist"); fi
  done
  if [ ${#missing[@]} -gt 0 ]; then
    say "gpu_check: trl/datasets are not importable and $WHEELS lacks the wheels of ${missing[*]} (benchmarks/wheels/README.md: pip download ...)"
    exit 3
  fi
  install=$("$PY" - "${wheels[@]}" <<'PYEOF'
import importlib.metadata as md, os, sys
for wheel in sys.argv[1:]:
    name, version = os.path.basename(wheel).split("-")[:2]
    try:
        if md.version(name) == version:
            continue
    except md.PackageNotFoundError:
        pass
    print(wheel)
PYEOF
)
  # GPU_CHECK_WHEEL_PYTHON: rehearse the device's install on another Python (multiprocess's wheel is py312 only)
  # shellcheck disable=SC2086
  [ -z "$install" ] || "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" \
    ${GPU_CHECK_WHEEL_PYTHON:+--python-version "$GPU_CHECK_WHEEL_PYTHON"} $install \
    2>&1 | tee -a "$LOG"
  [ "${PIPESTATUS[0]}" = 0 ] || { say "gpu_check: pip could not install the wheels of $WHEELS into $SITE"; exit 3; }
  "$PY" -c "import trl, datasets" 2>&1 | tee -a "$LOG"
  [ "${PIPESTATUS[0]}" = 0 ] || { say "gpu_check: trl/datasets still fail to import (a dependency missing?)"; exit 3; }
  say "gpu_check: installed into $SITE: $(echo $install | xargs -n1 basename | tr '\n' ' ')"
fi
timeout --preserve-status --signal=INT --kill-after=15 "${GPU_CHECK_TIMEOUT:-320}" \
  "$PY" -m benchmarks.gpu_check --budget "${GPU_CHECK_BUDGET:-270}" --out "$RESULTS" "$@" 2>&1 | tee -a "$LOG"
exit "${PIPESTATUS[0]}"
