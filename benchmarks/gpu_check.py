"""GPU check of the plugin against stock TRL on one CUDA device: one table, one results file (issue 44, item 4).

    bash benchmarks/gpu_check.sh        # = PYTHONPATH=. python -m benchmarks.gpu_check --budget 380
    python -m benchmarks.gpu_check --dry-run --warmup 1 --steps 1      # the same rows on a tiny CPU model (CI)

bf16; Qwen2.5-0.5B/1.5B/3B/7B-shaped models built from their configs (no download; random weights, synthetic pairs:
step times do not depend on the values); a live reference (the policy's copy plus noise, so the loss is not log 2
whatever the log-probs; the 7B cell is LoRA r16, its reference the policy with the adapter off); UltraFeedback-shaped
lengths (benchmarks/workload.py's LENGTH_MODELS: median row ~409 tokens, tail truncated at 1024).

Rows, most informative first (past `--budget` seconds the rest are listed as skipped; 3B and 7B-LoRA last):
  0.5B and 1.5B, 8 pairs: stock (SDPA), noise (stock with eager attention: the noise floor of two stock kernels),
      defaults, exact (the exact preset: defaults + prune_common_prefix=True)
  0.5B, 8 pairs: branch, position, prefix (each estimator at 0.5 on top of the exact preset: branch_keep_prob,
      position_keep_prob, prefix_prune_prob)
  0.5B prompt groups: 4 responses per prompt, all 6 pairs, 2 prompts per micro-batch (12 pairs); stock and the
      defaults with group_by_prompt=True, both fed the same grouped batches
  0.5B, micro-batches of 8 pairs with gradient accumulation 4: stock and exact
  0.5B, the largest micro-batch that fits `--cap-gib` (80 GiB): stock and exact, a bisection over pairs per
      micro-batch under that allocator cap, bounded by `--bisect-budget` seconds per side; its tokens/s
  1.5B, 8 pairs: branch, position, prefix
  3B (checkpointing), 8 pairs: stock, noise, exact
  7B with LoRA r16 (checkpointing), 8 pairs: stock, exact, noise
Checkpointing (TRL's default) is off below 3B, the budget having room for one setting there, and on for 3B and 7B
(memory). Every row of a cell builds its model from the same seed on the device, checked by a fingerprint of the
weights (a sum per parameter) against the cell's first build.

Each row, one optimizer step = `accum` micro-batches through `training_step`, then clipping, `optimizer.step`, the
scheduler, `zero_grad`, as `Trainer._inner_training_loop` drives it on one process:
  - step 0 on the same batch and weights as its cell's stock row: |loss difference| and the cosine and norm ratio of
    the whole gradient against stock's, compared parameter by parameter in chunks in float32 with the dot products
    and norms accumulated in float64 scalars (no full-gradient copy on the device; stock's gradient waits on the host
    in its own dtype); sampled rows (the estimators) are not comparable and say so;
  - `--warmup` steps in all (step 0 included), then `--steps` timed steps: CUDA-synchronised wall clock, the median;
  - tokens/s: the real (non-padding) tokens of the step's batches (chosen and rejected rows) over that median;
  - peak allocated memory (torch.cuda.max_memory_allocated, reset after the warm-up, so over the timed steps);
  - then `--profile-steps` steps under torch.profiler (CPU + CUDA activities), each inside a `gpu_check.step` range,
    per step: kernel launches (the CPU-side cudaLaunchKernel / cudaLaunchKernelExC / cuLaunchKernel / cuLaunchKernelEx
    calls inside the ranges), host synchronisations (cudaStreamSynchronize / cudaDeviceSynchronize /
    cudaEventSynchronize calls and the synchronous, non-Async cudaMemcpy* calls inside the ranges; a `.item()` is a
    cudaMemcpyAsync then a cudaStreamSynchronize: counted once), GPU busy time (the union of the GPU kernel intervals:
    time at least one kernel runs; memcpy and memset excluded; the sum of kernel durations is kept in the JSON too),
    and the device-to-host copies (GPU-side "Memcpy DtoH" events). The profiler slows the step: its wall is kept
    in the JSON apart from the timed median.
The noise floor of a shape (its `noise` row: stock eager against stock SDPA, first step, same batch and weights) is
printed beside every agreement of that shape: a row whose |dloss| and 1 - cos stay within it agrees with stock as
well as stock's own two attention kernels agree with each other.

Results: the printed table, ${OUT:-/tmp}/gpu_check.txt (the table and its legend) and gpu_check.json (the raw rows;
torch/transformers/trl versions, the device, the date, the git commit), both rewritten after every row. `--dry-run`
runs every row kind on the tiny CPU model in fp32 (every shape is that model, so 1.5B's rows, 0.5B's again, are left
out; 2 pairs for 8; one torch thread; the profiler's CPU
activity only, so the GPU-only columns read n/a; the largest-micro-batch bisection runs its probes with a stand-in
cap of 4 pairs, there being no allocator cap on CPU): it checks the script, its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import copy
import gc
import importlib.util
import json
import math
import os
import random
import re
import signal
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, replace

import torch

from benchmarks.workload import Workload, build_model, build_trainer, machine_info, quiet

QWEN25 = {  # Qwen/Qwen2.5-{0.5B,1.5B,3B,7B}'s config.json
    "0.5B": dict(hidden_size=896, num_hidden_layers=24, intermediate_size=4864, num_attention_heads=14,
                 num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6),
    "1.5B": dict(hidden_size=1536, num_hidden_layers=28, intermediate_size=8960, num_attention_heads=12,
                 num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6),
    "3B": dict(hidden_size=2048, num_hidden_layers=36, intermediate_size=11008, num_attention_heads=16,
               num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6),
    "7B": dict(hidden_size=3584, num_hidden_layers=28, intermediate_size=18944, num_attention_heads=28,
               num_key_value_heads=4, tie_word_embeddings=False, rope_theta=1000000.0, rms_norm_eps=1e-6),
}
VOCAB = 151936  # 0.5B-3B; 7B's is 152064
VOCABS = {"0.5B": VOCAB, "1.5B": VOCAB, "3B": VOCAB, "7B": 152064}
TINY = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
            tie_word_embeddings=True)

EXACT_PRESET = dict(prune_common_prefix=True)  # the defaults (share_prompt, padding_free) + the common prefix
ROWS = {  # kind: (side, PrunedDPOConfig fields, exact: its first step must agree with stock's)
    "stock": ("stock", {}, True),
    "noise": ("stock", {}, True),  # stock with eager attention, against stock with SDPA: the noise floor
    "defaults": ("pruned", {}, True),
    "exact": ("pruned", EXACT_PRESET, True),
    "branch": ("pruned", dict(EXACT_PRESET, branch_keep_prob=0.5), False),
    "position": ("pruned", dict(EXACT_PRESET, position_keep_prob=0.5), False),
    "prefix": ("pruned", dict(EXACT_PRESET, prefix_prune_prob=0.5), False),
    "groups": ("pruned", dict(group_by_prompt=True), True),
}
ROW_KINDS = ("stock", "noise", "defaults", "exact", "branch", "position", "prefix", "groups")
DRY_PAIRS = 2  # a dry run's pairs per micro-batch where the GPU's is 8
DRY_CAP_PAIRS = 4  # a dry run's stand-in for the memory cap: "fits" = at most this many pairs
STEP_MARK = "gpu_check.step"
# CUDA runtime/driver calls by name prefix (covering variants such as cudaLaunchKernelExC, cuLaunchKernelEx, _ptsz)
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchCooperativeKernel", "cudaGraphLaunch")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cuStreamSynchronize",
              "cuCtxSynchronize", "cuEventSynchronize")
RUNTIME_CALL = re.compile(r"^cu(da)?[A-Z]")
GRAD_CHUNK = 1 << 24  # elements per chunk of the gradient comparison (64 MiB in float32)


@dataclass(frozen=True)
class Cell:
    """What a group of rows trains on; its stock row is the others' reference (same batches, same weights)."""

    shape: str  # a key of QWEN25
    pairs: int = 8  # pairs per micro-batch (on the GPU; a dry run's 8 is DRY_PAIRS)
    accum: int = 1  # micro-batches per optimizer step
    ckpt: bool = False  # gradient checkpointing
    lora: int = 0  # LoRA rank (0: full fine-tuning with a live reference copy)
    data: str = "ultrafeedback"  # or "k4-all": 4 responses per prompt, all 6 pairs (benchmarks/prompt_groups.py)
    largest: bool = False  # the rows bisect pairs per micro-batch under the memory cap

    @property
    def name(self) -> str:
        parts = [self.shape] + ([f"LoRA{self.lora}"] if self.lora else []) + ["UF"]
        parts += ["k4-all"] if self.data == "k4-all" else []
        parts += [f"{self.pairs}x{self.accum}"] if self.accum > 1 else []
        parts += ["max"] if self.largest else []
        parts += ["ckpt"] if self.ckpt else []
        return " ".join(parts)

    def micro_pairs(self, dry: bool) -> int:
        return self.pairs if not dry or self.data == "k4-all" else DRY_PAIRS

    def workload(self, dry: bool, pairs: int | None = None) -> Workload:
        vocab = (8192 if self.data == "k4-all" else 512) if dry else VOCABS[self.shape]
        return Workload(vocab_size=vocab, batch_size=pairs or self.micro_pairs(dry),
                        num_batches=1 if pairs else max(2, self.accum), model_shape=TINY if dry else QWEN25[self.shape],
                        name=self.data, lengths="ultrafeedback", length_scale=0.05 if dry else 1.0,
                        reference_noise=0.01)


