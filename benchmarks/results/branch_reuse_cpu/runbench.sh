#!/bin/bash
PY=/work/main/.venv/bin/python
run() { # label tree workload scale rounds ckpt
  cd $2 && PYTHONPATH=$2 timeout 1500 $PY /tmp/h45_bench.py $3 $4 $5 $6 2>/dev/null | grep '^{' | sed "s/^/$1 /" >> /tmp/h45_bench.out
}
run new /work/wt-h45-kv ultrafeedback 0.25 7 on
run old /tmp/h45_old ultrafeedback 0.25 7 on
run new /work/wt-h45-kv multiturn 0.25 5 on
run old /tmp/h45_old multiturn 0.25 5 on
run new /work/wt-h45-kv ultrafeedback 0.25 5 off
echo finished >> /tmp/h45_bench.out
