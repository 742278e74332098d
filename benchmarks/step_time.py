"""Step time and peak memory: stock TRL `DPOTrainer` against `PrunedDPOTrainer`, with the FLOP limit of each ratio.

    python -m benchmarks.step_time            # --quick (default): checkpointing on, both reference modes, memory
    python -m benchmarks.step_time --full     # + checkpointing off, 10 rounds, response-length x vocabulary scaling
    python -m benchmarks.step_time --smoke    # tiniest mode (CI): checks the harness, numbers mean nothing
    python -m benchmarks.step_time --workload all [--quick|--full|--smoke]   # exact savings on ragged lengths

On CPU the default is one torch thread and the process CPU-time clock (honest on a machine shared with other jobs;
a warning says when the load average exceeds the cores); on GPU, the wall clock with synchronisation.

Results (JSON, CSV, PNG) go to benchmarks/results/<mode>_<device>/; docs/benchmarks.md shows and explains them.

A *group* is one workload (model shape, vocabulary, lengths, batch) with one reference mode (live reference model, or
`precompute_ref_log_probs=True`) and gradient checkpointing on or off. Inside a group every trainer is built on an
identical copy of the model and dataset with the same seed: one stock `trl.DPOTrainer` and one `PrunedDPOTrainer`
per pruning setting. After warm-up the trainers take steps in rounds -- stock, then each pruned setting, the order
reversed every round -- so that slow drifts of a shared machine hit every side alike; each setting's speedup is
median(stock step) / median(pruned step). A step is what `Trainer.train` does per optimizer step on one process
(workload.StepRunner). Peak memory is measured separately, each trainer in a fresh process (memory.py).

`--workload ultrafeedback|hh|multiturn|short|all`: ragged lengths (workload.LENGTH_MODELS), 8 pairs per step, stock
against `padding_free`, + `share_prompt`, + `prune_common_prefix` (the exact preset), + prefix pruning; per setting the
median per-round step-time ratio, tokens/s, the padding share of the policy forward, working memory, and the loss and
gradient-norm agreement with stock (summarize_workload; docs/benchmarks.md, "Exact savings on ragged workloads").

Beside every measured speedup: the FLOP limit (flops.py) from the work each side really did (tokens executed, head
positions scored, rows backpropagated, reference forwards, checkpointing recompute), and efficiency = measured/limit.
"""

from __future__ import annotations

import argparse
import copy
import csv
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import asdict

import torch

from benchmarks.flops import Shape, Work, mean_flops, mean_work, pruned_work, stock_work
from benchmarks.workload import (
    StepRunner, Workload, build_model, build_trainer, layout_tokens, machine_info, perturbed_copy, quiet,
    weight_sharing_copy,
)

# Pruning settings (PrunedDPOConfig fields). "none" separates what the compacted head alone buys (stock TRL on CPU scores
# every position, prompt and padding included; the plugin's forward only the kept response positions): nothing pruned
# or saved, timed through the plugin's forward (workload.build_trainer). "max": the most aggressive setting we would
# still train with -- one branch per pair, a quarter of the positions, and three responses in four cut to a prefix of
# at least half. PrunedDPOConfig turns the exact savings (`share_prompt`, `padding_free`) on by default: every setting
# spells them out (off unless the row is about them), so each row measures what its name says.
SAVINGS_OFF = dict(share_prompt=False, padding_free=False)
SETTINGS = {
    "none": {},  # every probability at 1 and (below) the exact savings off: the plugin's forward at identity
    "branch": dict(branch_keep_prob=0.5),
    "position": dict(position_keep_prob=0.5),
    "prefix": dict(prefix_prune_prob=0.5),
    "combined": dict(branch_keep_prob=0.5, position_keep_prob=0.5, prefix_prune_prob=0.5),
    "max": dict(branch_keep_prob=0.5, position_keep_prob=0.25, prefix_prune_prob=0.75),
    # share_prompt (exact): each pair's prompt and common response start run once (docs/method.md, "Packed layout")
    "share": dict(share_prompt=True),
}
# The exact savings (issue 20) on ragged workloads (`--workload`): TRL's own `padding_free` field (stock TRL 1.16 ignores
# it and pads), then the plugin's prompt sharing and common-prefix skipping on top -- "exact" is the preset that keeps
# the loss and gradients of stock -- and one unbiased pruning beyond it.
EXACT_PRESET = dict(padding_free=True, share_prompt=True, prune_common_prefix=True)
SETTINGS.update({
    "padding_free": dict(padding_free=True),
    "padding_free+share": dict(padding_free=True, share_prompt=True),
    "exact": EXACT_PRESET,
    "exact+prefix0.5": dict(EXACT_PRESET, prefix_prune_prob=0.5),
    "exact+branch0.5": dict(EXACT_PRESET, branch_keep_prob=0.5),
    "exact+position0.5": dict(EXACT_PRESET, position_keep_prob=0.5),
})
SETTINGS = {name: {**SAVINGS_OFF, **fields} for name, fields in SETTINGS.items()}
MAIN_SETTINGS = ["none", "branch", "position", "prefix", "combined", "max"]
WORKLOAD_SETTINGS = ["padding_free", "padding_free+share", "exact", "exact+prefix0.5"]
# `--model`: the exact preset and each fixed pruning on top of it (issue 29, item 5)
MODEL_SETTINGS = ["padding_free", "exact", "exact+branch0.5", "exact+position0.5", "exact+prefix0.5"]
ESTIMATORS = ("prefix_prune_prob", "position_keep_prob", "branch_keep_prob")  # settings with these are not exact