def plan(dry: bool) -> list[tuple[Cell, str]]:
    """(cell, row kind), most informative first: the budget cuts the tail."""
    small, mid = Cell("0.5B"), Cell("1.5B")
    core, estimators = ("stock", "noise", "defaults", "exact"), ("branch", "position", "prefix")
    rows = [(small, k) for k in core] + [(mid, k) for k in core] + [(small, k) for k in estimators]
    rows += [(Cell("0.5B", pairs=12, data="k4-all"), k) for k in ("stock", "groups")]
    rows += [(Cell("0.5B", accum=4), k) for k in ("stock", "exact")]
    rows += [(Cell("0.5B", largest=True), k) for k in ("stock", "exact")]
    rows += [(mid, k) for k in estimators]
    rows += [(Cell("3B", ckpt=True), k) for k in ("stock", "noise", "exact")]
    rows += [(Cell("7B", ckpt=True, lora=8 if dry else 16), k) for k in ("stock", "exact", "noise")]
    if dry:  # the tiny model stands for every shape: 1.5B's rows would run 0.5B's code again
        rows = [(c, k) for c, k in rows if c.shape != "1.5B"]
    return rows


# ----------------------------------------------------------------------------------------------------- the step
class Runner:
    """One trainer driven optimizer step by optimizer step as `Trainer._inner_training_loop` drives it on one process:
    `accum` micro-batches from the trainer's own dataloader through `training_step` (each loss scaled by
    1 / accum, as transformers does), then gradient clipping, `optimizer.step`, the scheduler, `zero_grad`."""

    def __init__(self, trainer, accum: int = 1):
        self.trainer, self.accum = trainer, accum
        args = trainer.args
        if getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False):
            kwargs = getattr(args, "activation_checkpointing_kwargs", None) or args.gradient_checkpointing_kwargs
            if hasattr(trainer.model, "activation_checkpointing_enable"):  # transformers >= 5.2x's spelling
                trainer.model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None)
            else:
                trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None)
        trainer.create_optimizer()
        self.model, trainer.optimizer = trainer.accelerator.prepare(trainer.model, trainer.optimizer)
        trainer.model_wrapped = self.model
        trainer.create_scheduler(num_training_steps=10**6)
        trainer.state.global_step = 0
        self.loader = trainer.get_train_dataloader()
        self._batches = iter(self.loader)

    def _next_batch(self):
        try:
            return next(self._batches)
        except StopIteration:
            self._batches = iter(self.loader)
            return next(self._batches)

    def step(self, before_clip=None):
        """One optimizer step; returns (the step's loss, a device tensor; its micro-batches). `before_clip(loss,
        model)` sees the accumulated gradient before clipping changes it."""
        t = self.trainer
        t.current_gradient_accumulation_steps = self.accum
        loss, batches = None, []
        for _ in range(self.accum):
            batch = self._next_batch()
            batches.append(batch)
            part = t.training_step(self.model, batch)
            loss = part if loss is None else loss + part
        if before_clip is not None:
            before_clip(loss, self.model)
        t.accelerator.clip_grad_norm_(self.model.parameters(), t.args.max_grad_norm)
        t.optimizer.step()
        t.lr_scheduler.step()
        self.model.zero_grad()
        t.state.global_step += 1
        return loss, batches


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def real_tokens(batches) -> float:
    """The real (non-padding) tokens of a step's micro-batches, chosen and rejected rows (TRL's stacked batch)."""
    return sum(float(b["attention_mask"].sum()) for b in batches)


