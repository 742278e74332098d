"""GPU check of the plugin against stock TRL on one CUDA device: one table, one results file (issues 44, 48, 50).

    bash benchmarks/gpu_check.sh            # the device's one command (docs/benchmarks.md, "GPU check")
    bash benchmarks/gpu_check.sh --rest     # the rerun slot: the rows the first run's budget usually cuts
    bash benchmarks/gpu_check.sh --big      # a later lease: the 3B and 7B-LoRA rows alone
    python -m benchmarks.gpu_check --dry-run --warmup 1 --steps 1    # the same rows on a tiny CPU model (CI)
    python -m benchmarks.gpu_check --list --gpu-gib 79.6             # the plan and its skips, nothing run

bf16; Qwen2.5-0.5B/1.5B/3B/7B-shaped models built from their configs (no download; random weights, synthetic pairs:
step times do not depend on the values); a live reference (the policy's copy plus noise, so the loss is not log 2
whatever the log-probs; LoRA cells: the policy with the adapter off); UltraFeedback-shaped lengths
(benchmarks/workload.py's LENGTH_MODELS: median row ~409 tokens, tail truncated at 1024).

Rows, in this order (no row starts past `--budget` seconds; the rest are listed as skipped, so the tail is what a short
lease loses), each against its cell's stock row on the same batches:
  core: 0.5B and 1.5B at 8 pairs x accumulation 4: stock, defaults (the merged step at its default budget),
      merge_off (`step_token_budget=0`: one pass per micro-batch), exact (the exact preset: + prune_common_prefix),
      branch (exact + branch_keep_prob=0.5); prompt groups (4 responses per prompt, all 6 pairs, 12 pairs x 4: stock
      and `group_by_prompt=True`, both fed the same grouped batches); 0.5B and 1.5B at 2 pairs x 16: stock, defaults,
      merge_off
  matrix (issue 48's GPU cells, 0.5B, 8 pairs): fp16 with a GradScaler (fp32 weights, fp16 autocast) and QLoRA-shaped
      (LoRA r16, norms in fp32, q/k/v projections returning their input's dtype as bitsandbytes layers do): stock
      and defaults, each row recording which attention kernel the packed forward ran
  noise: stock with eager attention in the 8x4 cells (the noise floor of two stock kernels); the 1.5B one needs
      ~82 GiB (issue 50), so it is skipped on a GPU with less (an H100), saying so
  compile: torch.compile, then CUDA graphs (mode "reduce-overhead"), on the best exact row measured so far
  extra: 0.5B at 8 pairs x 1 (the 86f03a4 table's cell: stock, defaults, exact, position, prefix), the largest
      micro-batch under `--cap-gib`
  big (`--big` only: past the default budget): 3B with checkpointing (stock, noise, exact), 7B LoRA r16 with
      checkpointing (stock, exact, noise)
Checkpointing (TRL's default) is off below 3B and on for 3B and 7B (memory). Every row of a cell builds its model
from the same seed on the device, checked by a fingerprint of the weights (a sum per parameter) against the cell's
first build.

Each row, one optimizer step as `Trainer._inner_training_loop` drives it on one process: `get_batch_samples` prefetches
the step's `accum` micro-batches (the plugin groups them into merged passes there), `training_step` on each, then
clipping, `optimizer.step`, the scheduler, `zero_grad`:
  - step 0 on the same batch and weights as its cell's stock row: |loss difference| and the cosine and norm ratio of
    the whole gradient against stock's, compared parameter by parameter in chunks in float32 with the dot products
    and norms accumulated in float64 scalars (no full-gradient copy on the device; stock's gradient waits on the host
    in its own dtype); sampled rows (branch, position, prefix) are not comparable and say so; step 0 also records
    which attention kernel each packed forward chose (`attention_kernels`);
  - `--warmup` steps in all (step 0 included), then `--steps` timed steps: CUDA-synchronised wall clock, the median;
  - tokens/s: the real (non-padding) tokens of the step's batches (chosen and rejected rows) over that median;
  - peak allocated memory (torch.cuda.max_memory_allocated, reset after the warm-up, so over the timed steps);
  - then `--profile-steps` steps under torch.profiler (CPU + CUDA activities), each inside a `gpu_check.step` range,
    per step: kernel launches (the CPU-side cudaLaunchKernel / cudaLaunchKernelExC / cuLaunchKernel / cuLaunchKernelEx
    calls inside the ranges), host synchronisations (cudaStreamSynchronize / cudaDeviceSynchronize /
    cudaEventSynchronize calls and the synchronous, non-Async cudaMemcpy* calls inside the ranges; a `.item()` is a
    cudaMemcpyAsync then a cudaStreamSynchronize: counted once), GPU busy time (the union of the GPU kernel intervals:
    time at least one kernel runs; memcpy, memset and user annotations, which span whole ranges, excluded; the sum
    of kernel durations is kept in the JSON too), and the device-to-host copies (GPU-side "Memcpy DtoH" events). The
    profiler slows the step: its wall is kept in the JSON apart from the timed median.

A row measured is never lost: it is appended, then both files are written (a temporary file, then `os.replace`), and
only then are its trainer and model freed. SIGINT and SIGTERM (the .sh's timeout) set a flag, checked between steps
and between rows: the row in flight ends as `interrupted`, the rest are listed as skipped and the table is written.
A second signal stops at once (what was written stays). A row that fails prints its whole traceback and keeps it in
its JSON record.

Results go to `--out` (default `$OUT`, where the device machine hands files back, else ./out/gpu_check): the printed
table, gpu_check.txt (the table and its legend) and gpu_check.json (the raw rows; torch/transformers/trl/peft
versions, the device and its memory, the date, the git commit or `$GPU_CHECK_COMMIT`). `--dry-run` runs every row kind
on the tiny CPU model in fp32 (every shape is that model, so 1.5B's rows and the 2 x 16 cell, 0.5B's 8 x 4 again,
are left out; 2 pairs where the GPU has 8, accumulation at most 4, 2 for prompt groups; one torch thread; the
profiler's CPU activity only, so the GPU-only columns read n/a; fp16 runs as fp32 there, torch.compile with its
"eager" backend, the largest-micro-batch bisection with a stand-in cap of 4 pairs): it checks the script, its numbers
mean nothing.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import copy
import gc
import importlib.metadata
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
from contextlib import contextmanager
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the device machine has no network: never wait on a hub call

import torch  # noqa: E402

from benchmarks.workload import Workload, build_model, build_trainer, machine_info, quiet  # noqa: E402

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
    "defaults": ("pruned", {}, True),  # with accumulation: the merged step at its default budget
    "merge_off": ("pruned", dict(step_token_budget=0), True),  # one packed pass per micro-batch
    "exact": ("pruned", EXACT_PRESET, True),
    "branch": ("pruned", dict(EXACT_PRESET, branch_keep_prob=0.5), False),
    "position": ("pruned", dict(EXACT_PRESET, position_keep_prob=0.5), False),
    "prefix": ("pruned", dict(EXACT_PRESET, prefix_prune_prob=0.5), False),
    "groups": ("pruned", dict(group_by_prompt=True), True),
    "compile": ("pruned", None, True),  # None: the best exact row's fields (`best_row`), its model torch.compile'd
    "cudagraphs": ("pruned", None, True),  # the same, mode="reduce-overhead" (CUDA graphs)
}
ROW_KINDS = tuple(ROWS)
COMPILE_MODES = {"compile": "default", "cudagraphs": "reduce-overhead"}
COMPILE_RECOMPILES = 4  # per compiled layer; past it dynamo runs the layer eagerly (and the row says how it did)
# Rows known to need more GPU memory than some cards have (GiB, total device memory): skipped there, saying so.
# 1.5B eager at 8 pairs: issue 50's ~82 GiB (0.5B eager measured 49.9 GiB against SDPA's 25.8 on the H200).
NEEDS_GIB = {("1.5B", "noise"): 82.0}
DRY_PAIRS = 2  # a dry run's pairs per micro-batch where the GPU's is 8
DRY_MAX_ACCUM = 4  # a dry run's accumulation at most (2 x 16 runs as 2 x 4 there)
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
    precision: str = "bf16"  # "fp16": fp32 weights, fp16 autocast and a GradScaler (the Trainer's fp16=True)
    qlora_norms: bool = False  # QLoRA-shaped: norms in fp32, q/k/v projections return their input's dtype

    @property
    def name(self) -> str:
        parts = [self.shape] + ([f"LoRA{self.lora}"] if self.lora else []) + ["UF"]
        parts += ["k4-all"] if self.data == "k4-all" else []
        parts += [f"{self.pairs}x{self.accum}"] if self.accum > 1 else []
        parts += ["max"] if self.largest else []
        parts += ["ckpt"] if self.ckpt else []
        parts += ["fp16"] if self.precision == "fp16" else []
        parts += ["qlora-norms"] if self.qlora_norms else []
        return " ".join(parts)

    def micro_pairs(self, dry: bool) -> int:
        return self.pairs if not dry or self.data == "k4-all" else DRY_PAIRS

    def micro_batches(self, dry: bool) -> int:
        if dry and self.data == "k4-all":  # its 12-pair micro-batches are the dry run's slowest
            return min(self.accum, 2)
        return min(self.accum, DRY_MAX_ACCUM) if dry else self.accum

    def workload(self, dry: bool, pairs: int | None = None) -> Workload:
        vocab = (8192 if self.data == "k4-all" else 512) if dry else VOCABS[self.shape]
        return Workload(vocab_size=vocab, batch_size=pairs or self.micro_pairs(dry),
                        num_batches=1 if pairs else max(2, self.micro_batches(dry)),
                        model_shape=TINY if dry else QWEN25[self.shape], name=self.data, lengths="ultrafeedback",
                        length_scale=0.05 if dry else 1.0, reference_noise=0.01)


@dataclass(frozen=True)
class Planned:
    """One row of the plan: its cell, its kind (a key of ROWS) and its part (core, matrix, noise, compile, extra,
    big)."""

    cell: Cell
    kind: str
    part: str


# `--rest`: what the first run's budget usually cuts (1.5B at 2 x 16, the matrix, the noise floors, compile), with the
# stock rows the noise floors compare with and one plugin row for compile to start from: the rerun slot's command
# when the first run ended well.
REST_ROWS = r"^(core/(0\.5B|1\.5B) UF 8x4/stock|core/0\.5B UF 8x4/defaults|core/1\.5B UF 2x16/|matrix/|noise/|compile/)"
PARTS = ("core", "matrix", "noise", "compile", "extra")  # the default run, in this order; "big" with --big only


def plan(dry: bool, big: bool = False) -> list[Planned]:
    """The rows, most informative first: the budget cuts the tail."""
    rows: list[Planned] = []

    def add(cell, kinds, part):
        rows.extend(Planned(cell, k, part) for k in kinds)

    if big:
        add(Cell("3B", ckpt=True), ("stock", "noise", "exact"), "big")
        add(Cell("7B", ckpt=True, lora=8 if dry else 16), ("stock", "exact", "noise"), "big")
    else:
        for shape in ("0.5B", "1.5B"):
            add(Cell(shape, accum=4), ("stock", "defaults", "merge_off", "exact", "branch"), "core")
        add(Cell("0.5B", pairs=12, accum=4, data="k4-all"), ("stock", "groups"), "core")
        for shape in ("0.5B", "1.5B"):
            add(Cell(shape, pairs=2, accum=16), ("stock", "defaults", "merge_off"), "core")
        add(Cell("0.5B", precision="fp16"), ("stock", "defaults"), "matrix")
        add(Cell("0.5B", lora=8 if dry else 16, qlora_norms=True), ("stock", "defaults"), "matrix")
        for shape in ("0.5B", "1.5B"):
            add(Cell(shape, accum=4), ("noise",), "noise")
        add(None, ("compile", "cudagraphs"), "compile")  # the cell: the best row's, chosen when they come
        add(Cell("0.5B"), ("stock", "defaults", "exact", "position", "prefix"), "extra")
        add(Cell("0.5B", largest=True), ("stock", "exact"), "extra")
    if dry:  # the tiny model stands for every shape, 2 pairs for 8 and accumulation 4 for 16: 1.5B's rows and the
        # 2 x 16 cell would run the 0.5B 8 x 4 rows again
        rows = [r for r in rows if r.cell is None or (r.cell.shape != "1.5B" and r.cell.accum != 16)]
    return rows


# ----------------------------------------------------------------------------------------------------- the step
class Interrupted(Exception):
    """Raised between steps once SIGINT or SIGTERM has set the interrupt flag (never inside a destructor)."""


class InterruptFlag:
    """SIGINT and SIGTERM set a flag instead of raising wherever Python happens to be (a `Dataset.__del__` once lost
    the final table that way): `check` raises `Interrupted` between steps, the main loop reads `signal` between
    rows. A second signal raises KeyboardInterrupt at once: the files written after the last row stay."""

    def __init__(self):
        self.signal: str | None = None
        self.previous: dict = {}

    def install(self) -> None:
        for number in (signal.SIGINT, signal.SIGTERM):
            self.previous[number] = signal.signal(number, self._set)

    def hold(self) -> None:
        """Ignore both signals while the last files are written."""
        for number in (signal.SIGINT, signal.SIGTERM):
            signal.signal(number, signal.SIG_IGN)

    def restore(self) -> None:
        for number, handler in self.previous.items():
            signal.signal(number, handler)

    def _set(self, number, frame) -> None:
        if self.signal is not None:
            raise KeyboardInterrupt
        self.signal = signal.Signals(number).name
        print(f"gpu_check: {self.signal}: stopping at the next step; the table is written on exit", flush=True)

    def check(self) -> None:
        if self.signal is not None:
            raise Interrupted(self.signal)


class Runner:
    """One trainer driven optimizer step by optimizer step as `Trainer._inner_training_loop` drives it on one process:
    `get_batch_samples` prefetches the step's `accum` micro-batches from the trainer's own dataloader (where the
    plugin groups them into merged passes), `training_step` on each (each loss scaled by 1 / accum, as transformers
    does), then gradient clipping, `optimizer.step`, the scheduler, `zero_grad`. `check` runs before each step."""

    def __init__(self, trainer, accum: int = 1, check=None):
        self.trainer, self.accum, self.check = trainer, accum, check
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
        self._batches = self._forever()

    def _forever(self):
        while True:  # one epoch per pass over the loader; the same seeded order on every row of a cell
            yield from self.loader

    def step(self, before_clip=None):
        """One optimizer step; returns (the step's loss, a device tensor; its micro-batches). `before_clip(loss,
        model)` sees the accumulated gradient before clipping changes it."""
        if self.check is not None:
            self.check()
        t = self.trainer
        batches, num_items = t.get_batch_samples(self._batches, self.accum, t.args.device)
        t.current_gradient_accumulation_steps = len(batches)
        loss = None
        for batch in batches:
            part = t.training_step(self.model, batch, num_items)
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


def _gpu_kind(event, annotations=frozenset()) -> str:
    """kernel, memcpy, memset or other, for a GPU-side profiler event. A user annotation (a `record_function` range,
    ours or the libraries', mirrored on the GPU's timeline over whole forwards) is never a kernel: by the event's
    `is_user_annotation`, its activity type where torch gives one, else by its name being a CPU-side range's."""
    if getattr(event, "is_user_annotation", False):
        return "other"
    kind = getattr(event, "activity_type", None)
    if kind:
        return {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}.get(str(kind), "other")
    if event.name == STEP_MARK or event.name in annotations or "Sync" in event.name:
        return "other"
    return "memcpy" if event.name.startswith("Memcpy") else "memset" if event.name.startswith("Memset") else "kernel"


def count_events(events, steps: int) -> dict:
    """Per step, from a profile of `steps` steps each inside a STEP_MARK range: see the module's docstring."""
    from torch.autograd import DeviceType

    ranges = sorted((e.time_range.start, e.time_range.end) for e in events
                    if e.name == STEP_MARK and e.device_type == DeviceType.CPU)
    annotations = frozenset(e.name for e in events if e.device_type == DeviceType.CPU and (
        getattr(e, "is_user_annotation", False) or str(getattr(e, "activity_type", None)) == "user_annotation"))
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
            kind = _gpu_kind(e, annotations)
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
@contextmanager
def recording_kernels():
    """Counts, for each packed attention call, the kernel the plugin chose (`seam.kernels._choose`: the kernel, or
    None for SDPA per segment, and why; named here with the query's dtype). The counter wraps the chooser for the
    duration only; a test pins the name."""
    from trl_pruned_dpo.seam import kernels

    counts: collections.Counter = collections.Counter()
    choose = getattr(kernels, "_choose", None)
    if choose is None:  # the chooser renamed: `logged_kernel` (the plugin's own name) is then the record
        counts["kernel chooser not found"] = 0
        yield counts
        return

    def counting(q, *args, **kwargs):
        chosen = choose(q, *args, **kwargs)
        kernel = chosen[0]
        name = kernel.__name__.strip("_") if kernel is not None else "sdpa_per_segment"
        counts[f"{name} {str(q.dtype).replace('torch.', '')}"] += 1
        return chosen

    kernels._choose = counting
    try:
        yield counts
    finally:
        kernels._choose = choose


def logged_kernel(trainer) -> str | None:
    """The attention kernel the plugin names for its packed rows at their first packed forward
    (`trainer.forward_choice.kernel`: "torch varlen_attn", "flash_attn varlen", "SDPA per segment", ...); None for
    stock, or before the first packed forward. The rows' `attention_kernels` (counted by `recording_kernels`) stay the
    independent record."""
    choice = getattr(trainer, "forward_choice", None)
    return getattr(choice, "kernel", None)


def qlora_shaped(model) -> None:
    """QLoRA's dtypes without bitsandbytes: norms cast to fp32 (as `prepare_model_for_kbit_training` does) and the
    q/k/v projections returning their input's dtype (as bitsandbytes' 4-bit layers do), so that queries reach the
    attention in fp32 (PITFALLS.md, "What GPU users' setups do")."""
    for name, module in model.named_modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.float()
        if name.endswith(("q_proj", "k_proj", "v_proj")):
            module.register_forward_hook(lambda _module, inputs, out: out.to(inputs[0].dtype))


def compile_models(trainer, mode: str, dry: bool) -> dict:
    """torch.compile each decoder layer of the policy and the reference in place (regional compilation: one layer's
    code compiled once serves every layer; TRL's fused head and the plugin's host planning stay eager), at most
    COMPILE_RECOMPILES recompilations per layer before dynamo runs it eagerly (the packed metadata's sizes change per
    batch). A dry run uses dynamo's "eager" backend (no C++ compiler on CPU, and fast): it checks the plumbing only."""
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit"):  # the newer name, and the older one torch still reads
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, COMPILE_RECOMPILES)
    options = dict(backend="eager") if dry else dict(mode=mode)
    layers = 0
    for model in (trainer.model, getattr(trainer, "ref_model", None)):
        for module in model.modules() if model is not None else ():
            if type(module).__name__.endswith("DecoderLayer"):
                module.compile(**options)
                layers += 1
    if not layers:
        raise RuntimeError("no decoder layer found to compile")
    return dict(compile_mode="eager backend (dry run)" if dry else mode, compiled_layers=layers,
                compile_recompile_limit=COMPILE_RECOMPILES)


class Session:
    """What rows share: arguments, device, the cells' stock first steps, the weights' fingerprints, the interrupt
    flag, and the objects of the row just measured (freed only after its record is written)."""

    def __init__(self, args, interrupt: InterruptFlag | None = None):
        self.args = args
        self.dry = args.dry_run
        self.device = "cpu" if self.dry or not torch.cuda.is_available() else "cuda"
        self.stock_first: dict = {}  # cell -> (loss, host gradient) of its stock row's step 0
        self.fingerprints: dict = {}  # workload -> the weights' fingerprint at the first build
        self.durations: dict = {}  # shape -> seconds its last row took (a row that would end past the budget waits)
        self.cells: dict = {}  # cell name -> Cell, for the compile rows' choice of the best row
        self.interrupt = interrupt or InterruptFlag()
        self.held: list = []
        self.started = time.time()
        self.total_gib = (torch.cuda.get_device_properties(0).total_memory / 2**30 if self.device == "cuda"
                          else args.gpu_gib)

    def elapsed(self) -> float:
        return time.time() - self.started

    def dtype(self, cell: Cell):
        """The weights' dtype: bf16 on the GPU, fp32 for the fp16 cell (autocast and a scaler) and in a dry run."""
        return torch.float32 if self.dry or cell.precision == "fp16" else torch.bfloat16

    def dataset(self, cell: Cell, w: Workload):
        if cell.data != "k4-all":
            return None
        from datasets import Dataset

        from benchmarks.prompt_groups import group_rows

        groups = w.batch_size // 6 * w.num_batches
        return Dataset.from_dict(group_rows(4, "all", groups, w.length_scale, random.Random(4)))

    def models(self, cell: Cell, w: Workload, attn: str):
        """The policy (random weights from the workload's seed, built on the device) and its live reference (a copy
        plus N(0, noise^2), drawn on the device from a fixed seed), the same on every row of a cell: checked by a
        fingerprint of the weights (a sum per parameter) against the first build of this workload."""
        model = build_model(w, self.dtype(cell), attn=attn, device=self.device)
        with torch.no_grad():
            fingerprint = torch.stack([p.sum(dtype=torch.float64) for p in model.parameters()]).cpu()
        key = (w.vocab_size, tuple(sorted(w.model_shape.items())), w.max_row(), w.seed, self.dtype(cell))
        known = self.fingerprints.setdefault(key, fingerprint)
        if not torch.equal(known, fingerprint):
            raise RuntimeError("the model's weights differ from the first build of the same workload (a "
                               "non-deterministic initialisation): no agreement with stock would mean anything")
        if cell.qlora_norms:
            qlora_shaped(model)
        if cell.lora:
            return model, None
        ref = copy.deepcopy(model)
        generator = torch.Generator(device=self.device).manual_seed(w.seed + 1)
        with torch.no_grad():
            for p in ref.parameters():
                p.add_(torch.randn(p.shape, generator=generator, device=self.device, dtype=p.dtype) * w.reference_noise)
        return model, ref

    def trainer(self, cell: Cell, kind: str, w: Workload, pruning: dict | None = None):
        side, fields, _ = ROWS[kind]
        pruning = fields if pruning is None else pruning
        model, ref = self.models(cell, w, "eager" if kind == "noise" else "sdpa")
        torch.manual_seed(w.seed)  # a LoRA adapter's initialisation: the same on every row of the cell
        training = dict(gradient_accumulation_steps=cell.micro_batches(self.dry))  # the merged step reads it
        if cell.precision == "fp16" and not self.dry:
            training.update(fp16=True, bf16=False)
        trainer = build_trainer(side, w, model, precompute=False, checkpointing=cell.ckpt, pruning=pruning,
                                device=self.device, bf16=not self.dry, ref_model=ref, dataset=self.dataset(cell, w),
                                lora_r=cell.lora, training=training)
        if cell.data == "k4-all" and side == "stock":  # stock sees the grouped batches the plugin's sampler makes
            from trl_pruned_dpo.sampler import PromptGroupSampler, prompt_groups_of

            seed = trainer.args.data_seed if trainer.args.data_seed is not None else trainer.args.seed
            trainer._get_train_sampler = lambda *a, _t=trainer, **k: PromptGroupSampler(
                prompt_groups_of(_t.train_dataset["prompt_ids"]), _t._train_batch_size, seed)
        if side == "pruned" and not trainer.forward_choice.packed:
            raise RuntimeError("the packed path fell back to padded rows (see the warning above)")
        return trainer

    def measure(self, cell: Cell, kind: str, pruning: dict | None = None, compile_mode: str | None = None) -> dict:
        """A timed row: agreement of step 0 (and the attention kernels it ran), then warm-up, timed steps and a
        profile (the module's docstring). The trainer stays held until the caller has written the record."""
        args, device = self.args, self.device
        _, _, exact = ROWS[kind]
        w = cell.workload(self.dry)
        trainer = self.trainer(cell, kind, w, pruning)
        row: dict = {}
        if compile_mode is not None:
            row.update(compile_models(trainer, compile_mode, self.dry))
        runner = Runner(trainer, cell.micro_batches(self.dry), check=self.interrupt.check)
        self.held[:] = [trainer, runner]

        def first_step(loss, model):
            if kind == "stock":
                self.stock_first[cell] = (float(loss), host_gradient(model))
            elif exact and cell in self.stock_first:
                stock_loss, stock_grad = self.stock_first[cell]
                row.update(loss_diff=abs(float(loss) - stock_loss), **gradient_agreement(model, stock_grad))

        with recording_kernels() as kernels:
            runner.step(before_clip=first_step)
        row.update(attention_kernels=dict(kernels), logged_kernel=logged_kernel(trainer))
        for _ in range(args.warmup - 1 + (2 if compile_mode else 0)):  # CUDA graphs record on a shape's 2nd run
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
        stats = getattr(trainer, "last_prune_stats", None) or {}
        row.update(step_s=step_s, step_times=times, real_tokens=statistics.mean(tokens),
                   tokens_per_s=statistics.mean(tokens) / step_s,
                   peak_gib=torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
                   padded_tokens=float(sum(b["input_ids"].numel() for b in batches)),
                   executed=stats.get("policy_tokens_executed") if isinstance(stats, dict) else None)
        scaler = getattr(trainer.accelerator, "scaler", None)
        if scaler is not None:  # fp16: the loss scale after the timed steps (it drops on each skipped step)
            row["grad_scale"] = float(scaler.get_scale())
        if args.profile_steps > 0:
            row.update(profile_steps(runner, device, args.profile_steps))
        return row

    def release(self, compiled: bool = False) -> None:
        """Drop the row's trainer and model (after its record is written), then free the device's cache; after a
        compiled row also dynamo's caches (CUDA graphs keep their memory pool while their functions live)."""
        self.held.clear()
        if compiled:
            import torch._dynamo

            torch._dynamo.reset()
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
COLUMNS = (("cell", 26), ("row", 10), ("pairs", 6), ("step s", 7), ("vs stock", 8), ("tok/s", 8), ("GPU s", 7),
           ("busy%", 5), ("launches", 8), ("syncs", 6), ("peak GiB", 8), ("kernel", 8), ("|dloss|", 8),
           ("grad cos", 8), ("floor dl", 8), ("floor cos", 9))
KERNEL_SHORT = {"torch_varlen": "varlen", "flash_attn_varlen": "flash", "sdpa_per_segment": "sdpa-seg"}


def _fmt(value, spec: str, na: str = "-") -> str:
    return na if value is None else format(value, spec)


def kernel_label(row: dict) -> str:
    """The attention kernel(s) the row's packed forwards ran, short ("varlen", "sdpa-seg", "varlen+sdpa-seg"; "-"
    for stock), from the plugin's own log where it has one (`logged_kernel`), else the counts."""
    if row.get("logged_kernel"):
        return str(row["logged_kernel"])[:8]
    names = sorted({KERNEL_SHORT.get(k.split()[0], k.split()[0]) for k, n in (row.get("attention_kernels") or {}).items()
                    if n})
    return "+".join(names) or "-"


def format_table(results: list[dict], dry: bool) -> str:
    head = " ".join(f"{name:<{w}}" if i < 3 else f"{name:>{w}}" for i, (name, w) in enumerate(COLUMNS))
    lines = [head, "-" * len(head)]
    floors = {(r["shape"], r["lora"]): r for r in results if r["row"] == "noise" and "grad_cos" in r}
    gpu_na = "n/a" if dry else "-"
    for r in results:
        cell = f"{r['cell']:<26} {r['row']:<10}"
        if r["status"] != "ok":
            lines.append(f"{cell} {r['status'].upper()}: {r.get('error', '')[:110]}")
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
        busy = 100 * r["gpu_busy_s"] / r["step_s"] if not dry and r.get("gpu_busy_s") and r.get("step_s") else None
        values = (pairs, _fmt(r.get("step_s"), ".3f"), vs, _fmt(r.get("tokens_per_s"), ".0f"),
                  _fmt(r.get("gpu_busy_s") if not dry else None, ".3f", gpu_na if profiled else "-"),
                  _fmt(busy, ".0f", gpu_na if profiled else "-"),
                  _fmt(r.get("launches") if not dry else None, ".0f", gpu_na if profiled else "-"),
                  _fmt(r.get("syncs") if not dry else None, ".0f", gpu_na if profiled else "-"),
                  _fmt(r.get("peak_gib"), ".2f", gpu_na), kernel_label(r), agree[0], agree[1], *floor_cols)
        lines.append(cell + " " + " ".join(f"{v:>{w}}" for v, (_, w) in zip(values, COLUMNS[2:])))
    return "\n".join(lines)


LEGEND = """\
step s: one optimizer step (accumulation included), CUDA-synchronised wall clock, median of the timed steps.
vs stock: tokens/s against the cell's stock row (the same batches: the step-time ratio; max rows: at each side's own
  largest micro-batch; compile rows: against uncompiled stock). tok/s: real (non-padding) tokens of the step's
  chosen and rejected rows per second.
GPU s: GPU busy per step, the union of the kernel intervals (memcpy/memset and user annotations excluded; the JSON has
  the sum too). busy%: GPU s over the step's median wall. launches: CPU-side kernel-launch calls per step; syncs:
  host synchronisations per step (cudaStream/Device/EventSynchronize and synchronous cudaMemcpy). All three from
  torch.profiler over the profiled steps (profiled, not timed).
peak GiB: torch.cuda.max_memory_allocated over the timed steps (max rows: over the probe, under the cap).
kernel: the attention kernel of the row's packed forwards at step 0 (varlen: torch's varlen_attn, flash:
  flash_attn's, sdpa-seg: SDPA per segment, where no varlen kernel was chosen or verified; -: stock).
|dloss|, grad cos: step 0 against stock's on the same batch and weights (sampled estimators: not comparable).
floor dl, floor cos: the shape's noise floor, stock eager against stock SDPA (the shape's `noise` row).
pairs: pairs per micro-batch (x accumulation); max rows: the largest that fit the cap ('+': a bound, time ran out)."""


# ------------------------------------------------------------------------------------------------------ main
def memory_skip(session: Session, cell: Cell, kind: str) -> str | None:
    """Why a row cannot fit this GPU's total memory (NEEDS_GIB), or None."""
    need = NEEDS_GIB.get((cell.shape, kind))
    if need is None or session.dry or session.total_gib is None or session.total_gib >= need:
        return None
    return (f"needs ~{need:g} GiB (issue 50's estimate), this GPU has {session.total_gib:.1f} GiB: skipped here; "
            "it runs on an H200")


def best_row(results: list[dict], cells: dict) -> tuple[Cell, str] | None:
    """The exact plugin row with the best speed-up over its cell's stock so far (the compile rows' base)."""
    best, found = 0.0, None
    for r in results:
        if r["status"] != "ok" or r["side"] != "pruned" or not r["exact"] or r["row"] in COMPILE_MODES \
                or r.get("max_pairs") is not None or r["cell"] not in cells:
            continue
        stock = next((x for x in results if x["cell"] == r["cell"] and x["row"] == "stock" and x["status"] == "ok"),
                     None)
        if stock and r.get("tokens_per_s") and stock.get("tokens_per_s"):
            ratio = r["tokens_per_s"] / stock["tokens_per_s"]
            if ratio > best:
                best, found = ratio, (cells[r["cell"]], r["row"])
    return found


def run_row(session: Session, cell: Cell, kind: str, where: dict, base_kind: str | None = None) -> dict:
    """One row's record: measured, failed (the error's first line, its whole traceback printed and kept), skipped
    (the budget: past it, or a row of this shape took longer than what is left, a shape not run yet expected to take
    the longest row so far; memory; peft missing) or interrupted (a signal between its steps)."""
    args = session.args
    durations = session.durations
    expected = args.bisect_budget if cell.largest else durations.get(cell.shape, max(durations.values(), default=0))
    if kind in COMPILE_MODES:
        expected = max(expected, args.compile_budget)
    if session.elapsed() > args.budget:
        return dict(where, status="skipped", error=f"budget of {args.budget:.0f}s spent")
    if session.elapsed() + expected > args.budget:
        return dict(where, status="skipped", error=f"budget: {args.budget - session.elapsed():.0f}s left, a "
                    f"{cell.shape} row takes ~{expected:.0f}s")
    why = memory_skip(session, cell, kind)
    if why is not None:
        print(f"[{session.elapsed():5.0f}s] {cell.name} {kind}: SKIPPED, {why}", flush=True)
        return dict(where, status="skipped", error=why)
    if cell.lora and importlib.util.find_spec("peft") is None:
        return dict(where, status="skipped", error="peft is not installed (LoRA rows)")
    session.cells[cell.name] = cell
    started = session.elapsed()
    try:
        if cell.largest:
            r = session.largest(cell, kind)
        elif kind in COMPILE_MODES:
            r = session.measure(cell, kind, pruning=ROWS[base_kind][1], compile_mode=COMPILE_MODES[kind])
        else:
            r = session.measure(cell, kind)
    except Interrupted as signalled:
        print(f"[{session.elapsed():5.0f}s] {cell.name} {kind}: interrupted ({signalled})", flush=True)
        return dict(where, status="interrupted", error=f"{signalled} between its steps")
    except Exception as error:  # noqa: BLE001 - one row failing must not stop the others
        message = f"{type(error).__name__}: {error}".splitlines()[0]
        whole = traceback.format_exc()
        print(f"[{session.elapsed():5.0f}s] {cell.name} {kind}: ERROR {message}\n{whole}", flush=True)
        return dict(where, status="error", error=message, traceback=whole)
    finally:
        if not cell.largest:
            durations[cell.shape] = session.elapsed() - started
    print(f"[{session.elapsed():5.0f}s] {cell.name} {kind}: {_fmt(r.get('step_s'), '.3f')} s/step, "
          f"{_fmt(r.get('tokens_per_s'), '.0f')} tok/s, peak {_fmt(r.get('peak_gib'), '.1f', 'n/a')} GiB"
          + (f", max {r['max_pairs']} pairs" if "max_pairs" in r else "")
          + (f", cos {r['grad_cos']:.5f}" if "grad_cos" in r else "")
          + (f", kernels {r['attention_kernels']}" if r.get("attention_kernels") else ""), flush=True)
    return dict(where, status="ok", started_s=round(started, 1), row_s=round(session.elapsed() - started, 1), **r)


def write_atomically(path: str, text: str) -> None:
    """The whole file or the previous one, never half of one (a signal or a kill mid-write)."""
    partial = f"{path}.partial"
    with open(partial, "w") as f:
        f.write(text)
    os.replace(partial, path)


def describe_plan(rows: list[Planned], session: Session) -> str:
    """The plan, one line per row, with what is known before running: memory skips, missing peft."""
    lines = []
    for r in rows:
        name = r.cell.name if r.cell is not None else "(the best exact row)"
        note = (memory_skip(session, r.cell, r.kind) if r.cell is not None else None) or (
            "peft missing: skipped" if r.cell is not None and r.cell.lora and importlib.util.find_spec("peft") is None
            else "")
        lines.append(f"  {r.part:<8} {name:<26} {r.kind:<10} {note}".rstrip())
    return "\n".join(lines)


def version_of(name: str) -> str | None:
    """A distribution's version without importing it (peft is imported only by the rows that need it)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def default_out() -> str:
    """$OUT, where the device machine hands files back; else a local folder (ignored by git)."""
    return os.environ.get("OUT") or os.path.join("out", "gpu_check")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=270.0,
                        help="seconds: no row starts after this (the rest are listed as skipped)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up optimizer steps per row (step 0 included)")
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps per row (the median is kept)")
    parser.add_argument("--profile-steps", type=int, default=1, help="profiled steps per row (0: no profile)")
    parser.add_argument("--cap-gib", type=float, default=80.0, help="memory cap of the largest-micro-batch rows")
    parser.add_argument("--bisect-budget", type=float, default=45.0, help="seconds per largest-micro-batch row")
    parser.add_argument("--compile-budget", type=float, default=60.0,
                        help="seconds a compile row is expected to take (it starts only with this much budget left)")
    parser.add_argument("--rows", default="", help="a regular expression on 'part/cell/row': run only the rows it "
                        "matches (the compile rows' cell is chosen when they come)")
    parser.add_argument("--big", action="store_true", help="the 3B and 7B-LoRA rows alone (a later lease)")
    parser.add_argument("--rest", action="store_true", help=f"the rows the first run's budget usually cuts (--rows "
                        f"{REST_ROWS!r}); files gpu_check_rest.*")
    parser.add_argument("--gpu-gib", type=float, default=None,
                        help="without a GPU (--list, --dry-run): the total GPU memory to plan the skips for")
    parser.add_argument("--out", default=default_out())
    parser.add_argument("--list", action="store_true", help="print the plan and its skips, run nothing")
    parser.add_argument("--dry-run", action="store_true", help="tiny model on CPU: checks the script, not the GPU")
    args = parser.parse_args(argv)
    if args.rest:
        args.rows = REST_ROWS
    quiet()
    import datasets
    import transformers

    import trl_pruned_dpo  # noqa: F401 - fail here, before any row, when the plugin does not import

    interrupt = InterruptFlag()
    session = Session(args, interrupt)
    rows = [r for r in plan(args.dry_run, args.big)
            if re.search(args.rows, f"{r.part}/{r.cell.name if r.cell is not None else 'best'}/{r.kind}")]
    gib = f"{session.total_gib:.1f} GiB" if session.total_gib is not None else "unknown memory"
    print(f"gpu_check: {len(rows)} rows planned for {session.device} ({gib}), budget {args.budget:.0f}s:\n"
          + describe_plan(rows, session), flush=True)
    if args.list:
        return 0
    if not args.dry_run and session.device != "cuda":
        print("gpu_check: no CUDA device (use --dry-run to check the script on CPU).", file=sys.stderr)
        return 2
    if args.dry_run:
        torch.set_num_threads(1)  # a shared CPU: two threads oversubscribe it (docs/benchmarks.md)
    interrupt.install()
    meta = machine_info(session.device, torch.get_num_threads())
    given = os.environ.get("GPU_CHECK_COMMIT")
    if given:  # the device's copy of the tree has no .git: the command names the commit it carries
        meta.update(commit_given=given, git=given if meta["git"].startswith("unknown") else meta["git"])
    meta.update(
        check="gpu_check", date=time.strftime("%Y-%m-%d %H:%M:%S %z"), datasets=datasets.__version__,
        peft=version_of("peft"), transformers=transformers.__version__, cuda=torch.version.cuda,
        dry_run=args.dry_run, dtype="fp32" if args.dry_run else "bf16 (the fp16 cell: fp16 autocast)",
        model="tiny (every shape)" if args.dry_run else "Qwen2.5 shapes, random weights",
        reference="live (LoRA: adapter off)", hf_hub_offline=os.environ.get("HF_HUB_OFFLINE"),
        gpu_memory_gib=session.total_gib, args={k: v for k, v in vars(args).items() if k != "out"})
    print("gpu_check:", json.dumps(meta), flush=True)
    os.makedirs(args.out, exist_ok=True)
    results: list[dict] = []
    stem = "gpu_check_big" if args.big else "gpu_check_rest" if args.rest else "gpu_check"  # beside the first's

    def save():
        meta["elapsed_s"] = round(session.elapsed(), 1)
        write_atomically(os.path.join(args.out, f"{stem}.json"), json.dumps(dict(meta=meta, results=results),
                                                                            indent=1))
        write_atomically(os.path.join(args.out, f"{stem}.txt"),
                         f"gpu_check {meta['date']} {meta.get('gpu', 'dry run on CPU')} torch {meta['torch']} "
                         f"transformers {meta['transformers']} trl {meta['trl']} git {meta['git']}\n\n"
                         + format_table(results, args.dry_run) + "\n\n" + LEGEND + "\n")

    stopped = None  # why the remaining rows are skipped (a signal)
    try:
        for index, planned in enumerate(rows):
            cell, kind, base_kind = planned.cell, planned.kind, None
            if cell is None:  # a compile row: the best exact row measured so far
                chosen = best_row(results, session.cells)
                if chosen is None:
                    results.append(dict(cell="(best row)", row=kind, part=planned.part, shape="-", pairs=0, accum=1,
                                        ckpt=False, lora=0, data="-", side="pruned", pruning=None, exact=True,
                                        status="skipped", error="no exact plugin row measured to compile"))
                    continue
                cell, base_kind = chosen
            side, pruning, exact = ROWS[kind]
            where = dict(cell=cell.name, row=kind, part=planned.part, shape=cell.shape,
                         pairs=cell.micro_pairs(args.dry_run), accum=cell.micro_batches(args.dry_run), ckpt=cell.ckpt,
                         lora=cell.lora, data=cell.data, precision="fp32" if args.dry_run else cell.precision,
                         qlora_norms=cell.qlora_norms, side=side,
                         pruning=ROWS[base_kind][1] if base_kind else pruning, exact=exact)
            if base_kind:
                where["compiled_row"] = base_kind
            if stopped or interrupt.signal:
                stopped = stopped or f"interrupted ({interrupt.signal})"
                results.append(dict(where, status="skipped", error=stopped))
                continue
            record = run_row(session, cell, kind, where, base_kind)
            if base_kind:  # against the same row uncompiled
                plain = next((r for r in results if r["cell"] == cell.name and r["row"] == base_kind
                              and r["status"] == "ok"), None)
                if plain and record.get("step_s"):
                    record["vs_uncompiled"] = plain["step_s"] / record["step_s"]
            results.append(record)  # appended and written before the row's trainer is freed
            later = [r for r in rows[index + 1:] if r.cell == cell and ROWS[r.kind][2]]
            if not later:  # no later row compares with this cell's stock
                session.stock_first.pop(cell, None)
            save()
            session.release(compiled=kind in COMPILE_MODES)
    except KeyboardInterrupt:  # a second signal: stop now, keep what was written
        stopped = "stopped by a second signal"
    finally:
        interrupt.hold()  # the files are written below whatever comes next
        done = {(r["cell"], r["row"]) for r in results}
        for planned in rows[len(results):]:
            if planned.cell is not None and (planned.cell.name, planned.kind) not in done:
                results.append(dict(cell=planned.cell.name, row=planned.kind, part=planned.part,
                                    shape=planned.cell.shape, pairs=planned.cell.micro_pairs(args.dry_run),
                                    accum=planned.cell.micro_batches(args.dry_run), ckpt=planned.cell.ckpt,
                                    lora=planned.cell.lora, data=planned.cell.data, side=ROWS[planned.kind][0],
                                    pruning=ROWS[planned.kind][1], exact=ROWS[planned.kind][2], status="skipped",
                                    error=stopped or "not reached"))
        print("\n" + format_table(results, args.dry_run) + "\n\n" + LEGEND)
        from trl_pruned_dpo.seam import kernels  # which varlen kernel the packed rows ran, or were refused

        verdicts = {f"{k[0].__name__.strip('_')} {k[2]} heads {k[3]}/{k[4]} dim {k[5]} {k[6]}":
                    "used" if ok else "REFUSED" for k, ok in kernels._VERIFIED.items()}
        print("varlen kernels:", verdicts or "none checked (the packed rows ran SDPA per segment)")
        meta["varlen_kernels"] = verdicts
        meta["rows"] = dict(collections.Counter(r["status"] for r in results))
        meta["stopped"] = stopped or interrupt.signal
        save()
        print(f"\nwrote {args.out}/{stem}.{{json,txt}} in {session.elapsed():.0f}s ({meta['rows']})", flush=True)
        interrupt.restore()
    return 130 if (stopped or interrupt.signal) else 0


if __name__ == "__main__":
    sys.exit(main())