SMOKE_SHAPE = dict(
    hidden_size=64, num_hidden_layers=2, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1,
    head_dim=32, tie_word_embeddings=True,
)
MAIN = Workload(vocab_size=8192, prompt_len=64, response_len=128, batch_size=4)


# `--workload`: ragged lengths from workload.LENGTH_MODELS (full scale: UltraFeedback-shaped median row 409 tokens,
# HH-shaped 186, multi-turn 512; `short` is uniform 32 + 32), 8 pairs per step, checkpointing on, live reference
# (perturbed from the policy, so the loss is not log 2 and its agreement with stock means something).
WORKLOAD_NAMES = ("ultrafeedback", "hh", "multiturn", "short")
WORKLOAD_MODES = {  # length scale (not for `short`), rounds, memory settings; quick: <= 6 min CPU for all four
    "smoke": dict(scale=0.125, batch=2, batches=2, warmup=1, rounds=1, memory_steps=1, memory_settings=["exact"],
                  vocab=512),
    "quick": dict(scale=0.25, batch=8, batches=4, warmup=1, rounds=3, memory_steps=1, memory_settings=["exact"]),
    "full": dict(scale=0.5, batch=8, batches=8, warmup=1, rounds=7, memory_steps=2),
    # `--model` (a pretrained model): a quarter of the lengths, 4 batches cycled, one measured step per fresh memory
    # process. SmolLM2-135M at x0.25: a stock step ~40-55 CPU s and ~4.7 GiB of step memory, ~20 CPU min in all; at
    # full length (`--scale 1`) ~4x the time and, for stock's 49k-vocabulary logits, ~4x the memory (>16 GiB)
    "model": dict(scale=0.25, batch=8, batches=4, warmup=1, rounds=3, memory_steps=1),
}


def workload_plan(mode: str, names: list[str], scale: float | None = None, near_copy: float = 0.0,
                  model: str = "") -> dict:
    """The `--workload` grid: one group per workload, its stock trainer and every setting side by side. `model`: a
    pretrained model's folder (or `builtin:` name) and real text (workload.text_rows); `--quick` / `--full` then use
    the "model" preset (`--smoke` keeps its tiny lengths)."""
    if model and mode != "smoke":
        mode = "model"
    m = WORKLOAD_MODES.get(mode)
    if m is None:
        raise SystemExit(f"--workload runs in --smoke, --quick or --full mode, not --{mode}")
    groups = []
    for name in names:
        w = Workload(
            vocab_size=m.get("vocab", 8192), batch_size=m["batch"], num_batches=m["batches"], name=name,
            lengths=name, length_scale=1.0 if name == "short" else (scale or m["scale"]), shared_response=near_copy,
            reference_noise=0.01, model_shape=dict(SMOKE_SHAPE if mode == "smoke" else MAIN.model_shape), model=model,
        )
        groups.append(dict(workload=w, precompute=False, checkpointing=True, kind="workload"))
    out = dict(groups=groups, warmup=m["warmup"], rounds=m["rounds"], memory="all", memory_steps=m["memory_steps"])
    if "memory_settings" in m:  # else every timed setting
        out["memory_settings"] = m["memory_settings"]
    return out


def plan(mode: str) -> dict:
    """Groups to time, how many rounds, and which groups get fresh-process memory measurements."""
    ref_ckpt = [(False, True), (True, True), (False, False), (True, False)]  # (precompute, checkpointing)
    main = [dict(workload=MAIN, precompute=p, checkpointing=c, kind="main") for p, c in ref_ckpt]
    if mode == "smoke":
        tiny = Workload(vocab_size=512, prompt_len=16, response_len=32, batch_size=2, model_shape=SMOKE_SHAPE)
        return dict(
            groups=[dict(workload=tiny, precompute=False, checkpointing=True, kind="main")],
            warmup=1, rounds=2, memory="all", memory_steps=1, memory_settings=["combined"],
        )
    if mode == "quick":  # TRL's default (checkpointing on), both reference modes
        return dict(groups=main[:2], warmup=2, rounds=6, memory="all", memory_steps=2)
    # One pair per step keeps the 128k-vocabulary, 1024-token cells within a 2-core budget. With one pair each group
    # (backpropagated / not) is a single row, so trimming a group is trimming a row: prefix pruning saves its full
    # expected fraction here, unlike the padded four-pair batches of the main grid.
    scaling = [
        dict(workload=Workload(vocab_size=v, prompt_len=64, response_len=r, batch_size=1, num_batches=4),
             precompute=True, checkpointing=True, kind="scaling")
        for v in (8192, 131072)
        for r in (128, 512, 1024)
    ]
    return dict(
        groups=main + scaling, warmup=2, rounds=10, scaling_warmup=1, scaling_rounds=3, memory="main",
        memory_steps=2,
    )