# ------------------------------------------------------------------------------------------------ agreement
def host_gradient(model) -> dict:
    """The accumulated gradient, parameter by parameter, copied to the host in its own dtype."""
    return {name: p.grad.detach().to("cpu", copy=True) for name, p in model.named_parameters() if p.grad is not None}


def gradient_agreement(model, reference: dict) -> dict:
    """Cosine and norm ratio of `model`'s gradient against `reference` (host_gradient's), in chunks of GRAD_CHUNK
    elements in float32, the dot products and squared norms accumulated in float64 scalars on the device: no copy of
    the whole gradient in any dtype (a 3B model's in float64 is 24 GB)."""
    device = next(model.parameters()).device
    dot, norm, norm_ref = (torch.zeros((), dtype=torch.float64, device=device) for _ in range(3))
    seen = set()
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        if name not in reference:
            return dict(agreement_error=f"parameter {name} has a gradient here, not in stock's")
        seen.add(name)
        g, g0 = p.grad.detach().flatten(), reference[name].flatten()
        if g.numel() != g0.numel():
            return dict(agreement_error=f"parameter {name}: {g.numel()} gradient elements, {g0.numel()} in stock's")
        for start in range(0, g.numel(), GRAD_CHUNK):
            a = g[start:start + GRAD_CHUNK].float()
            b = g0[start:start + GRAD_CHUNK].to(device).float()
            dot += torch.dot(a, b).double()
            norm += torch.dot(a, a).double()
            norm_ref += torch.dot(b, b).double()
    if seen != set(reference):
        return dict(agreement_error=f"{len(set(reference) - seen)} parameters have a gradient in stock's only")
    dot, norm, norm_ref = float(dot), math.sqrt(float(norm)), math.sqrt(float(norm_ref))
    return dict(grad_cos=dot / (norm * norm_ref) if norm * norm_ref > 0 else float("nan"),
                grad_norm_ratio=norm / norm_ref if norm_ref > 0 else float("nan"))


