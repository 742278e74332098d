"""Step time and tokens: exact preset vs exact + branch 0.5, same batches, same process, alternating (step_time's
time_group: one torch thread, process CPU time). Usage: python /tmp/h45_bench.py WORKLOAD SCALE ROUNDS CKPT"""
import json, statistics, sys, torch
torch.set_num_threads(1)
from benchmarks.step_time import time_group, SETTINGS, MAIN
from benchmarks.workload import Workload

name, scale, rounds, ckpt = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "on"
w = Workload(vocab_size=8192, batch_size=8, num_batches=4, name=name, lengths=name, length_scale=scale,
             reference_noise=0.01, model_shape=dict(MAIN.model_shape))
group = dict(workload=w, precompute=False, checkpointing=ckpt, kind="workload")
out = time_group(group, ["exact", "exact+branch0.5"], warmup=1, rounds=rounds, device="cpu", bf16=False, log=print)
cpu = out["cpu_times"]
ratios = [e / b for e, b in zip(cpu["exact"], cpu["exact+branch0.5"])]
tokens = {n: [s.get("policy_tokens", s.get("executed")) for s in out["steps"][n]] for n in cpu}
print(json.dumps(dict(workload=name, scale=scale, ckpt=ckpt,
                      median_cpu={n: statistics.median(v) for n, v in cpu.items()},
                      per_round_ratio_exact_over_branch=ratios, median_ratio=statistics.median(ratios),
                      steps={n: out["steps"][n] for n in ("exact", "exact+branch0.5")}), default=str))