# ---------------------------------------------------------------------------------------------------------- timing
def _from_masks(trainer) -> dict:
    """Two counts `last_prune_stats` lacks, from the pruned trainer's last masks (`last_micro_step`): scored positions
    in the backpropagated rows, and the tokens the kept rows need (what a packed batch would execute)."""
    record = getattr(trainer, "last_micro_step", None)
    if record is None:
        return {}
    masks = record.masks
    return dict(
        grad_positions=float(masks.scored[masks.backprop].sum()), needed_tokens=float(masks.executed.sum())
    )


def _work(side: str, runner: StepRunner, group: dict, compact_head: bool) -> Work:
    live = not group["precompute"]
    stats = getattr(runner.trainer, "last_prune_stats", None)
    if side == "pruned" and stats:
        return pruned_work(stats, live_reference=live, **_from_masks(runner.trainer))
    # Stock (and a pruned trainer that reports nothing, e.g. the placeholder): TRL's own stacked computation.
    return stock_work(runner.last_batch, live_reference=live, compact_head=compact_head)


def time_group(group: dict, settings: list[str], warmup: int, rounds: int, device: str, bf16: bool, log) -> dict:
    w: Workload = group["workload"]
    base = build_model(w, torch.bfloat16 if bf16 else torch.float32)
    sides = [("stock", None)] + [("pruned", s) for s in settings]
    runners = {}
    # A pretrained model is too large for one private copy (+ reference, + Adam state) per trainer: the trainers share
    # one set of weights, one reference and one optimizer at learning rate 0 (workload.weight_sharing_copy).
    share = bool(w.model)
    ref = perturbed_copy(base, w.reference_noise, w.seed) if share and not group["precompute"] else None
    optimizer = None
    for side, setting in sides:
        trainer = build_trainer(
            side, w, weight_sharing_copy(base) if share else copy.deepcopy(base), precompute=group["precompute"],
            checkpointing=group["checkpointing"], pruning=SETTINGS.get(setting), device=device, bf16=bf16,
            ref_model=weight_sharing_copy(ref) if ref is not None else None, learning_rate=0.0 if share else 1e-6,
        )
        runner = StepRunner(trainer, optimizer=optimizer)
        optimizer = runner.optimizer if share else None
        runners[setting or "stock"] = (side, runner)
    compact_head = device != "cpu" and torch.cuda.is_available()  # TRL compacts the head on Triton devices only
    names = list(runners)
    times = {n: [] for n in names}
    cpu_times = {n: [] for n in names}
    works = {n: [] for n in names}
    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    steps = {n: [] for n in names}  # every round, warm-up included: loss, grad norm, batch, layout (agreement, padding)
    for r in range(warmup + rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            side, runner = runners[name]
            sync()
            start, start_cpu = time.perf_counter(), time.process_time()
            loss = runner.step()
            sync()
            elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
            steps[name].append(_step_record(side, runner, loss, measured=r >= warmup))
            if r >= warmup:
                times[name].append(elapsed)
                cpu_times[name].append(elapsed_cpu)
                works[name].append(_work(side, runner, group, compact_head))
        if r >= warmup:
            log(f"    round {r - warmup + 1}/{rounds}: " + " ".join(
                f"{n}={times[n][-1]:.2f}s/{cpu_times[n][-1]:.2f}cpu" for n in names))
    shape = Shape.from_config(base.config)
    return dict(times=times, cpu_times=cpu_times, works=works, shape=shape, steps=steps)


def _step_record(side: str, runner: StepRunner, loss, measured: bool) -> dict:
    """What a step did, read after its clock stopped: its loss and gradient norm, a fingerprint of its batch, and the
    policy forward's executed and real tokens (padding = executed - real; workload.layout_tokens).

    The layout comes from `last_prune_stats` (public): none reported means TRL's own padded forward ran (stock, or a
    setting the trainer fell back on); `shared_pairs` means the shared-prompt packing; otherwise one row per response,
    padded (each row runs its last token too) or, when fewer tokens ran than padded rows hold, packed (pre-shifted).
    Prefix pruning changes what a row must run: its scored mask is read from the trainer's `last_micro_step` (without
    it the count assumes every response position scored).
    """
    batch = runner.last_batch
    stats = (getattr(runner.trainer, "last_prune_stats", None) or {}) if side == "pruned" else {}
    record = getattr(runner.trainer, "last_micro_step", None) if stats else None
    masks = record.masks if record is not None else None
    counts = layout_tokens(batch, masks.scored if masks is not None else None)
    if not stats:
        layout, executed = "trl-padded", batch["input_ids"].numel()
    else:
        shared, split = stats.get("shared_pairs", 0), stats.get("split_pairs", 0)
        layout = "mixed" if shared and split else "shared" if shared else "rows"
        executed = stats["policy_tokens_executed"]
    if layout == "rows" and executed < counts["rows"]:
        layout = "rows-packed"
    norm = runner.last_grad_norm
    return dict(
        measured=measured,
        loss=float(loss),
        grad_norm=None if norm is None else float(norm),
        batch=hash(tuple(batch["input_ids"].flatten().tolist())),
        layout=layout,
        executed=int(executed),
        real=None if layout == "mixed" else counts["padded" if layout == "trl-padded" else layout.replace("-", "_")],
        data_tokens=counts["padded"],  # the batch's own tokens (stock's real ones): the tokens/s numerator
    )


def summarize(group: dict, timed: dict, memory: dict, clock: str = "wall") -> list[dict]:
    """One row per pruned setting. `clock` picks the step time the speedup uses: "wall" (perf_counter) or "cpu"
    (process CPU time: on a shared machine with one torch thread it ignores time the scheduler gave to others)."""
    works, shape = timed["works"], timed["shape"]
    times = timed["times"] if clock == "wall" else timed["cpu_times"]
    other = timed["cpu_times"] if clock == "wall" else timed["times"]
    ckpt = group["checkpointing"]
    stock_t = statistics.median(times["stock"])
    stock_flops = mean_flops(shape, works["stock"], ckpt)
    stock_work_avg = mean_work(works["stock"])
    w: Workload = group["workload"]
    rows = []
    for name in times:
        if name == "stock":
            continue
        t = statistics.median(times[name])
        flops = mean_flops(shape, works[name], ckpt)
        work = mean_work(works[name])
        paired = [s / p for s, p in zip(times["stock"], times[name])]
        limit = stock_flops["total"] / flops["total"]
        speedup = stock_t / t
        mem_s, mem_p = memory.get("stock"), memory.get(name)
        row = dict(
            kind=group["kind"],
            workload=w.name or w.label(),
            reference="precomputed" if group["precompute"] else "live",
            checkpointing=ckpt,
            vocab=shape.vocab,
            model=w.model,
            response_len=w.response_len,
            prompt_len=w.prompt_len,
            batch_pairs=w.batch_size,
            setting=name,
            **{k: v for k, v in SETTINGS[name].items()},
            steps=len(times[name]),
            clock=clock,
            stock_step_s=stock_t,
            pruned_step_s=t,
            speedup=speedup,
            speedup_other_clock=statistics.median(other["stock"]) / statistics.median(other[name]),
            speedup_paired_median=statistics.median(paired),
            speedup_iqr=_iqr(paired),
            flop_limit=limit,
            efficiency=speedup / limit,
            stock_gflop=stock_flops["total"] / 1e9,
            pruned_gflop=flops["total"] / 1e9,
            stock_gflops_per_s=stock_flops["total"] / 1e9 / stock_t,
            pruned_gflops_per_s=flops["total"] / 1e9 / t,
            pruned_flops_breakdown={k: v / 1e9 for k, v in flops.items()},
            stock_flops_breakdown={k: v / 1e9 for k, v in stock_flops.items()},
            tokens_executed=work.policy_tokens / stock_work_avg.policy_tokens,
            tokens_needed=work.needed_tokens / stock_work_avg.policy_tokens,
            stock_tokens_needed=stock_work_avg.needed_tokens / stock_work_avg.policy_tokens,
            tokens_backpropagated=work.grad_tokens / stock_work_avg.policy_tokens,
            head_positions_vs_stock=work.policy_positions / stock_work_avg.policy_positions,
            positions_scored=work.policy_positions / work.response_positions,
            branches_backpropagated=work.grad_rows / work.policy_rows,
            reference_tokens_vs_stock=(
                work.reference_tokens / stock_work_avg.reference_tokens if stock_work_avg.reference_tokens else None
            ),
            head_share=shape.head_share(stock_work_avg.policy_tokens / stock_work_avg.policy_rows),
        )
        if "none" in times and name != "none":
            # The pruning alone: against the pruned trainer with every probability at 1 (same compacted head). On
            # Triton devices, where stock TRL compacts too, this is the ratio to expect against stock.
            none_t = statistics.median(times["none"])
            none_limit = mean_flops(shape, works["none"], ckpt)["total"] / flops["total"]
            row.update(
                speedup_vs_none=none_t / t, limit_vs_none=none_limit, efficiency_vs_none=none_t / t / none_limit
            )
        if mem_s and mem_p and mem_s.get("ok") and mem_p.get("ok"):
            row.update(
                stock_working_mb=mem_s["working_mb"],
                pruned_working_mb=mem_p["working_mb"],
                memory_ratio=mem_p["working_mb"] / mem_s["working_mb"],
                stock_baseline_mb=mem_s["baseline_mb"],
                pruned_baseline_mb=mem_p["baseline_mb"],
            )
        rows.append(row)
    return rows


PAD_HONOURED = 0.01  # padding_free counts as honoured when at most this share of the executed tokens is padding


def summarize_workload(group: dict, timed: dict, memory: dict, clock: str) -> list[dict]:
    """The `--workload` rows: `summarize`'s, a `stock` row first, and per setting the step-time ratio as the median of
    the per-round ratios (each round's sides ran the same batch), tokens/s, the padding share of the policy forward,
    the layout that really ran, and the loss and gradient-norm agreement with stock."""
    steps, times = timed["steps"], timed["cpu_times" if clock == "cpu" else "times"]
    w: Workload = group["workload"]

    def measured(name):
        return [r for r in steps[name] if r["measured"]]

    def executed_over_real(name):  # < 1: the layout runs fewer tokens than counted as real (then padding is 0)
        recs = measured(name)
        if any(r["real"] is None for r in recs):
            return None
        return sum(r["executed"] for r in recs) / sum(r["real"] for r in recs)

    def padding(name):
        ratio = executed_over_real(name)
        return None if ratio is None else max(1.0 - 1.0 / ratio, 0.0)

    def per_second(name):
        return sum(r["data_tokens"] for r in measured(name)) / sum(times[name])

    def executed_per_step(name):  # the policy forward's tokens (padding included where it ran padded)
        return statistics.mean(r["executed"] for r in measured(name))

    def peak(name):  # the trainer's whole peak (weights, reference, optimizer state, step), fresh process
        m = memory.get(name) or {}
        return m["peak_mb"] - m["rss_start_mb"] if m.get("ok") and "rss_start_mb" in m else None

    stock_mem = memory.get("stock") or {}
    base = dict(kind="workload", workload=w.name or w.label(), group=w.label(), lengths=w.lengths,
                length_scale=w.length_scale, near_copy=w.shared_response, batch_pairs=w.batch_size,
                reference="precomputed" if group["precompute"] else "live", checkpointing=group["checkpointing"],
                vocab=timed["shape"].vocab, model=w.model, clock=clock, prompt_len=None, response_len=None)
    stock = dict(base, setting="stock", steps=len(times["stock"]), stock_step_s=statistics.median(times["stock"]),
                 pruned_step_s=statistics.median(times["stock"]), speedup=1.0, speedup_paired_median=1.0,
                 layouts=["trl-padded"], padding_share=padding("stock"), executed_over_real=executed_over_real("stock"),
                 tokens_per_s=per_second("stock"), tokens_executed_per_step=executed_per_step("stock"),
                 token_limit=1.0, stock_tokens_per_s=per_second("stock"), exact=True, notes="")
    if stock_mem.get("ok"):
        stock.update(stock_working_mb=stock_mem["working_mb"], pruned_working_mb=stock_mem["working_mb"],
                     memory_ratio=1.0, stock_peak_mb=peak("stock"), pruned_peak_mb=peak("stock"),
                     peak_ratio=1.0 if peak("stock") else None)
    rows = [stock]
    for row in summarize(group, timed, memory, clock):
        name = row["setting"]
        fields = SETTINGS[name]
        layouts = sorted({r["layout"] for r in steps[name]})
        pad = padding(name)
        notes = []
        # branch pruning keeps one branch of some pairs: those run as rows beside the shared pairs ("mixed", whose
        # padding is not counted) by design
        split_by_design = (fields.get("branch_keep_prob", 1.0) < 1.0
                           and set(layouts) <= {"shared", "mixed", "rows-packed"})
        if fields.get("padding_free") and not split_by_design:
            if "trl-padded" in layouts:
                notes.append("padding_free ignored: TRL's padded forward ran")
            elif pad is None or pad > PAD_HONOURED:
                notes.append("padding_free not honoured: " + (f"{pad:.1%} padding" if pad is not None else "mixed"))
        if fields.get("share_prompt") and layouts != ["shared"] and not split_by_design:
            notes.append(f"share_prompt did not share ({'/'.join(layouts)})")
        exact = not any(k in fields for k in ESTIMATORS)
        row.update(base, **agreement(steps["stock"], steps[name]))
        row.update(layouts=layouts, padding_share=pad, executed_over_real=executed_over_real(name),
                   stock_padding_share=stock["padding_share"],
                   tokens_per_s=per_second(name), stock_tokens_per_s=stock["tokens_per_s"], exact=exact,
                   tokens_executed_per_step=executed_per_step(name),
                   token_limit=executed_per_step("stock") / executed_per_step(name), notes="; ".join(notes))
        if peak(name) and peak("stock"):
            row.update(stock_peak_mb=peak("stock"), pruned_peak_mb=peak(name), peak_ratio=peak(name) / peak("stock"))
        rows.append(row)
    return rows


def agreement(stock: list[dict], other: list[dict]) -> dict:
    """Loss and gradient-norm differences from stock on the same batches: at the first step (identical weights: the
    exactness check) and the largest over every step (the weights drift apart by rounding through the optimizer)."""
    pairs = [(s, o) for s, o in zip(stock, other) if s["batch"] == o["batch"]]
    if not pairs or len(pairs) != len(stock):
        return dict(batches_match=False)
    loss = [abs(o["loss"] - s["loss"]) for s, o in pairs]
    norm = [abs(o["grad_norm"] - s["grad_norm"]) / max(abs(s["grad_norm"]), 1e-12) for s, o in pairs
            if s["grad_norm"] is not None and o["grad_norm"] is not None]
    return dict(batches_match=True, stock_loss_first=pairs[0][0]["loss"], loss_diff_first=loss[0],
                loss_diff_max=max(loss), grad_norm_rel_diff_first=norm[0] if norm else None,
                grad_norm_rel_diff_max=max(norm) if norm else None)


def _iqr(xs: list[float]) -> float:
    if len(xs) < 4:
        return float("nan")
    q = statistics.quantiles(xs, n=4)
    return q[2] - q[0]


# ---------------------------------------------------------------------------------------------------------- memory
def measure_memory(server, group: dict, settings: list[str], device: str, bf16: bool, steps: int, log, threads):
    w: Workload = group["workload"]
    out = {}
    for name in ["stock"] + settings:
        spec = dict(
            workload=asdict(w), side="stock" if name == "stock" else "pruned", pruning=SETTINGS.get(name),
            precompute=group["precompute"], checkpointing=group["checkpointing"], device=device, bf16=bf16,
            # a pretrained model's steps are long: its optimizer state comes from a zero-gradient step (memory.py)
            warmup="optimizer" if w.model else 1, steps=steps, threads=threads,
        )
        out[name] = server.measure(spec)
        if out[name].get("ok"):
            log(f"    memory {name}: working {out[name]['working_mb']:.0f} MiB over {out[name]['baseline_mb']:.0f}")
        else:
            log(f"    memory {name}: FAILED {out[name].get('error')}")
    return out


# ---------------------------------------------------------------------------------------------------------- output
COLUMNS = [
    ("setting", "setting", "{}"),
    ("stock_step_s", "stock s", "{:.3f}"),
    ("pruned_step_s", "pruned s", "{:.3f}"),
    ("speedup", "speedup", "{:.2f}x"),
    ("flop_limit", "limit", "{:.2f}x"),
    ("efficiency", "eff", "{:.2f}"),
    ("speedup_vs_none", "vs none", "{:.2f}x"),
    ("limit_vs_none", "limit", "{:.2f}x"),
    ("efficiency_vs_none", "eff", "{:.2f}"),
    ("tokens_executed", "tok exec", "{:.2f}"),
    ("tokens_needed", "tok need", "{:.2f}"),
    ("head_positions_vs_stock", "head pos", "{:.2f}"),
    ("positions_scored", "pos/resp", "{:.2f}"),
    ("branches_backpropagated", "br bp", "{:.2f}"),
    ("stock_working_mb", "mem stock", "{:.0f}M"),
    ("pruned_working_mb", "mem pruned", "{:.0f}M"),
    ("memory_ratio", "mem ratio", "{:.2f}"),
]


WORKLOAD_COLUMNS = [
    ("setting", "setting", "{}"),
    ("layouts", "ran as", "{}"),
    ("speedup_paired_median", "vs stock", "{:.2f}x"),
    ("pruned_step_s", "s/step", "{:.3f}"),
    ("tokens_executed_per_step", "tok exec", "{:.0f}"),
    ("token_limit", "tok limit", "{:.2f}x"),
    ("tokens_per_s", "tok/s", "{:.0f}"),
    ("padding_share", "padding", "{:.1%}"),
    ("pruned_working_mb", "work mem", "{:.0f}M"),
    ("memory_ratio", "mem ratio", "{:.2f}"),
    ("pruned_peak_mb", "peak", "{:.0f}M"),
    ("peak_ratio", "peak ratio", "{:.2f}"),
    ("loss_diff_first", "dloss@1", "{:.1e}"),
    ("grad_norm_rel_diff_first", "dgnorm@1", "{:.1e}"),
    ("notes", "notes", "{}"),
]


def group_title(row: dict) -> str:
    if row["kind"] == "workload":
        ckpt = "on" if row["checkpointing"] else "off"
        return f"{row['group']} | reference={row['reference']} | checkpointing={ckpt} | clock={row['clock']}"
    return (
        f"{row.get('workload', '')} V={row['vocab'] // 1024}k P={row['prompt_len']} R={row['response_len']} "
        f"B={row['batch_pairs']} | reference={row['reference']} | "
        f"checkpointing={'on' if row['checkpointing'] else 'off'}"
    )


def format_table(rows: list[dict]) -> str:
    lines = []
    title = None
    for row in rows:
        columns = WORKLOAD_COLUMNS if row["kind"] == "workload" else COLUMNS
        widths = [max(len(h), 18 if key == "setting" else 9) for key, h, _ in columns]
        if group_title(row) != title:
            title = group_title(row)
            lines += ["", title, "  ".join(h.rjust(wd) for (_, h, _), wd in zip(columns, widths))]
        cells = []
        for (key, _, fmt), wd in zip(columns, widths):
            value = row.get(key)
            value = "/".join(value) if isinstance(value, list) else value
            cells.append(("-" if value is None else fmt.format(value)).rjust(wd))
        lines.append("  ".join(cells))
    return "\n".join(lines)


def write_outputs(out_dir: str, meta: dict, rows: list[dict], plot_png: bool = True):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "step_time.json"), "w") as f:
        json.dump(dict(meta=meta, results=rows), f, indent=1)
    flat = [{k: v for k, v in r.items() if not isinstance(v, dict)} for r in rows]
    keys = list(dict.fromkeys(k for r in flat for k in r))
    with open(os.path.join(out_dir, "step_time.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(flat)
    if not plot_png:
        return
    try:
        from benchmarks.plot import plot

        plot(rows, meta, os.path.join(out_dir, "step_time.png"))
    except ImportError as e:  # matplotlib is a dev extra
        print(f"(no plot: {e})", file=sys.stderr)


def warn_if_loaded():
    """One line on stderr when the machine is busier than its cores: wall-clock ratios mean little then."""
    try:
        load, cores = os.getloadavg()[0], os.cpu_count() or 1
    except OSError:
        return
    if load > cores:
        print(f"warning: load average {load:.1f} exceeds the {cores} cores: other jobs compete for the CPU; use "
              "--threads 1 --clock cpu (the CPU default) and read wall-clock numbers with care", file=sys.stderr)


# ------------------------------------------------------------------------------------------------------------ main
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="mode", action="store_const", const="quick", help="main grid (default)")
    mode.add_argument("--full", dest="mode", action="store_const", const="full", help="+ memory everywhere, scaling")
    mode.add_argument("--smoke", dest="mode", action="store_const", const="smoke", help="tiniest mode, for CI")
    parser.add_argument(
        "--workload", nargs="+", choices=[*WORKLOAD_NAMES, "all"],
        help="ragged workloads (ultrafeedback, hh, multiturn: lengths in workload.LENGTH_MODELS; short: uniform), "
        "stock against padding_free, + share_prompt, + prune_common_prefix (the exact preset), + prefix pruning; "
        "--smoke / --quick (default, <= 6 min CPU for all) / --full",
    )
    parser.add_argument("--scale", type=float, help="with --workload: length scale (default: the mode's; 1 = full)")
    parser.add_argument(
        "--model", default="",
        help="a local HF model folder or a builtin: name: its weights and tokenizer on real English text at the "
        "workloads' lengths (default workloads: ultrafeedback hh; settings: stock, padding_free, the exact preset, "
        "and the exact preset + each fixed pruning at 0.5; lengths x0.25 unless --scale, 3 rounds)")
    parser.add_argument("--near-copy", type=float, default=0.0, metavar="FRACTION",
                        help="with --workload: the rejected response repeats this fraction of the chosen one at its "
                        "start (default 0: dissimilar responses with the workload's small shared start)")
    parser.add_argument("--out", help="output folder (default benchmarks/results/<mode>_<device>)")
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS),
                        help="settings to time (default: the mode's own list)")
    parser.add_argument("--rounds", type=int, help="measured rounds per group (overrides the mode)")
    parser.add_argument("--warmup", type=int, help="warm-up rounds per group (overrides the mode)")
    parser.add_argument("--only", choices=["main", "scaling"], help="run one kind of group only")
    parser.add_argument("--reference", choices=["live", "precomputed"], help="run one reference mode only")
    parser.add_argument("--checkpointing", choices=["on", "off"], help="run one checkpointing mode only")
    parser.add_argument("--no-memory", action="store_true", help="skip the fresh-process memory measurements")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--bf16", action="store_true", help="bf16 on both sides (default fp32)")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: 1 on CPU, torch's on GPU)")
    parser.add_argument(
        "--clock", choices=["wall", "cpu"],
        help="step time for the speedup: process CPU time (default on CPU: with one thread it ignores time the "
        "scheduler gave to other jobs) or wall clock (default on GPU)",
    )
    args = parser.parse_args(argv)
    mode = args.mode or "quick"
    workloads = None
    if args.workload:
        workloads = list(WORKLOAD_NAMES) if "all" in args.workload else list(dict.fromkeys(args.workload))
    elif args.model:
        workloads = ["ultrafeedback", "hh"]
    if args.settings is None:
        args.settings = MODEL_SETTINGS if args.model else WORKLOAD_SETTINGS if workloads else MAIN_SETTINGS
    on_cpu = args.device == "cpu"
    # On a CPU shared with other jobs, several threads oversubscribe the cores and ratios collapse toward 1.0x: one
    # thread and the CPU-time clock measure honestly there (docs/benchmarks.md).
    args.threads = args.threads or (1 if on_cpu else None)
    args.clock = args.clock or ("cpu" if on_cpu else "wall")
    quiet()
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    warn_if_loaded()
    prefix = "workloads_" if workloads else ""
    if args.model:
        prefix = f"model_{os.path.basename(args.model.rstrip('/')).replace('builtin:', '')}_"
    out_dir = args.out or os.path.join(os.path.dirname(__file__), "results", f"{prefix}{mode}_{args.device}")
    p = workload_plan(mode, workloads, args.scale, args.near_copy, args.model) if workloads else plan(mode)
    groups = p["groups"]
    if args.only:
        groups = [g for g in groups if g["kind"] == args.only]
    if args.reference:
        groups = [g for g in groups if g["precompute"] == (args.reference == "precomputed")]
    if args.checkpointing:
        groups = [g for g in groups if g["checkpointing"] == (args.checkpointing == "on")]

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    started = time.time()
    meta = dict(
        mode=mode, settings={k: SETTINGS[k] for k in args.settings}, machine=machine_info(args.device, threads),
        model_shape=(groups[0]["workload"].model_shape if groups and not args.model else None), model=args.model,
        rounds=args.rounds or p["rounds"], started=time.strftime("%Y-%m-%d %H:%M"),
        dtype="bf16" if args.bf16 else "fp32", clock=args.clock,
    )
    rows = []
    memory_server = None
    if not args.no_memory and p["memory"]:
        from benchmarks.memory import MemoryServer

        memory_server = MemoryServer()
    try:
        for group in groups:
            scaling = group["kind"] == "scaling"
            rounds = args.rounds or (p.get("scaling_rounds", p["rounds"]) if scaling else p["rounds"])
            warmup = p.get("scaling_warmup", p["warmup"]) if scaling else p["warmup"]
            warmup = warmup if args.warmup is None else args.warmup
            w = group["workload"]
            log(
                f"[{time.time() - started:5.0f}s] {w.label()} reference="
                f"{'precomputed' if group['precompute'] else 'live'} checkpointing={group['checkpointing']}"
            )
            timed = time_group(group, args.settings, warmup, rounds, args.device, args.bf16, log)
            gc.collect()  # the timed trainers (a pretrained model's weights, Adam state) go before the memory runs
            memory = {}
            wants_memory = p["memory"] == "all" or p["memory"] == group["kind"]
            if memory_server is not None and wants_memory:
                # the timings first: a long run that dies in its memory runs keeps them
                summary = (summarize_workload if workloads else summarize)(group, timed, {}, args.clock)
                write_outputs(out_dir, meta, rows + summary, plot_png=False)
                names = [s for s in args.settings if s in p.get("memory_settings", args.settings)]
                memory = measure_memory(
                    memory_server, group, names, args.device, args.bf16, p["memory_steps"], log, threads
                )
            group_rows = (summarize_workload if workloads else summarize)(group, timed, memory, args.clock)
            print(format_table(group_rows), flush=True)
            rows += group_rows
            meta["elapsed_s"] = time.time() - started
            meta["cpu_s"] = time.process_time()  # this process only (memory runs in its own processes)
            # after every group: a long run that dies keeps what it measured
            write_outputs(out_dir, meta, rows, plot_png=not workloads)
    finally:
        if memory_server is not None:
            memory_server.close()
    print("\nAll groups:" + format_table(rows))
    print(f"\nwrote {out_dir}/step_time.{{json,csv,png}} in {time.time() - started:.0f}s")
    return rows


if __name__ == "__main__":
    main()
