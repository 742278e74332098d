"""Passes over the model and device->host reads per optimizer step, stock TRL against the plugin (issue 44, item 5).

    python -m benchmarks.passes             # bench model, 8 pairs x gradient accumulation 4, sigmoid, aot_unpaired
    python -m benchmarks.passes --smoke     # a tiny model: checks the script (its numbers are the tiny model's)

On a GPU a step of these sizes is bound by the host (PITFALLS.md, "Where a GPU step's time goes"): kernel launches and
device->host syncs, not FLOPs. A CPU cannot time either, so this counts them, per optimizer step, for stock
`trl.DPOTrainer`, the plugin's defaults (`PrunedDPOConfig()`: padding_free and share_prompt on) and its exact preset
(defaults + `prune_common_prefix`), for two losses: `sigmoid`, and `aot_unpaired`, a TRL 1.16 loss with a batch
statistic: it sorts the micro-batch's chosen and rejected log-ratios apart and pairs them by rank, so a row's term
depends on the others. (TRL 1.16's `bco_pair` and `sppo_hard` are per-pair functions, `bco_pair`'s running mean is gone;
`aot` sorts the policy's and the reference's chosen - rejected differences, whose orders agree on these pairs, so its
value equals sigmoid's here.) The config refuses the exact preset with it (`prune_common_prefix` is exact only for
losses of D_w - D_l), so that cell says so instead of a number.

Each row is one `trainer.train()` of `--steps` optimizer steps (default 2) of 8 pairs x accumulation 4, from the same
initial weights and on the same batches (checked: the batches' digests must agree across rows); the table shows the
last step (the first also starts the data loader's sampler; the JSON has every step). Counted, per step:

- passes: calls of the decoder-layer modules (forward pre-hooks), split into policy (grad on), policy without grad
  (frozen branches), reference (the `ref_model` object), and gradient checkpointing's replays in the backward, counted
  apart: transformers' checkpointed layers replay their `forward`, not their `__call__` (no hook runs), so the
  checkpoint function a layer calls is wrapped. Checkpointing is on, TRL's default (`--checkpointing off`);
- reads: every `aten._local_scalar_dense` (what `.item()`, `float()`, `int()`, `bool()` and tensor indices run, from
  any module: torch, transformers, TRL, the plugin), counted at the dispatcher, plus every `Tensor.tolist()` and
  `Tensor.numpy()` call. On a CPU a host tensor and a device tensor are one kind, so three columns:
  `raw`: all of them; `reads` (the headline): without those made by the plugin's host planner (method/masks.py,
  packing.py, plan.py, tree.py), which reads the collator's host copy of the batch (tests/test_host_syncs.py's rule);
  `device`: only reads of tensors derived from the device batch or the models' weights. That provenance is tracked
  op by op (a dispatch mode taints the outputs of any op with a tainted input; `_prepare_inputs` hands the step fresh
  copies of the batch's tensors, as its move to a GPU would, while the collator's host copy keeps the originals);
  a factory call given a `torch.device` (`torch.zeros(n, device=x.device)`) makes a device tensor, and so does
  `Tensor.to(torch.device)` of a host tensor (counted: `h2d`), except in the host planner, whose tensors follow the
  host batch, and in the data loader (collation is host work; the batch reaches the device in `_prepare_inputs`);
  `.cpu()` and `.to("cpu")` of a device tensor count as reads (a copy to the host).
  Reads of the logging step (transformers' `_maybe_log_save_evaluate` when it logs: the loss, the gradient norm, the
  plugin's metrics) are counted apart (`log` column; `logging_steps=1` here, TRL's default is 10);
- syncing ops: ops whose output shape depends on a device tensor's values (nonzero, masked_select, boolean indexing,
  unique, repeat_interleave without output_size), which synchronise on CUDA without reading a scalar: device only;
- the update agreement: the optimizer is SGD (momentum and weight decay 0) at learning rate 1, so the first step's
  update is the accumulated gradient of its 4 micro-steps, read just before transformers clips it (clipping at 1.0,
  its default, would hide a wrong scale), in float64: ||g_row - g_stock|| / ||g_stock||. The JSON also has the
  clipped update's agreement (what SGD applied, read at the optimizer's pre-step hook) and the norm ratio.

One torch thread. Results: the printed table and benchmarks/results/passes_cpu/passes.json (every read's call site).
"""

