"""GPU check of the exact savings (padding-free, shared-prompt packing) against stock TRL: one table, one results file.

    bash benchmarks/gpu_check.sh        # = PYTHONPATH=. python -m benchmarks.gpu_check --budget 420

bf16 on one CUDA device; Qwen2.5-0.5B- and 1.5B-shaped models built from their configs (no download; random weights,
synthetic pairs: step times do not depend on the values); gradient checkpointing on and off; a live reference (the
policy's copy plus noise, so the loss is not log 2 whatever the log-probs). Lengths: UltraFeedback-shaped (median row
~409 tokens, prompt/response ~0.42, tail truncated at 1024) and HH-shaped (median ~186, prompt/response ~2.15),
benchmarks/workload.py's LENGTH_MODELS; 8 pairs per step.

Rows: stock `DPOTrainer` (sdpa; and flash_attention_2 when flash_attn is installed), then the plugin with
`padding_free`, `padding_free` + `share_prompt`, + `prune_common_prefix` (exact for sigmoid), + `prefix_prune_prob=0.5`
(sampled: not comparable to stock, its agreement says so). Each row: warm-up and timed optimizer steps
(CUDA-synchronised wall clock, median), tokens/s (real tokens of the batch per second), peak allocated memory, and its
first step against stock's on the same batch and weights: |loss difference| and the cosine and norm ratio of the
full gradient. Rows run in order, each in try/except; past the budget the rest is skipped and said so. Results: the
printed table and ${OUT:-/tmp}/gpu_check.{json,txt}. `--dry-run` runs the same grid on CPU with a tiny model in fp32
(numbers mean nothing): it checks the script.
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib.util
import json
import os
import statistics
import sys
import time
import traceback

import torch

from benchmarks.workload import Workload, build_model, build_trainer, quiet

QWEN25 = {  # Qwen/Qwen2.5-{0.5B,1.5B}'s config.json (vocabulary 151936, tied embeddings)
    "0.5B": dict(hidden_size=896, num_hidden_layers=24, intermediate_size=4864, num_attention_heads=14,
                 num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6),
    "1.5B": dict(hidden_size=1536, num_hidden_layers=28, intermediate_size=8960, num_attention_heads=12,
                 num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6),
}
VOCAB = 151936
TINY = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
            tie_word_embeddings=True)
SETTINGS = [  # (row, side, PrunedDPOConfig fields, exact: its first step must agree with stock's)
    ("stock", "stock", {}, True),
    ("padding_free", "pruned", dict(padding_free=True, share_prompt=False), True),
    ("pf+share", "pruned", dict(padding_free=True, share_prompt=True), True),
    ("pf+share+common", "pruned", dict(padding_free=True, share_prompt=True, prune_common_prefix=True), True),
    ("pf+share+common+prefix0.5", "pruned",
     dict(padding_free=True, share_prompt=True, prune_common_prefix=True, prefix_prune_prob=0.5), False),
]


def grid(dry_run: bool):
    """(model, checkpointing, workload) cells, most informative first (the budget may cut the tail)."""
    cells = []
    for shape in ("0.5B",) if dry_run else ("0.5B", "1.5B"):  # a dry run's model is TINY for either shape
        for checkpointing in (True, False):
            for lengths in ("ultrafeedback", "hh"):
                w = Workload(vocab_size=512 if dry_run else VOCAB, batch_size=2 if dry_run else 8, num_batches=2,
                             model_shape=TINY if dry_run else QWEN25[shape], name=lengths, lengths=lengths,
                             length_scale=0.05 if dry_run else 1.0, reference_noise=0.01)
                cells.append((shape, checkpointing, w))
    return cells


class Runner:
    """One trainer driven step by step as `Trainer._inner_training_loop` does on one process (either transformers
    spelling of checkpointing); the first step's loss and gradient are kept for the agreement with stock."""

    def __init__(self, trainer):
        self.trainer = trainer
        args = trainer.args
        if getattr(args, "gradient_checkpointing", False):
            kwargs = args.gradient_checkpointing_kwargs or {"use_reentrant": False}
            trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        trainer.create_optimizer()
        self.model, trainer.optimizer = trainer.accelerator.prepare(trainer.model, trainer.optimizer)
        trainer.model_wrapped = self.model
        trainer.create_scheduler(num_training_steps=10**6)
        trainer.current_gradient_accumulation_steps = 1
        self.batches = list(trainer.get_train_dataloader())
        self.steps = 0

    def step(self, keep_first=False):
        t = self.trainer
        batch = self.batches[self.steps % len(self.batches)]
        loss = t.training_step(self.model, batch)
        first = None
        if keep_first:
            grads = [p.grad.float().flatten() for p in self.model.parameters() if p.grad is not None]
            first = (float(loss), torch.cat(grads))
        t.accelerator.clip_grad_norm_(self.model.parameters(), 1.0)
        t.optimizer.step()
        t.lr_scheduler.step()
        self.model.zero_grad()
        t.state.global_step += 1
        self.steps += 1
        return batch, first


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def time_row(w, side, attn, pruning, base, checkpointing, warmup, steps, device, stock_first):
    model = copy.deepcopy(base)
    if attn != model.config._attn_implementation:
        model.set_attn_implementation(attn)
    trainer = build_trainer(side, w, model, precompute=False, checkpointing=checkpointing, pruning=pruning,
                            device=device, bf16=device == "cuda")
    if side == "pruned" and not trainer.forward_choice.packed:
        raise RuntimeError("the packed path fell back to padded rows (see the warning above)")
    runner = Runner(trainer)
    try:
        _, first = runner.step(keep_first=True)  # step 0: same batch and weights as stock's step 0
        agreement = {}
        if stock_first is not None:  # compared now, on the device, and freed before the peak is measured
            g, g0 = first[1].double(), stock_first[1].to(first[1].device).double()
            agreement = dict(loss_diff=abs(first[0] - stock_first[0]),
                             grad_cos=float(torch.nn.functional.cosine_similarity(g, g0, dim=0)),
                             grad_norm_ratio=float(g.norm() / g0.norm()))
            del g, g0
        first = (first[0], first[1].cpu())  # stock's is kept, on the host, for the rows after it
        for _ in range(warmup - 1):
            runner.step()
        _sync(device)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times, tokens = [], []
        for _ in range(steps):
            start = time.perf_counter()
            batch, _ = runner.step()
            _sync(device)
            times.append(time.perf_counter() - start)
            tokens.append(float(batch["attention_mask"].sum()))
        peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0
        stats = getattr(trainer, "last_prune_stats", None) or {}
        row = dict(step_s=statistics.median(times), tokens_per_s=statistics.mean(tokens) / statistics.median(times),
                   peak_gib=peak, executed=stats.get("policy_tokens_executed"),
                   padded=float(runner.batches[0]["input_ids"].numel()), **agreement)
        return row, first
    finally:
        del runner, trainer, model
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()


