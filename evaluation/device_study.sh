#!/usr/bin/env bash
# The regimes study (evaluation/regimes.py) on a many-core machine, for one bounded command.
# Run from the repository root with the starting policy carried in runs/cache (the demo cache of this checkout:
# TRL_PRUNED_DPO_CACHE=runs/cache) and any results so far in runs/regimes. Results go to "${OUT}/regimes", in the
# same resumable format as runs/regimes: copy them back there and regenerate the docs with
#   python -m evaluation.regimes --stage report --docs docs
# Runs that are not finished when the time limit hits are simply missing (each run is its own file); a rerun resumes.
set -euo pipefail
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" TRL_PRUNED_DPO_CACHE="${TRL_PRUNED_DPO_CACHE:-$PWD/runs/cache}" OMP_NUM_THREADS=1
export CUDA_VISIBLE_DEVICES=""  # a 2-layer model: one CPU thread per run beats a shared GPU here
OUT="${OUT:-out}"
JOBS="${JOBS:-14}"
LIMIT="${LIMIT:-300}"  # seconds for the training and gradients stages (side by side); the report follows
if ! ls "$TRL_PRUNED_DPO_CACHE"/quality/sft-tiny-demo-*/model.safetensors >/dev/null 2>&1; then
  echo "no starting policy under $TRL_PRUNED_DPO_CACHE/quality: carry runs/cache (training it here takes minutes)" >&2
  exit 2
fi
mkdir -p "$OUT/regimes"
if [ -d runs/regimes ]; then cp -r runs/regimes/. "$OUT/regimes/"; fi
python - <<'PY'
import torch, trl, transformers; print("torch", torch.__version__, "trl", trl.__version__, "transformers", transformers.__version__)
PY
# The noise diagnostics (one process per regime) beside the training runs (JOBS processes): 16 cores in all.
for regime in near dissimilar; do
  timeout "$LIMIT" python -m evaluation.regimes --stage gradients --regimes "$regime" --out "$OUT/regimes" \
    > "$OUT/gradients-$regime.log" 2>&1 &
done
# Seeds outermost, so whatever finishes is complete seeds; every (regime, batch, setting) of seed 0 first.
timeout "$LIMIT" python -m evaluation.regimes --stage train --jobs "$JOBS" --out "$OUT/regimes" "$@" || true
wait || true
tail -n 3 "$OUT"/gradients-*.log || true
python -m evaluation.regimes --stage report --out "$OUT/regimes" || true
find "$OUT/regimes" -name '*.json' | wc -l