# ------------------------------------------------------------------------------------------------- profiler
def _union(intervals) -> float:
    """Total length of the union of (start, end) intervals."""
    total, end = 0.0, -math.inf
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def _gpu_kind(event) -> str:
    """kernel, memcpy, memset or other, for a GPU-side profiler event (by its activity type where torch gives it)."""
    kind = getattr(event, "activity_type", None)
    if kind:
        return {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}.get(str(kind), "other")
    if event.name == STEP_MARK or "Sync" in event.name:  # our range on the GPU's timeline; a CUDA sync record
        return "other"
    return "memcpy" if event.name.startswith("Memcpy") else "memset" if event.name.startswith("Memset") else "kernel"


def count_events(events, steps: int) -> dict:
    """Per step, from a profile of `steps` steps each inside a STEP_MARK range: see the module's docstring."""
    from torch.autograd import DeviceType

    ranges = sorted((e.time_range.start, e.time_range.end) for e in events
                    if e.name == STEP_MARK and e.device_type == DeviceType.CPU)
    starts = [r[0] for r in ranges]

    def in_step(t):
        i = bisect.bisect_right(starts, t) - 1
        return i >= 0 and t <= ranges[i][1]

    launches = syncs = cpu_ops = host_reads = dtoh = 0
    calls: collections.Counter = collections.Counter()
    gpu_kinds: collections.Counter = collections.Counter()  # the GPU events' activity types (which ones were kernels)
    kernels = []
    for e in events:
        if e.device_type == DeviceType.CPU:
            if e.name == STEP_MARK or not in_step(e.time_range.start):
                continue
            if RUNTIME_CALL.match(e.name):
                calls[e.name] += 1
                launches += e.name.startswith(LAUNCH_CALLS)
                syncs += e.name.startswith(SYNC_CALLS) or (e.name.startswith(("cudaMemcpy", "cuMemcpy"))
                                                           and "Async" not in e.name)
            else:
                cpu_ops += 1
                host_reads += e.name == "aten::_local_scalar_dense"
        elif e.device_type == DeviceType.CUDA:
            kind = _gpu_kind(e)
            gpu_kinds[f"{getattr(e, 'activity_type', None)}->{kind}"] += 1
            if kind == "kernel":
                kernels.append((e.time_range.start, e.time_range.end))
            dtoh += kind == "memcpy" and "DtoH" in e.name
    per = 1.0 / max(steps, 1)
    return dict(launches=launches * per, syncs=syncs * per, gpu_busy_s=_union(kernels) / 1e6 * per,
                gpu_kernel_sum_s=sum(b - a for a, b in kernels) / 1e6 * per, gpu_kernels=len(kernels) * per,
                dtoh_copies=dtoh * per, cpu_ops=cpu_ops * per, host_reads=host_reads * per,
                runtime_calls=dict(sorted(((k, v * per) for k, v in calls.items()), key=lambda kv: -kv[1])[:24]),
                gpu_event_kinds=dict(gpu_kinds), profiled_steps_found=len(ranges))