def format_table(results: list[dict]) -> str:
    head = (f"{'model':<5} {'ckpt':<4} {'lengths':<13} {'row':<26} {'step s':>7} {'vs stock':>8} {'tok/s':>8} "
            f"{'peak GiB':>8} {'|dloss|':>8} {'grad cos':>8} {'|g| ratio':>9}")
    lines = [head, "-" * len(head)]
    for r in results:
        cell = f"{r['model']:<5} {('on' if r['ckpt'] else 'off'):<4} {r['lengths']:<13} {r['row']:<26}"
        if "error" in r:
            lines.append(f"{cell} ERROR: {r['error'][:90]}")
            continue
        stock = next((x for x in results if "error" not in x and x["row"] == "stock" and
                      (x["model"], x["ckpt"], x["lengths"]) == (r["model"], r["ckpt"], r["lengths"])), None)
        vs = f"{stock['step_s'] / r['step_s']:.2f}x" if stock else "-"
        agree = ("sampled", "", "") if not r.get("exact", True) else (
            (f"{r['loss_diff']:.1e}", f"{r['grad_cos']:.5f}", f"{r['grad_norm_ratio']:.4f}") if "loss_diff" in r
            else ("-", "-", "-"))
        lines.append(f"{cell} {r['step_s']:7.3f} {vs:>8} {r['tokens_per_s']:8.0f} {r['peak_gib']:8.2f} "
                     f"{agree[0]:>8} {agree[1]:>8} {agree[2]:>9}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=420.0, help="seconds for the whole grid (then skip the rest)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=os.environ.get("OUT") or "/tmp")
    parser.add_argument("--dry-run", action="store_true", help="tiny model on CPU: checks the script, not the GPU")
    args = parser.parse_args(argv)
    quiet()
    started = time.time()
    device = "cpu" if args.dry_run else "cuda"
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (use --dry-run to check the script on CPU).", file=sys.stderr)
        return 2
    import transformers
    import trl

    attns = ["sdpa"] + (["flash_attention_2"] if device == "cuda" and importlib.util.find_spec("flash_attn") else [])
    meta = dict(gpu=torch.cuda.get_device_name() if device == "cuda" else "dry run on CPU", torch=torch.__version__,
                transformers=transformers.__version__, trl=trl.__version__, reference="live",
                dtype="bf16" if device == "cuda" else "fp32", pairs_per_step=2 if args.dry_run else 8,
                warmup=args.warmup, steps=args.steps, stock_attention=attns,
                started=time.strftime("%Y-%m-%d %H:%M:%S"))
    print("gpu_check:", json.dumps(meta), flush=True)
    results = []
    os.makedirs(args.out, exist_ok=True)

    def save():
        meta["elapsed_s"] = round(time.time() - started, 1)
        with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
            json.dump(dict(meta=meta, results=results), f, indent=1)
        with open(os.path.join(args.out, "gpu_check.txt"), "w") as f:
            f.write(format_table(results) + "\n")

    for shape, checkpointing, w in grid(args.dry_run):
        base, stock_first = None, None
        rows = [(f"stock[{a}]" if a != "sdpa" else "stock", "stock", a, {}, True) for a in attns]
        rows += [(name, side, "sdpa", pruning, exact) for name, side, pruning, exact in SETTINGS[1:]]
        for name, side, attn, pruning, exact in rows:
            where = dict(model=shape, ckpt=checkpointing, lengths=w.name, row=name, exact=exact)
            if time.time() - started > args.budget:
                results.append(dict(where, error=f"skipped: budget of {args.budget:.0f}s spent"))
                continue
            try:
                if base is None:
                    base = build_model(w, torch.bfloat16 if device == "cuda" else torch.float32, attn="sdpa",
                                       device=device)
                r, first = time_row(w, side, attn, pruning, base, checkpointing, args.warmup, args.steps, device,
                                    stock_first if name != "stock" and exact else None)
                if name == "stock":
                    stock_first = first
                results.append(dict(where, attn=attn, **r))
                print(f"[{time.time() - started:5.0f}s] {shape} ckpt={checkpointing} {w.name} {name}: "
                      f"{r['step_s']:.3f}s/step, peak {r['peak_gib']:.1f} GiB", flush=True)
            except Exception as error:  # noqa: BLE001 - one row failing must not stop the grid
                message = f"{type(error).__name__}: {error}".splitlines()[0]
                results.append(dict(where, attn=attn, error=message))
                print(f"[{time.time() - started:5.0f}s] {shape} {w.name} {name}: ERROR {message}", flush=True)
                traceback.print_exc(limit=3)
                gc.collect()
            save()
        del base, stock_first
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    print("\n" + format_table(results))
    from trl_pruned_dpo.seam import attention  # which varlen kernel the packed rows ran, and whether it was refused

    verdicts = {f"{k[0].__name__.strip('_')} {k[2]} heads {k[3]}/{k[4]} dim {k[5]} {k[6]}": "used" if ok else "REFUSED"
                for k, ok in attention._VERIFIED.items()}
    print("varlen kernels:", verdicts or "none checked (the packed rows ran SDPA per segment)")
    meta["varlen_kernels"] = verdicts
    save()
    print(f"\nwrote {args.out}/gpu_check.{{json,txt}} in {time.time() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