from __future__ import annotations

import argparse
import collections
import copy
import gc
import hashlib
import json
import os
import sys
import time
from dataclasses import replace

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakTensorKeyDictionary
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import PrinterCallback

import trl_pruned_dpo
from benchmarks.step_time import SMOKE_SHAPE, workload_plan
from benchmarks.workload import build_model, build_trainer, machine_info, quiet

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The plugin as imported (a test run from tests/ may import another checkout's): call sites are matched against it.
PLUGIN = os.path.dirname(os.path.abspath(trl_pruned_dpo.__file__)) + os.sep
PACKAGE = os.path.dirname(os.path.dirname(PLUGIN))
HOST_PLANNER = tuple(f"trl_pruned_dpo/method/{name}" for name in ("masks.py", "packing.py", "plan.py", "tree.py"))
TORCH = os.path.dirname(torch.__file__) + os.sep
HERE = os.path.abspath(__file__)

ROWS = {  # row -> (side, PrunedDPOConfig fields)
    "stock": ("stock", None),
    "defaults": ("pruned", {}),
    "exact": ("pruned", {"prune_common_prefix": True}),
}
LOSSES = ("sigmoid", "aot_unpaired")
PAIRS, ACCUMULATION = 8, 4

aten = torch.ops.aten
SYNCING = {aten.nonzero.default, aten.masked_select.default, aten._unique2.default, aten.unique_dim.default,
           aten.unique_consecutive.default}
FACTORIES = ("zeros", "ones", "empty", "full", "arange", "tensor", "as_tensor", "rand", "randn", "randint", "randperm",
             "eye", "linspace")


def _site() -> tuple[str, str | None]:
    """(the innermost caller outside torch and this file as `path:line`, the innermost plugin frame if the caller is
    not the plugin itself, else None)."""
    frame, site, via = sys._getframe(2), None, None
    while frame is not None:
        name = frame.f_code.co_filename
        if site is None and not name.startswith(TORCH) and name != HERE:
            site = (name, frame.f_lineno)
            if name.startswith(PLUGIN):
                break
        elif site is not None and name.startswith(PLUGIN):
            via = f"{os.path.relpath(name, PACKAGE)}:{frame.f_lineno}"
            break
        frame = frame.f_back
    if site is None:
        return "?", None
    name, line = site
    for root in (PACKAGE + os.sep, *(p + os.sep for p in sys.path if p and "site-packages" in p)):
        if name.startswith(root):
            name = name[len(root):]
            break
    return f"{name}:{line}", via


class StepProbe(TorchDispatchMode):
    """Counts, per (optimizer step, phase), decoder-layer calls and device->host reads of one `trainer.train()`.

    Install with `with StepProbe(trainer) as probe: trainer.train()`; read `probe.steps` afterwards: step -> phase ->
    counter (step 0: before the first step; "after": the end-of-training work). Phases: "micro-step"
    (`training_step`), "loop" (the training loop around it: fetching, the NaN filter, clipping, the optimizer),
    "step end" (`_maybe_log_save_evaluate` when it does not log: the plugin's guard), "log" (when it logs).
    With `capture_update`, `probe.gradients[step]`: the accumulated gradient before clipping, and
    `probe.updates[step]`: the update SGD applied (-lr x the clipped gradient), float64, flat.
    """

    def __init__(self, trainer, capture_update: bool = True):
        super().__init__()
        self.trainer = trainer
        self.capture_update = capture_update
        self.device = WeakTensorKeyDictionary()  # tensors of device provenance (the batch on the device, weights)
        self.step, self.phases, self.paused, self.fetching = 0, [], 0, False
        self.steps: dict = collections.defaultdict(lambda: collections.defaultdict(collections.Counter))
        self.sites: dict = collections.defaultdict(collections.Counter)  # (step, kind) -> Counter of call sites
        self.batches: dict = collections.defaultdict(list)  # step -> digests of its micro-batches
        self.updates: dict = {}  # step -> what SGD subtracts: lr x the clipped gradient
        self.gradients: dict = {}  # step -> the accumulated gradient before clipping
        self._undo, self._checkpointed = [], []

    # ------------------------------------------------------------------------------------------------ bookkeeping
    @property
    def phase(self) -> str:
        return self.phases[-1] if self.phases else ("setup" if self.step == 0 else "loop")

    def _count(self, kind: str, tensor=None):
        """One event of `kind` at its call site: "scalar" or "list" (a read of any tensor), "host copy" (of a device
        tensor), "syncing op" (counted on device tensors only), "h2d" (a host tensor moved to the device)."""
        where, via = _site()
        counter = self.steps[self.step][self.phase]
        device = tensor is not None and tensor in self.device
        if kind == "syncing op" and not device:
            return
        if kind in ("scalar", "list"):
            counter["raw"] += 1
            counter["planner" if where.split(":")[0] in HOST_PLANNER else "reads"] += 1
        counter[{"syncing op": "syncing", "h2d": "h2d"}.get(kind, "device" if device else "host")] += 1
        label = f"{kind}{' (device)' if device and kind != 'h2d' else ''} {where}" + (f" via {via}" if via else "")
        self.sites[(self.step, self.phase)][label] += 1

    # --------------------------------------------------------------------------------------------- dispatch mode
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused:
            return out
        leaves = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if func is aten._local_scalar_dense.default:
            self._count("scalar", args[0])
            return out
        tainted = any(a in self.device for a in leaves)
        if tainted:
            mutates = func._schema.is_mutable
            for o in tree_leaves(out):
                if isinstance(o, torch.Tensor):
                    self.device[o] = True
                    # a write through a view (`buffer[i:j].copy_(x)`) changes its base: TRL's fused head fills
                    # factory-made buffers that way
                    if mutates and o._base is not None:
                        self.device[o._base] = True
            if func in SYNCING or (func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None) or (
                    func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default) and any(
                        i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])):
                self._count("syncing op", next(a for a in leaves if a in self.device))
        return out

    # ------------------------------------------------------------------------------------------------ install
    def _patch(self, owner, name, make):
        original = getattr(owner, name)
        setattr(owner, name, make(original))
        self._undo.append((owner, name, original, name in vars(owner)))

    def __enter__(self):
        trainer, probe = self.trainer, self
        policy = trainer.accelerator.unwrap_model(trainer.model)
        reference = trainer.ref_model
        for model, role in ((policy, "policy"), (reference, "reference")):
            if model is None:
                continue
            for tensor in (*model.parameters(), *model.buffers()):
                self.device[tensor] = True
            for module in decoder_layers(model):
                self._undo.append(module.register_forward_pre_hook(self._layer_hook(role)))

        def reading(kind):
            def make(original):
                def read(tensor, *args, **kwargs):
                    if not probe.paused:
                        probe._count(kind, tensor)
                    return original(tensor, *args, **kwargs)
                return read
            return make

        self._patch(torch.Tensor, "tolist", reading("list"))
        self._patch(torch.Tensor, "numpy", reading("list"))

        def moving(original):
            def move(tensor, *args, **kwargs):
                out = original(tensor, *args, **kwargs)
                if probe.paused:
                    return out
                target = "host" if original is torch_cpu else probe._target(args, kwargs)
                if target == "host" and tensor in probe.device:
                    probe._count("host copy", tensor)
                    with probe.pause():
                        out = out.clone()  # on a GPU a new host tensor: no longer of device provenance
                elif target == "device" and tensor not in probe.device and not probe.fetching \
                        and not probe._in_planner():
                    probe._count("h2d")
                    with probe.pause():
                        out = out.clone()  # on a GPU a new device tensor; the host one stays a host tensor
                    probe.device[out] = True
                return out
            return move

        def factory(original):
            def make(*args, **kwargs):
                out = original(*args, **kwargs)
                if not probe.paused and not probe.fetching and isinstance(kwargs.get("device"), torch.device) \
                        and not probe._in_planner():
                    probe.device[out] = True  # `torch.zeros(n, device=x.device)`: made on the training device
                return out
            return make

        for name in FACTORIES:
            self._patch(torch, name, factory)

        torch_cpu = torch.Tensor.cpu
        self._patch(torch.Tensor, "cpu", moving)
        self._patch(torch.Tensor, "to", moving)

        def phase(name):
            def make(original):
                def wrapped(*args, **kwargs):
                    probe.phases.append(name)
                    try:
                        return original(*args, **kwargs)
                    finally:
                        probe.phases.pop()
                return wrapped
            return make

        self._patch(trainer, "get_batch_samples", self._fetch)
        self._patch(trainer, "_prepare_inputs", self._on_device)
        self._patch(trainer, "training_step", phase("micro-step"))
        # transformers' own step end: the logging step's reads (the plugin's override runs its guard before it).
        # Patched before the instance's, which binds it.
        self._patch(Trainer, "_maybe_log_save_evaluate", lambda original: lambda trainer_, *a, **k: phase(
            "log" if trainer_.control.should_log else "step end")(original)(trainer_, *a, **k))
        self._patch(trainer, "_maybe_log_save_evaluate", phase("step end"))
        self._patch(trainer, "log", phase("log"))
        self._patch(trainer, "_clip_grad_norm", self._before_clipping)
        self._undo.append(register_optimizer_step_pre_hook(self._before_update))
        trainer.add_callback(_EpochEnd(self))
        super().__enter__()
        return self

    def __exit__(self, *exc):
        super().__exit__(*exc)
        for undo in reversed(self._undo):
            if isinstance(undo, tuple):
                owner, name, original, own = undo
                if own:
                    setattr(owner, name, original)
                else:  # inherited (torch.Tensor's methods live on its C base) or the class's: drop the patch
                    delattr(owner, name)
            else:
                undo.remove()
        self._undo.clear()
        for module, checkpoint in self._checkpointed:
            if getattr(module._gradient_checkpointing_func, "counts_recomputes", False):
                module._gradient_checkpointing_func = checkpoint
        self._checkpointed.clear()
        self.trainer.callback_handler.callbacks = [c for c in self.trainer.callback_handler.callbacks
                                                   if not isinstance(c, _EpochEnd)]

    def _target(self, args, kwargs) -> str | None:
        """Where `Tensor.to(*args, **kwargs)` sends a tensor on a GPU machine: "host" for the string "cpu", "device"
        for a `torch.device` (code names the training device by object: `x.device`, `accelerator.device`; not in the
        host planner, `_in_planner`) or a device tensor, None for no move (a dtype only, or a host tensor's device)."""
        where = kwargs.get("device", args[0] if args and isinstance(args[0], (str, torch.device, torch.Tensor))
                           else None)
        if isinstance(where, str):
            return "host" if where == "cpu" else "device"
        if isinstance(where, torch.device):
            return "device"
        if isinstance(where, torch.Tensor):
            return "device" if where in self.device else None
        return None

    @staticmethod
    def _in_planner() -> bool:
        """Whether the caller is the host planner, whose tensors stay on the host (its `.to(x.device)` follows the
        host batch it plans from)."""
        return _site()[0].split(":")[0] in HOST_PLANNER

    def pause(self):
        probe = self

        class _Paused:
            def __enter__(self):
                probe.paused += 1

            def __exit__(self, *exc):
                probe.paused -= 1

        return _Paused()

    # ------------------------------------------------------------------------------------------------ the hooks
    def _layer_hook(self, role):
        def hook(module, args):
            if self.paused:
                return
            checkpoint = getattr(module, "_gradient_checkpointing_func", None)
            if checkpoint is not None and not getattr(checkpoint, "counts_recomputes", False):
                self._checkpointed.append((module, checkpoint))
                module._gradient_checkpointing_func = self._recomputing(checkpoint)
            if torch._C._current_graph_task_id() != -1:  # a reentrant checkpoint's replay: counted by `_recomputing`
                return
            elif role == "reference":
                kind = "reference"
            else:
                kind = "policy" if torch.is_grad_enabled() else "policy_no_grad"
            self.steps[self.step][self.phase][kind] += 1
        return hook

    def _recomputing(self, checkpoint):
        """transformers' checkpointed layers replay their `forward`, not their `__call__`, in the backward (no hooks
        run): the checkpoint function they call (set when `train()` enables checkpointing) is wrapped to count the
        replays of the function it is handed."""
        def run(function, *args, **kwargs):
            def replay(*a, **k):
                if torch._C._current_graph_task_id() != -1 and not self.paused:
                    self.steps[self.step][self.phase]["recompute"] += 1
                return function(*a, **k)
            return checkpoint(replay, *args, **kwargs)
        run.counts_recomputes = True
        return run

    def _fetch(self, original):
        def fetch(*args, **kwargs):
            self.step += 1  # transformers fetches an optimizer step's micro-batches at its start
            self.fetching = True  # collation is host work (TRL's `pad` names its inputs' device); `_on_device` moves
            try:
                batches, items = original(*args, **kwargs)
            finally:
                self.fetching = False
            with self.pause():
                self.batches[self.step] = [hashlib.sha1(b["input_ids"].numpy().tobytes()).hexdigest()[:12]
                                           for b in batches]
            return batches, items
        return fetch

    def _on_device(self, original):
        def prepare(*args, **kwargs):
            inputs = original(*args, **kwargs)
            with self.pause():  # what a move to the GPU makes: new tensors; the collator's host copy keeps its own
                inputs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
            for v in inputs.values():
                if isinstance(v, torch.Tensor):
                    self.device[v] = True
            return inputs
        return prepare

    def _flat_gradient(self, scale=None) -> torch.Tensor:
        """The policy's gradient, flat, in float64 (times `scale(p)` per parameter when given)."""
        with self.pause():
            policy = self.trainer.accelerator.unwrap_model(self.trainer.model)
            return torch.cat([
                (p.grad.detach().double() * (scale(p) if scale else 1.0)).flatten() if p.grad is not None
                else torch.zeros(p.numel(), dtype=torch.float64)
                for _, p in policy.named_parameters() if p.requires_grad])

    def _before_clipping(self, original):
        def clip(*args, **kwargs):
            if self.capture_update and self.step not in self.gradients:
                self.gradients[self.step] = self._flat_gradient()
            return original(*args, **kwargs)
        return clip

    def _before_update(self, optimizer, args, kwargs):
        if not self.capture_update or self.step in self.updates:
            return
        if self.step not in self.gradients:  # no clipping (max_grad_norm 0)
            self.gradients[self.step] = self._flat_gradient()
        lr = {id(p): group["lr"] for group in optimizer.param_groups for p in group["params"]}
        self.updates[self.step] = self._flat_gradient(lambda p: -lr[id(p)])