def profile_steps(runner, device: str, steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    _sync(device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            with record_function(STEP_MARK):
                runner.step()
        _sync(device)  # outside the step ranges: not counted
    wall = (time.perf_counter() - start) / steps
    counts = count_events(prof.events(), steps)
    return dict(counts, profiled_wall_s=wall)


# ------------------------------------------------------------------------------------------------------ rows
class Session:
    """What rows share: arguments, device, the cells' stock first steps, the weights' fingerprints."""

    def __init__(self, args):
        self.args = args
        self.dry = args.dry_run
        self.device = "cpu" if self.dry else "cuda"
        self.dtype = torch.float32 if self.dry else torch.bfloat16
        self.stock_first: dict = {}  # cell -> (loss, host gradient) of its stock row's step 0
        self.fingerprints: dict = {}  # workload -> the weights' fingerprint at the first build
        self.durations: dict = {}  # shape -> seconds its last row took (a row that would end past the budget waits)
        self.started = time.time()

    def elapsed(self) -> float:
        return time.time() - self.started

    def dataset(self, cell: Cell, w: Workload):
        if cell.data != "k4-all":
            return None
        from datasets import Dataset

        from benchmarks.prompt_groups import group_rows

        groups = w.batch_size // 6 * w.num_batches
        return Dataset.from_dict(group_rows(4, "all", groups, w.length_scale, random.Random(4)))

    def models(self, w: Workload, attn: str, lora: int):
        """The policy (random weights from the workload's seed, built on the device) and its live reference (a copy
        plus N(0, noise^2), drawn on the device from a fixed seed), the same on every row of a cell: checked by a
        fingerprint of the weights (a sum per parameter) against the first build of this workload."""
        model = build_model(w, self.dtype, attn=attn, device=self.device)
        with torch.no_grad():
            fingerprint = torch.stack([p.sum(dtype=torch.float64) for p in model.parameters()]).cpu()
        key = (w.vocab_size, tuple(sorted(w.model_shape.items())), w.max_row(), w.seed)
        known = self.fingerprints.setdefault(key, fingerprint)
        if not torch.equal(known, fingerprint):
            raise RuntimeError("the model's weights differ from the first build of the same workload (a "
                               "non-deterministic initialisation): no agreement with stock would mean anything")
        if lora:
            return model, None
        ref = copy.deepcopy(model)
        generator = torch.Generator(device=self.device).manual_seed(w.seed + 1)
        with torch.no_grad():
            for p in ref.parameters():
                p.add_(torch.randn(p.shape, generator=generator, device=self.device, dtype=p.dtype) * w.reference_noise)
        return model, ref

    def trainer(self, cell: Cell, kind: str, w: Workload):
        side, pruning, _ = ROWS[kind]
        model, ref = self.models(w, "eager" if kind == "noise" else "sdpa", cell.lora)
        torch.manual_seed(w.seed)  # a LoRA adapter's initialisation: the same on every row of the cell
        trainer = build_trainer(side, w, model, precompute=False, checkpointing=cell.ckpt, pruning=pruning,
                                device=self.device, bf16=not self.dry, ref_model=ref, dataset=self.dataset(cell, w),
                                lora_r=cell.lora)
        if cell.data == "k4-all" and side == "stock":  # stock sees the grouped batches the plugin's sampler makes
            from trl_pruned_dpo.sampler import PromptGroupSampler, prompt_groups_of

            seed = trainer.args.data_seed if trainer.args.data_seed is not None else trainer.args.seed
            trainer._get_train_sampler = lambda *a, _t=trainer, **k: PromptGroupSampler(
                prompt_groups_of(_t.train_dataset["prompt_ids"]), _t._train_batch_size, seed)
        if side == "pruned" and not trainer.forward_choice.packed:
            raise RuntimeError("the packed path fell back to padded rows (see the warning above)")
        return trainer

    def measure(self, cell: Cell, kind: str) -> dict:
        """A timed row: agreement of step 0, then warm-up, timed steps and a profile (the module's docstring)."""
        args, device = self.args, self.device
        _, _, exact = ROWS[kind]
        w = cell.workload(self.dry)
        trainer = self.trainer(cell, kind, w)
        runner = Runner(trainer, cell.accum)
        row = {}

        def first_step(loss, model):
            if kind == "stock":
                self.stock_first[cell] = (float(loss), host_gradient(model))
            elif exact and cell in self.stock_first:
                stock_loss, stock_grad = self.stock_first[cell]
                row.update(loss_diff=abs(float(loss) - stock_loss), **gradient_agreement(model, stock_grad))

        try:
            runner.step(before_clip=first_step)
            for _ in range(args.warmup - 1):
                runner.step()
            _sync(device)
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            times, tokens = [], []
            for _ in range(args.steps):
                start = time.perf_counter()
                _, batches = runner.step()
                _sync(device)
                times.append(time.perf_counter() - start)
                tokens.append(batches)
            tokens = [real_tokens(b) for b in tokens]
            step_s = statistics.median(times)
            row.update(step_s=step_s, step_times=times, real_tokens=statistics.mean(tokens),
                       tokens_per_s=statistics.mean(tokens) / step_s,
                       peak_gib=torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
                       padded_tokens=float(sum(b["input_ids"].numel() for b in batches)),
                       executed=(getattr(trainer, "last_prune_stats", None) or {}).get("policy_tokens_executed"))
            if args.profile_steps > 0:
                row.update(profile_steps(runner, device, args.profile_steps))
            return row
        finally:
            del runner, trainer
            self.free()

    def probe(self, cell: Cell, kind: str, pairs: int) -> dict:
        """One micro-batch of `pairs` pairs: two optimizer steps (the second timed), the peak over both, or OOM (the
        allocator's cap, set by `largest`, applies to the whole probe)."""
        w = cell.workload(self.dry, pairs=pairs)
        self.free()
        trainer = runner = batches = None
        record = dict(pairs=pairs, oom=True)
        try:
            trainer = self.trainer(cell, kind, w)
            runner = Runner(trainer)
            if self.device == "cuda":
                torch.cuda.reset_peak_memory_stats()  # after the build (its float32 weights before the cast)
            runner.step()
            _sync(self.device)
            start = time.perf_counter()
            _, batches = runner.step()
            _sync(self.device)
            step_s = time.perf_counter() - start
            record = dict(pairs=pairs, step_s=step_s, real_tokens=real_tokens(batches),
                          tokens_per_s=real_tokens(batches) / step_s,
                          peak_gib=torch.cuda.max_memory_allocated() / 2**30 if self.device == "cuda" else None)
        except torch.OutOfMemoryError:
            pass
        except RuntimeError as error:  # some kernels report an allocation failure as a plain CUDA error
            if "out of memory" not in str(error):
                raise
        finally:
            trainer = runner = batches = None
        self.free()  # after the handler: a caught OOM's traceback no longer holds the step's tensors
        return record

    def largest(self, cell: Cell, kind: str) -> dict:
        """The largest micro-batch (pairs) that fits the cap: doubling from the cell's pairs until one does not fit,
        then bisection to within 1/8 (at least one pair), each probe `probe`; stops at `--bisect-budget` seconds
        or the global budget (then the result is a bound, and says so)."""
        args = self.args
        cap = args.cap_gib * 2**30
        deadline = min(time.time() + args.bisect_budget, self.started + args.budget)
        total = torch.cuda.get_device_properties(0).total_memory if self.device == "cuda" else None
        probes: list[dict] = []

        def fits(pairs: int) -> bool:
            if self.dry and pairs > DRY_CAP_PAIRS:  # the stand-in cap: no probe needed to know
                probes.append(dict(pairs=pairs, over_stand_in_cap=True))
                return False
            record = self.probe(cell, kind, pairs)
            probes.append(record)
            return not record.get("oom") and (record["peak_gib"] is None or record["peak_gib"] * 2**30 <= cap)

        if total is not None:
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
        try:
            lo, hi, n = 0, None, cell.micro_pairs(self.dry)
            limit = 4 * DRY_CAP_PAIRS if self.dry else 1024
            while hi is None and n <= limit and time.time() < deadline:
                if fits(n):
                    lo, n = n, n * 2
                else:
                    hi = n
            while hi is not None and hi - lo > max(1, lo // 8) and time.time() < deadline:
                mid = (lo + hi) // 2
                if fits(mid):
                    lo = mid
                else:
                    hi = mid
        finally:
            if total is not None:
                torch.cuda.set_per_process_memory_fraction(1.0)
        best = next((p for p in probes if p["pairs"] == lo and "step_s" in p), None)
        row = dict(max_pairs=lo, first_not_fitting=hi, bound_only=hi is None or hi - lo > max(1, lo // 8),
                   probes=probes, cap_gib=args.cap_gib if not self.dry else None,
                   cap_note=f"dry run: no allocator cap on CPU; 'fits' = at most {DRY_CAP_PAIRS} pairs (a stand-in)"
                   if self.dry else f"allocator capped at {args.cap_gib:g} GiB (set_per_process_memory_fraction)")
        if best is not None:
            row.update(step_s=best["step_s"], tokens_per_s=best["tokens_per_s"], peak_gib=best["peak_gib"],
                       real_tokens=best["real_tokens"])
        return row

    def free(self) -> None:
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------------- table
COLUMNS = (("cell", 20), ("row", 9), ("pairs", 6), ("step s", 7), ("vs stock", 8), ("tok/s", 8), ("GPU s", 7),
           ("launches", 8), ("syncs", 6), ("peak GiB", 8), ("|dloss|", 8), ("grad cos", 8), ("floor dl", 8),
           ("floor cos", 9))


def _fmt(value, spec: str, na: str = "-") -> str:
    return na if value is None else format(value, spec)


def format_table(results: list[dict], dry: bool) -> str:
    head = " ".join(f"{name:<{w}}" if i < 3 else f"{name:>{w}}" for i, (name, w) in enumerate(COLUMNS))
    lines = [head, "-" * len(head)]
    floors = {(r["shape"], r["lora"]): r for r in results if r["row"] == "noise" and "grad_cos" in r}
    gpu_na = "n/a" if dry else "-"
    for r in results:
        cell = f"{r['cell']:<20} {r['row']:<9}"
        if r["status"] != "ok":
            lines.append(f"{cell} {r['status'].upper()}: {r.get('error', '')[:100]}")
            continue
        stock = next((x for x in results if x["cell"] == r["cell"] and x["row"] == "stock" and x["status"] == "ok"),
                     None)
        vs = (f"{r['tokens_per_s'] / stock['tokens_per_s']:.2f}x" if stock and r.get("tokens_per_s")
              and stock.get("tokens_per_s") else "-")
        pairs = (f"{r['max_pairs']}" + ("+" if r.get("bound_only") else "") if "max_pairs" in r else
                 f"{r['pairs']}x{r['accum']}" if r["accum"] > 1 else f"{r['pairs']}")
        if not r["exact"]:
            agree = ("sampled", "")
        elif "agreement_error" in r:
            agree = ("mismatch", "")
        elif "grad_cos" in r:
            agree = (f"{r['loss_diff']:.1e}", f"{r['grad_cos']:.5f}")
        else:
            agree = ("-", "-")
        floor = floors.get((r["shape"], r["lora"]))
        floor_cols = (f"{floor['loss_diff']:.1e}", f"{floor['grad_cos']:.5f}") if floor and "grad_cos" in r \
            else ("-", "-")
        profiled = "launches" in r or "cpu_ops" in r
        values = (pairs, _fmt(r.get("step_s"), ".3f"), vs, _fmt(r.get("tokens_per_s"), ".0f"),
                  _fmt(r.get("gpu_busy_s") if not dry else None, ".3f", gpu_na if profiled else "-"),
                  _fmt(r.get("launches") if not dry else None, ".0f", gpu_na if profiled else "-"),
                  _fmt(r.get("syncs") if not dry else None, ".0f", gpu_na if profiled else "-"),
                  _fmt(r.get("peak_gib"), ".2f", gpu_na), agree[0], agree[1], *floor_cols)
        lines.append(cell + " " + " ".join(f"{v:>{w}}" for v, (_, w) in zip(values, COLUMNS[2:])))
    return "\n".join(lines)


LEGEND = """\
step s: one optimizer step (accumulation included), CUDA-synchronised wall clock, median of the timed steps.
vs stock: tokens/s against the cell's stock row (the same batches: the step-time ratio; max rows: at each side's own
  largest micro-batch). tok/s: real (non-padding) tokens of the step's chosen and rejected rows per second.
GPU s: GPU busy per step, the union of the kernel intervals (memcpy/memset excluded; the JSON has the sum too).
launches: CPU-side kernel-launch calls per step; syncs: host synchronisations per step (cudaStream/Device/Event-
  Synchronize and synchronous cudaMemcpy). Both from torch.profiler over the profiled steps (profiled, not timed).
peak GiB: torch.cuda.max_memory_allocated over the timed steps (max rows: over the probe, under the cap).
|dloss|, grad cos: step 0 against stock's on the same batch and weights (sampled estimators: not comparable).
floor dl, floor cos: the shape's noise floor, stock eager against stock SDPA (the shape's `noise` row).
pairs: pairs per micro-batch (x accumulation); max rows: the largest that fit the cap ('+': a bound, time ran out)."""


# ------------------------------------------------------------------------------------------------------ main
def run_row(session: Session, cell: Cell, kind: str, where: dict) -> dict:
    """One row's record: measured, failed (the error's first line) or skipped (the budget: past it, or a row of this
    shape took longer than what is left; a shape not run yet is expected to take the longest row so far)."""
    args = session.args
    durations = session.durations
    expected = args.bisect_budget if cell.largest else durations.get(cell.shape, max(durations.values(), default=0))
    if session.elapsed() > args.budget:
        return dict(where, status="skipped", error=f"budget of {args.budget:.0f}s spent")
    if session.elapsed() + expected > args.budget:
        return dict(where, status="skipped", error=f"budget: {args.budget - session.elapsed():.0f}s left, a "
                    f"{cell.shape} row takes ~{expected:.0f}s")
    if cell.lora and importlib.util.find_spec("peft") is None:
        return dict(where, status="skipped", error="peft is not installed (LoRA rows)")
    started = session.elapsed()
    try:
        r = session.largest(cell, kind) if cell.largest else session.measure(cell, kind)
    except Exception as error:  # noqa: BLE001 - one row failing must not stop the others
        message = f"{type(error).__name__}: {error}".splitlines()[0]
        print(f"[{session.elapsed():5.0f}s] {cell.name} {kind}: ERROR {message}", flush=True)
        traceback.print_exc(limit=4)
        return dict(where, status="error", error=message)
    finally:
        if not cell.largest:
            durations[cell.shape] = session.elapsed() - started
    print(f"[{session.elapsed():5.0f}s] {cell.name} {kind}: {_fmt(r.get('step_s'), '.3f')} s/step, "
          f"{_fmt(r.get('tokens_per_s'), '.0f')} tok/s, peak {_fmt(r.get('peak_gib'), '.1f', 'n/a')} GiB"
          + (f", max {r['max_pairs']} pairs" if "max_pairs" in r else "")
          + (f", cos {r['grad_cos']:.5f}" if "grad_cos" in r else ""), flush=True)
    return dict(where, status="ok", started_s=round(started, 1), row_s=round(session.elapsed() - started, 1), **r)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=380.0,
                        help="seconds: no row starts after this (the rest are listed as skipped)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up optimizer steps per row (step 0 included)")
    parser.add_argument("--steps", type=int, default=5, help="timed optimizer steps per row (the median is kept)")
    parser.add_argument("--profile-steps", type=int, default=1, help="profiled steps per row (0: no profile)")
    parser.add_argument("--cap-gib", type=float, default=80.0, help="memory cap of the largest-micro-batch rows")
    parser.add_argument("--bisect-budget", type=float, default=45.0, help="seconds per largest-micro-batch row")
    parser.add_argument("--rows", default="", help="a regular expression on 'cell/row': run only the rows it matches")
    parser.add_argument("--out", default=os.environ.get("OUT") or "/tmp")
    parser.add_argument("--dry-run", action="store_true", help="tiny model on CPU: checks the script, not the GPU")
    args = parser.parse_args(argv)
    quiet()
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (use --dry-run to check the script on CPU).", file=sys.stderr)
        return 2
    if args.dry_run:
        torch.set_num_threads(1)  # a shared CPU: two threads oversubscribe it (docs/benchmarks.md)
    session = Session(args)
    import datasets
    import transformers

    meta = machine_info(session.device, torch.get_num_threads())
    meta.update(
        check="gpu_check", date=time.strftime("%Y-%m-%d %H:%M:%S %z"), datasets=datasets.__version__,
        peft=importlib.util.find_spec("peft") and __import__("peft").__version__, transformers=transformers.__version__,
        cuda=torch.version.cuda, dry_run=args.dry_run, dtype="fp32" if args.dry_run else "bf16",
        model="tiny (every shape)" if args.dry_run else "Qwen2.5 shapes, random weights", reference="live (LoRA: "
        "adapter off)", args={k: v for k, v in vars(args).items() if k != "out"})
    if session.device == "cuda":
        meta["gpu_memory_gib"] = torch.cuda.get_device_properties(0).total_memory / 2**30
    print("gpu_check:", json.dumps(meta), flush=True)
    os.makedirs(args.out, exist_ok=True)
    rows = [(c, k) for c, k in plan(args.dry_run) if re.search(args.rows, f"{c.name}/{k}")]
    results: list[dict] = []

    def save():
        meta["elapsed_s"] = round(session.elapsed(), 1)
        with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
            json.dump(dict(meta=meta, results=results), f, indent=1)
        with open(os.path.join(args.out, "gpu_check.txt"), "w") as f:
            f.write(f"gpu_check {meta['date']} {meta.get('gpu', 'dry run on CPU')} torch {meta['torch']} "
                    f"transformers {meta['transformers']} trl {meta['trl']} git {meta['git']}\n\n")
            f.write(format_table(results, args.dry_run) + "\n\n" + LEGEND + "\n")

    interrupted = False
    for index, (cell, kind) in enumerate(rows):
        side, pruning, exact = ROWS[kind]
        where = dict(cell=cell.name, row=kind, shape=cell.shape, pairs=cell.micro_pairs(args.dry_run),
                     accum=cell.accum, ckpt=cell.ckpt, lora=cell.lora, data=cell.data, side=side, pruning=pruning,
                     exact=exact)
        if interrupted:
            results.append(dict(where, status="skipped", error="interrupted"))
            continue
        count = len(results)
        try:
            results.append(run_row(session, cell, kind, where))
            if not any(c == cell and ROWS[k][2] for c, k in rows[index + 1:]):  # no later row compares with it
                session.stock_first.pop(cell, None)
            session.free()
            save()
        except KeyboardInterrupt:  # the .sh's timeout: keep what was measured, list the rest as skipped
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # the files are written below whatever comes next
            interrupted = True
            del results[count:]
            results.append(dict(where, status="skipped", error="interrupted"))
    print("\n" + format_table(results, args.dry_run) + "\n\n" + LEGEND)
    from trl_pruned_dpo.seam import attention  # which varlen kernel the packed rows ran, and whether it was refused

    verdicts = {f"{k[0].__name__.strip('_')} {k[2]} heads {k[3]}/{k[4]} dim {k[5]} {k[6]}": "used" if ok else "REFUSED"
                for k, ok in attention._VERIFIED.items()}
    print("varlen kernels:", verdicts or "none checked (the packed rows ran SDPA per segment)")
    meta["varlen_kernels"] = verdicts
    meta["rows"] = dict(collections.Counter(r["status"] for r in results))
    save()
    print(f"\nwrote {args.out}/gpu_check.{{json,txt}} in {session.elapsed():.0f}s ({meta['rows']})")
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
