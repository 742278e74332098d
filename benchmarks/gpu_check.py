"""GPU check of the shared-prompt grid: one command, one table, a results file, within a time budget.

    bash benchmarks/gpu_check.sh            # = PYTHONPATH=. python -m benchmarks.gpu_check --budget 330

bf16 on one CUDA device, a Qwen2.5-0.5B-shaped model built from its config (no download; random weights, synthetic
pairs: step times do not depend on the values), gradient checkpointing on, live reference. Three workloads (the
CPU grid's, at GPU lengths): multi-turn (prompt ~3x response), ultrafeedback (prompt ~0.5x response, dissimilar
responses), near-copy (responses share half their tokens). Rows: stock TRL, the pruned trainer with nothing pruned
(`none`), `share_prompt` (dense 4D mask through SDPA), the same through FlexAttention block masks (`share[flex]`: no
L x L mask; a clear message if it cannot run), and share_prompt with each pruning and all of them.

Each row: 2 warm-up and 5 timed optimizer steps (CUDA-synchronised wall clock, median), peak allocated memory over the
timed steps, tokens executed by the policy. Rows run one after the other, each in try/except (an error prints and
the grid goes on); when the budget is spent the rest is skipped and said so. Results: the printed table and
${OUT:-/tmp}/gpu_check.{json,txt}.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import sys
import time
import traceback

import torch

from benchmarks.workload import StepRunner, Workload, build_model, build_trainer, quiet

QWEN25_05B = dict(  # Qwen/Qwen2.5-0.5B's config.json
    hidden_size=896, num_hidden_layers=24, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
    tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
)
VOCAB = 151936
WORKLOADS = [
    Workload(vocab_size=VOCAB, prompt_len=768, response_len=256, batch_size=8, num_batches=2,
             model_shape=QWEN25_05B, name="multi-turn"),
    Workload(vocab_size=VOCAB, prompt_len=256, response_len=512, batch_size=8, num_batches=2,
             model_shape=QWEN25_05B, name="ultrafeedback"),
    Workload(vocab_size=VOCAB, prompt_len=256, response_len=512, batch_size=8, num_batches=2, shared_response=0.5,
             model_shape=QWEN25_05B, name="near-copy"),
]
ROWS = [  # (name, side, attention implementation, PrunedDPOConfig fields)
    ("stock", "stock", "sdpa", {}),
    ("none", "pruned", "sdpa", {}),
    ("share", "pruned", "sdpa", dict(share_prompt=True)),
    ("share+branch", "pruned", "sdpa", dict(share_prompt=True, branch_keep_prob=0.5)),
    ("share+position", "pruned", "sdpa", dict(share_prompt=True, position_keep_prob=0.5)),
    ("share+prefix", "pruned", "sdpa", dict(share_prompt=True, prefix_prune_prob=0.5)),
    ("share+prefix+position", "pruned", "sdpa", dict(share_prompt=True, prefix_prune_prob=0.5, position_keep_prob=0.5)),
    ("share+all", "pruned", "sdpa",
     dict(share_prompt=True, branch_keep_prob=0.5, position_keep_prob=0.5, prefix_prune_prob=0.5)),
    # last in each workload: its first call compiles FlexAttention, which must not eat the budget of the main rows
    ("share[flex]", "pruned", "flex_attention", dict(share_prompt=True)),
]


# --dry-run: the same grid on CPU with a tiny model in fp32, to check the script itself (numbers mean nothing)
TINY = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
            tie_word_embeddings=True)


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def time_row(w: Workload, side: str, attn: str, pruning: dict, base, warmup: int, steps: int, device: str) -> dict:
    model = copy.deepcopy(base)
    if attn != base.config._attn_implementation:
        model.set_attn_implementation(attn)
    trainer = build_trainer(side, w, model, precompute=False, checkpointing=True, pruning=pruning, device=device,
                            bf16=device == "cuda")
    if side == "pruned" and pruning.get("share_prompt") and trainer._share_backend != attn:
        raise RuntimeError(f"share_prompt fell back to the unshared forward (backend {trainer._share_backend!r})")
    runner = StepRunner(trainer)
    try:
        for _ in range(warmup):
            runner.step()
        _sync(device)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times, tokens = [], []
        for _ in range(steps):
            start = time.perf_counter()
            runner.step()
            _sync(device)
            times.append(time.perf_counter() - start)
            stats = getattr(trainer, "last_prune_stats", None)
            batch = runner.last_batch
            tokens.append(stats["policy_tokens_executed"] if stats else batch["input_ids"].numel())
        peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0
        return dict(step_s=statistics.median(times), peak_gib=peak,
                    tokens=statistics.mean(tokens),
                    full_tokens=float(batch["input_ids"].numel()),
                    pairs_shared=(stats or {}).get("shared_pairs"))
    finally:
        del runner, trainer, model
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()


def format_table(results: list[dict]) -> str:
    head = f"{'workload':<14} {'row':<22} {'step s':>8} {'vs stock':>9} {'vs none':>8} {'tok exec':>9} {'peak GiB':>9}"
    lines = [head, "-" * len(head)]
    for r in results:
        if "error" in r:
            lines.append(f"{r['workload']:<14} {r['row']:<22} {'ERROR: ' + r['error'][:80]}")
            continue
        ref = {x["row"]: x for x in results if x["workload"] == r["workload"] and "error" not in x}
        vs = {k: (f"{ref[k]['step_s'] / r['step_s']:.2f}x" if k in ref else "-") for k in ("stock", "none")}
        lines.append(f"{r['workload']:<14} {r['row']:<22} {r['step_s']:8.3f} {vs['stock']:>9} {vs['none']:>8} "
                     f"{r['tokens'] / r['full_tokens']:9.2f} {r['peak_gib']:9.2f}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=330.0, help="seconds for the whole grid (then skip the rest)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=os.environ.get("OUT") or "/tmp")
    parser.add_argument("--dry-run", action="store_true", help="tiny model on CPU: checks the script, not the GPU")
    args = parser.parse_args(argv)
    quiet()
    started = time.time()
    device = "cpu" if args.dry_run else "cuda"
    workloads = WORKLOADS
    if args.dry_run:
        workloads = [Workload(vocab_size=512, prompt_len=24, response_len=16, batch_size=2, num_batches=1,
                              shared_response=w.shared_response, model_shape=TINY, name=w.name) for w in WORKLOADS]
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA device (use --dry-run to check the script on CPU).", file=sys.stderr)
        return 2
    import transformers
    import trl

    meta = dict(gpu=torch.cuda.get_device_name() if device == "cuda" else "dry run on CPU",
                torch=torch.__version__, transformers=transformers.__version__,
                trl=trl.__version__, dtype="bf16", checkpointing=True, reference="live",
                warmup=args.warmup, steps=args.steps, started=time.strftime("%Y-%m-%d %H:%M:%S"))
    print("gpu_check:", json.dumps(meta), flush=True)
    results = []
    os.makedirs(args.out, exist_ok=True)

    def save():
        meta["elapsed_s"] = round(time.time() - started, 1)
        with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
            json.dump(dict(meta=meta, results=results), f, indent=1)
        with open(os.path.join(args.out, "gpu_check.txt"), "w") as f:
            f.write(format_table(results) + "\n")

    for w in workloads:
        base = None
        for name, side, attn, pruning in ROWS:
            elapsed = time.time() - started
            if elapsed > args.budget:
                results.append(dict(workload=w.name, row=name, error=f"skipped: budget of {args.budget:.0f}s spent"))
                continue
            try:
                if base is None:
                    base = build_model(w, torch.bfloat16 if device == "cuda" else torch.float32, attn="sdpa",
                                       device=device)
                r = time_row(w, side, attn, pruning, base, args.warmup, args.steps, device)
                results.append(dict(workload=w.name, row=name, attn=attn, **r))
                print(f"[{time.time() - started:5.0f}s] {w.name} {name}: {r['step_s']:.3f}s/step, "
                      f"tokens {r['tokens'] / r['full_tokens']:.2f}, peak {r['peak_gib']:.1f} GiB", flush=True)
            except Exception as error:  # noqa: BLE001 - one row failing must not stop the grid
                message = f"{type(error).__name__}: {error}".splitlines()[0]
                if attn == "flex_attention":
                    message = "FlexAttention unavailable, dense-mask SDPA rows stand: " + message
                results.append(dict(workload=w.name, row=name, attn=attn, error=message))
                print(f"[{time.time() - started:5.0f}s] {w.name} {name}: ERROR {message}", flush=True)
                traceback.print_exc(limit=3)
                gc.collect()
            save()
        del base
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    print("\n" + format_table(results))
    save()
    print(f"\nwrote {args.out}/gpu_check.{{json,txt}} in {time.time() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