class _EpochEnd(TrainerCallback):
    """Marks the end of the training loop: what follows (the epoch's last `_maybe_log_save_evaluate`, the summary) is
    no optimizer step's."""

    def __init__(self, probe):
        self.probe = probe

    def on_epoch_end(self, *args, **kwargs):
        self.probe.step = "after"


def decoder_layers(model) -> list:
    """The model's decoder-layer modules (`*DecoderLayer` classes; else the modules of its `layers` list)."""
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    if not layers:
        layers = list(getattr(getattr(model, "model", model), "layers", []))
    if not layers:
        raise ValueError(f"no decoder layers found in {type(model).__name__}")
    return layers


def step_summary(probe: StepProbe, step) -> dict:
    """One optimizer step's counts: passes by kind, reads by kind outside the logging step, the log's, per phase."""
    phases = probe.steps[step]
    total = collections.Counter()
    for name, counter in phases.items():
        if name != "log":
            total.update(counter)
    log = phases.get("log", collections.Counter())
    return dict(
        policy=total["policy"], policy_no_grad=total["policy_no_grad"], reference=total["reference"],
        recompute=total["recompute"], reads=total["reads"], raw=total["raw"], planner=total["planner"],
        device=total["device"], syncing=total["syncing"], h2d=total["h2d"], log_reads=log["reads"],
        log_device=log["device"],
        by_phase={name: dict(counter) for name, counter in phases.items()},
    )


