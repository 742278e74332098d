#!/bin/bash
# TRL's own DPO test suite against the plugin, offline (docs/parity.md, "TRL's own suite").
#   tests/trl_suite/run.sh TRL_CHECKOUT WORK_DIR [stock] [off] [on] [default]
# TRL_CHECKOUT: a git checkout of huggingface/trl (its tests/test_dpo_trainer.py, testing_utils.py, conftest.py are
# copied, not vendored); WORK_DIR: scratch space (stand-in models, results). Writes WORK_DIR/log-MODE.txt and
# WORK_DIR/failed-MODE.txt per mode; a failure is unexpected when it is in failed-off/on but not in failed-stock.
# PYTEST_ARGS (e.g. "-k dtype") narrows the run.
set -e
trl=$1; work=$2; shift 2
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$work/tests" "$work/hub"
for f in __init__.py conftest.py testing_utils.py testing_constants.py test_dpo_trainer.py; do
  git -C "$trl" show "HEAD:tests/$f" > "$work/tests/$f"
done
# helpers this TRL checkout imports that the installed TRL may lack: treated as unavailable
python - "$work/tests/testing_utils.py" <<'PY'
import sys
p = sys.argv[1]; s = open(p).read()
i = s.index("from trl.import_utils import ("); j = s.index(")", i) + 1
names = [n.strip().rstrip(",") for n in s[i:j].split("(")[1].rstrip(")").split("\n") if n.strip()]
s = s[:i] + "import trl.import_utils as _iu\n" + "".join(f"{n} = getattr(_iu, '{n}', lambda: False)\n" for n in names) + s[j:]
open(p, "w").write(s)
PY
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_CACHE="$work/hub" OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$here:$here/../..:$PYTHONPATH"
python "$here/standins.py" > "$work/standins.json"
cd "$work"
modes=("$@"); [ ${#modes[@]} -eq 0 ] && modes=(stock off on)
for mode in "${modes[@]}"; do
  SWAP=$mode python -m pytest -q tests/test_dpo_trainer.py -p swap_plugin -p no:cacheprovider -rfE $PYTEST_ARGS \
    > "log-$mode.txt" 2>&1 || true
  grep -E "^(FAILED|ERROR)" "log-$mode.txt" | sed 's/ - .*//' > "failed-$mode.txt" || true
  echo "$mode: $(tail -1 "log-$mode.txt")"
done