def measure(trainer, *, capture_update: bool = True) -> dict:
    """Train `trainer` (its `max_steps` optimizer steps) under a `StepProbe`: per-step summaries, the batch digests,
    the first step's update (flat float64 tensor) and every read's call site."""
    with StepProbe(trainer, capture_update) as probe:
        trainer.train()
    numbered = sorted(s for s in probe.steps if isinstance(s, int) and s > 0)
    sites = {f"{step}/{phase}": dict(counter.most_common()) for (step, phase), counter in probe.sites.items()}
    return dict(steps={s: step_summary(probe, s) for s in numbered}, batches=dict(probe.batches),
                gradient=probe.gradients.get(1), update=probe.updates.get(1), sites=sites,
                history=[h for h in trainer.state.log_history if "loss" in h])


def agreement(update: torch.Tensor, stock: torch.Tensor) -> float:
    return float((update - stock).norm() / stock.norm())


# ------------------------------------------------------------------------------------------------------ the run
def bench_workload(smoke: bool, steps: int):
    """The bench model on UltraFeedback-shaped lengths (step_time's `--workload` quick cell: x0.25, 8 pairs, reference
    noise 0.01), with batches for `steps` optimizer steps of accumulation 4; `smoke`: step_time's smoke cell."""
    w = workload_plan("smoke" if smoke else "quick", ["ultrafeedback"])["groups"][0]["workload"]
    return replace(w, batch_size=2 if smoke else PAIRS, num_batches=steps * ACCUMULATION)


def run_row(w, base, row: str, loss: str, steps: int, checkpointing: bool) -> dict:
    side, pruning = ROWS[row]
    training = dict(gradient_accumulation_steps=ACCUMULATION, max_steps=steps, optim="sgd", learning_rate=1.0,
                    lr_scheduler_type="constant", weight_decay=0.0, logging_steps=1, loss_type=[loss])
    trainer = build_trainer(side, w, copy.deepcopy(base), precompute=False, checkpointing=checkpointing,
                            pruning=pruning, training=training)
    if side == "pruned" and not trainer.forward_choice.packed:
        raise RuntimeError(f"{row}: the packed path fell back to padded rows")
    trainer.remove_callback(PrinterCallback)  # logging_steps=1 for the log's reads: no printed dict per step
    try:
        return measure(trainer)
    finally:
        del trainer
        gc.collect()


def format_table(results: list[dict], step) -> str:
    """One line per (loss, row): step `step`'s decoder-layer calls, passes against stock's (policy + reference),
    reads (without the host planner's; raw; of device provenance), syncing ops, host->device copies, the logging
    step's reads, and the first step's update against stock's."""
    head = (f"{'loss':<12} {'row':<9} {'policy':>6} {'nograd':>6} {'ref':>4} {'recomp':>6} {'passes':>7} "
            f"{'reads':>5} {'raw':>4} {'device':>6} {'sync':>4} {'h2d':>4} {'log':>3} {'update vs stock':>15}")
    lines = [head, "-" * len(head)]
    for r in results:
        cell = f"{r['loss']:<12} {r['row']:<9}"
        if "error" in r:
            lines.append(f"{cell} {r['error'][:100]}")
            continue
        s = r["steps"][step]
        stock = next(x for x in results if x["loss"] == r["loss"] and x["row"] == "stock")["steps"][step]
        passes = (s["policy"] + s["reference"]) / max(stock["policy"] + stock["reference"], 1)
        agree = "-" if r["row"] == "stock" else f"{r['agreement']:.2e}"
        lines.append(f"{cell} {s['policy']:6d} {s['policy_no_grad']:6d} {s['reference']:4d} {s['recompute']:6d} "
                     f"{passes:6.2f}x {s['reads']:5d} {s['raw']:4d} {s['device']:6d} {s['syncing']:4d} {s['h2d']:4d} "
                     f"{s['log_reads']:3d} {agree:>15}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model and lengths: checks the script")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per row; the table shows the last")
    parser.add_argument("--losses", nargs="+", default=list(LOSSES))
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--checkpointing", choices=("on", "off"), default="on")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/passes_cpu (--smoke: /tmp)")
    args = parser.parse_args(argv)
    quiet()
    torch.set_num_threads(1)
    started = time.time()
    w = bench_workload(args.smoke, args.steps)
    if args.smoke:
        w = replace(w, model_shape=dict(SMOKE_SHAPE))
    checkpointing = args.checkpointing == "on"
    out = args.out or ("/tmp/passes_smoke" if args.smoke else os.path.join(REPO, "benchmarks", "results",
                                                                             "passes_cpu"))
    meta = dict(command=" ".join(["python -m benchmarks.passes", *(sys.argv[1:] if argv is None else argv)]),
                started=time.strftime("%Y-%m-%d %H:%M:%S"), machine=machine_info("cpu", 1), workload=w.label(),
                model_shape=w.model_shape, pairs_per_micro_batch=w.batch_size, accumulation=ACCUMULATION,
                steps=args.steps, shown_step=args.steps, checkpointing=checkpointing, reference="live (noise 0.01)",
                optimizer="SGD lr 1, momentum 0, weight decay 0, max_grad_norm 1.0 (transformers' default)",
                dtype="fp32")
    print("passes:", json.dumps({k: v for k, v in meta.items() if k != "machine"}), flush=True)
    base = build_model(w)
    results = []
    for loss in args.losses:
        stock_update = stock_gradient = None
        for row in args.rows:
            t0 = time.time()
            try:
                r = run_row(w, base, row, loss, args.steps, checkpointing)
            except (ValueError, RuntimeError) as error:  # the config refuses the exact preset with a non-pair loss
                results.append(dict(loss=loss, row=row, error=f"{type(error).__name__}: {error}".splitlines()[0]))
                print(f"[{time.time() - started:5.0f}s] {loss} {row}: {results[-1]['error'][:160]}", flush=True)
                continue
            update, gradient = r.pop("update"), r.pop("gradient")
            if row == "stock":
                stock_update, stock_gradient = update, gradient
            r.update(loss=loss, row=row, seconds=round(time.time() - t0, 1), gradient_norm=float(gradient.norm()))
            if stock_update is not None:
                r["agreement"] = agreement(gradient, stock_gradient)
                r["clipped_update_agreement"] = agreement(update, stock_update)
                r["gradient_norm_ratio"] = float(gradient.norm() / stock_gradient.norm())
            results.append(r)
            s = r["steps"][args.steps]
            print(f"[{time.time() - started:5.0f}s] {loss} {row}: passes {s['policy']}+{s['reference']} "
                  f"(+{s['recompute']} recompute), reads {s['reads']} (raw {s['raw']}, device {s['device']}), "
                  f"log {s['log_reads']}", flush=True)
    ok = [r for r in results if "error" not in r]
    same = {json.dumps(r["batches"], sort_keys=True) for r in ok}
    meta["same_batches"] = len(same) == 1
    if len(same) != 1:
        print("WARNING: the rows did not see the same batches", flush=True)
    table = format_table(results, args.steps)
    print("\n" + table)
    meta["elapsed_s"] = round(time.time() - started, 1)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "passes.json"), "w") as f:
        json.dump(dict(meta=meta, results=results), f, indent=1, default=str)
    with open(os.path.join(out, "passes.txt"), "w") as f:
        f.write(table + "\n")
    print(f"\nwrote {out}/passes.{{json,txt}} in {meta['elapsed_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
