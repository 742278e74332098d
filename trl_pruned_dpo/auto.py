"""`auto` keep probabilities from the gradient noise scale and the loss curve (docs/method.md, "auto", Eqs. A1-A4).

Measured from squared gradient norms training computes anyway, at two batch sizes at the same parameters (McCandlish
et al. 2018, App. A.1): each micro-batch's local gradient (parameter hooks; FSDP2: its unsharded parameters) and the
step's accumulated, reduced pre-clip norm (the one transformers computes for clipping and logging), or, without
accumulation or a second process, two consecutive steps, B and 2B, less the mean gradient's drift between them, read
from consecutive pairs (`.grad` after the backward, before the clip, no hooks; one gradient-sized buffer, Eq. A4).
Where nothing will be pruned, only the blocks around a (rare) probe are measured. method/noise.py estimates and
chooses.

The trainer asks and hands over; nothing here reads the trainer. A step's life: `draw` (each micro-step; at
micro-step 0 it first decides from what earlier steps measured, `_decide`) returns the micro-step's `AutoDraw`: the
keep probabilities (per pair for branches: near-copies keep both), whether a branch can drop, and the run's means to
log; `add_work` takes a micro-step's work counts; `after_backward` reads `.grad` on the B / 2B path; `end_step`
takes the step's pre-clip norm and loss and reduces the step's `StepMeasurement` over processes, to be folded into
the running sums at the next decision (`_fold`). `attach` and `detach` install and remove the gradient hooks.
"""

import dataclasses
import math
from typing import Any, NamedTuple

import torch
from transformers import TrainerCallback
from transformers.utils import logging

from .method.masks import pair_overlap, per_pair_branch_probs
# The arithmetic, re-exported for `auto.choose` & co.
from .method.noise import (  # noqa: F401
    MAX_STEP_INFLATION, MIN_GAIN, UPPER_Z, LossCurve, PairedSteps, ProbeLevels, Running, branch_idle, choose,
    extra_noise, head_share, log_trace, relative_step_cost, steps_factor, trace_and_norm2,
)
from .method.packing import HostBatch
from .method.plan import WorkCounts

# Blocks between exact / half probes after the warm-up, and samples before a decision.
PROBE_EVERY, MIN_SAMPLES = 16, 2
# A family that no keep probability pays for even at the optimistic bounds is probed 4 times less often.
RARELY = 4
# The keep probabilities (branch, position) of each kind of step; "choice" runs the last decision's.
KIND_PROBS = {"exact": (1, 1), "branch": (0.5, 1), "position": (1, 0.5)}


def work_units(adapters: bool) -> dict[str, float]:
    """A micro-step's work in the plan's token units: a token's forward counts 1, its backward 2 (full fine-tuning:
    the input and the weight gradients), 1 with an adapter (the frozen base computes its input gradient only)."""
    return {"policy_tokens_executed": 1.0, "grad_tokens_executed": 1.0 if adapters else 2.0,
            "reference_tokens_executed": 1.0}


@dataclasses.dataclass(frozen=True)
class AutoDraw:
    """What "auto" chose for one micro-step's draw: `keep_probs` (the "auto" keywords of `masks.draw_masks`, the
    branch one per pair), whether a branch can be dropped (`prunes_branches`, the same on every process; None where
    branches are not "auto"), and the
    (name, total, count) of the run's means this draw adds to (logged by metrics.py)."""

    keep_probs: dict[str, float | torch.Tensor]
    prunes_branches: bool | None
    means: tuple[tuple[str, float, float], ...]


@dataclasses.dataclass
class StepMeasurement:
    """What the running optimizer step has measured so far; a new one starts at each step's end."""

    # The squared norm of the small batch's gradient: summed over the micro-batches' local gradients (engine path),
    # or the step's own pre-clip norm squared (B / 2B path).
    small_norm2: torch.Tensor | float | None = 0.0
    # B / 2B: |g_(t-1) - g_t|² on a pair's second step, or the link |g_(t-2) - g_t|² on a first step (Eq. A4).
    pair_diff2: torch.Tensor | float = 0.0
    # The pairs drawn and the work done (`work_units`) by its micro-steps.
    pairs: int = 0
    work: float = 0.0


class StepTotals(NamedTuple):
    """A step's `StepMeasurement` and loss as `end_step` reduces them (summed over processes), in that order."""

    small_norm2: float
    pairs: float
    work: float
    pair_diff2: float
    loss: float


class AutoKeepProbs(TrainerCallback):
    """Measures each step's norms, chooses the keep probabilities, and says why (docs/method.md, "auto"). A callback
    only to attach its gradient hooks to the model as training wraps it, and to remove them."""

    def __init__(self, args: Any, model_config: Any, adapters: bool = False, deepspeed: bool = False):
        # accelerate's fp16 scaler is unscaled here (its scale is read); DeepSpeed's own is not.
        if deepspeed and args.fp16:
            raise ValueError('branch_keep_prob / position_keep_prob "auto" cannot measure gradients under DeepSpeed\'s '
                             "fp16 loss scaler: train in bf16, or set the keep probabilities to numbers.")
        self.head = head_share(model_config)
        self.branch_auto = args.branch_keep_prob == "auto"
        self.position_auto = args.position_keep_prob == "auto"
        # A family that cannot save MIN_GAIN is neither probed nor chosen. Branches on adapter (PEFT) training: the
        # backward through the frozen base computes activation gradients only, so a dropped branch saves about one
        # forward of its response while its probe steps, at 1/2, cost held-out accuracy the run does not win back
        # (docs/quality.md: 0.93x and 1.15x the exact step, -12 and -26 points, on both real models): not probed.
        if self.branch_auto and adapters:
            logging.get_logger(__name__).warning(
                'branch_keep_prob="auto" keeps every branch on adapter (PEFT) training: a dropped branch saves little '
                "there and its probes cost accuracy (docs/quality.md). Set a number to prune branches.")
        wanted = {"branch": self.branch_auto and not adapters,
                  "position": self.position_auto and self.head >= 2 * MIN_GAIN}
        self.families = [family for family, on in wanted.items() if on]
        self.units = work_units(adapters)
        processes = max(args.world_size, 1)
        self.batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * processes
        # One micro-batch per step on one process: the B / 2B path.
        self.single = args.gradient_accumulation_steps * processes == 1
        # The losses but `robust` are >= 0 (A3).
        self.floor = None if "robust" in args.loss_type else 0.0
        # The run's steps (the loss curve's horizon), known once training starts.
        self.max_steps = args.max_steps
        # Gradient hooks (engine path) and the B / 2B path's parameters and gradient buffer, set by `attach`.
        self._hooks, self._hooked, self._params = [], set(), []
        self._buffer = self._parts = None
        self.load_state_dict(None)

    def state_dict(self) -> dict:
        """The checkpoint's state: a resume then draws the masks of no resume. The B / 2B buffer is not saved: the
        pair a checkpoint splits yields no sample, resumed or not (PairedSteps.split)."""
        self._fold()
        self._paired = self._paired.split()
        return {"sums": self.stats.sums, "choice": list(self.choice), "history": self.history, "futile": self.futile,
                "loss_curve": self.curve.state_dict(), "probes": self.probes.state_dict(),
                "drift": self._paired.carried}

    def load_state_dict(self, state: dict | None) -> None:
        state = state or {}
        # The last step's reduced totals, folded into the running sums at the next decision (`_fold`).
        self._pending = None
        self._paired = PairedSteps(state.get("drift"))
        self.step = StepMeasurement()
        # Whether this step is measured (B / 2B: its gradient goes through the buffer).
        self.measuring = False
        # The even step whose gradient the buffer holds.
        self.held_step = None
        # An earlier estimator's statistics: measured anew.
        if "probes" not in state:
            state = {key: value for key, value in state.items() if key != "sums"}
        self.stats, self.history = Running(state.get("sums")), list(state.get("history", []))
        self.choice = tuple(state.get("choice", (1.0, 1.0, 1.0, "before the first decision: keep everything")))
        # Families probed RARELY (saved: the kinds of steps follow it).
        self.futile = list(state.get("futile", []))
        self.curve, self.probes = LossCurve(state.get("loss_curve")), ProbeLevels(state.get("probes"))

    # ---------------------------------------------------------------------------------------------- the schedule
    def kind(self, step: int) -> str:
        """"exact", a family's probe or "choice", from the step and the (rank-identical, saved) state: the warm-up E F1
        E F1 E F2 E F2 E (B / 2B: E first, its first pair has no link, A4) resolves the families after 5 and 9 blocks
        (6, 10); then every PROBE_EVERY blocks from block 16 on, a probe between two exact blocks (its units). Where
        nothing will be pruned (every family idle or probed RARELY) only the blocks around a probe are measured (B /
        2B: one more before them, the link); the others run the choice, keeping everything, unmeasured."""
        block, families, idle = step // (2 if self.single else 1), self.families, branch_idle(self.stats)
        warm_up = []
        if families:
            warm_up = ["exact"] * (1 + self.single) + [k for f in families for k in (f, "exact", f, "exact")]
        if block < len(warm_up):
            return "exact" if warm_up[block] in idle else warm_up[block]
        cycle, turn = block % PROBE_EVERY, block // PROBE_EVERY
        probe = self._probed(turn, idle)
        if probe and cycle == 1:
            return probe
        if families and set(families) <= {*self.futile, *idle}:
            link = self.single and cycle == PROBE_EVERY - 1 and self._probed(turn + 1, idle)
            return "exact" if probe and cycle in (0, 2) or link else "choice"
        return "exact" if families and (cycle in (0, 2) or self.choice[:2] == (1.0, 1.0)) else "choice"

    def _probed(self, turn: int, idle: set) -> str | None:
        """The family probed in a turn of PROBE_EVERY blocks (they take turns): one probed RARELY every RARELY-th turn
        of its own, an idle one never."""
        probe = self.families[turn % len(self.families)] if self.families else None
        rare = probe in self.futile and turn % (RARELY * len(self.families)) >= len(self.families)
        return None if probe in idle or rare else probe

    def draw(self, step: int, micro_step: int, host: HostBatch) -> AutoDraw:
        """This micro-step's "auto" keep probabilities (per pair for branches: near-copies keep both, read from the
        batch's host copy), after deciding from what earlier steps measured at micro-step 0."""
        if micro_step == 0:
            self._decide(step)
        kind = self.kind(step)
        self.measuring = kind != "choice"
        branch, position = KIND_PROBS.get(kind, self.choice[:2])
        pairs = host.input_ids.size(0) // 2
        self.step.pairs += pairs
        keep_probs, means = {}, []
        if self.branch_auto:
            overlap = pair_overlap(host.input_ids, host.completion_mask, host.attention_mask) if branch < 1 else None
            kept = 1.0 if overlap is None else per_pair_branch_probs(overlap, float(branch))
            keep_probs["branch_keep_prob"] = kept
            means.append(("prune/branch_keep_prob", float(kept.sum() if torch.is_tensor(kept) else kept * pairs),
                          float(pairs)))
        if self.position_auto:
            keep_probs["position_keep_prob"] = float(position)
            means.append(("prune/position_keep_prob", float(position), 1.0))
        if self.history:
            means.append(("prune/auto_b_simple", float(min(self.history[-1]["b_simple"], 1e9)), 1.0))
        # Rank-identical: the plan runs no frozen group where every branch is kept.
        return AutoDraw(keep_probs, float(branch) < 1 if self.branch_auto else None, tuple(means))

    # ------------------------------------------------------------------------------------------- the measurement
    def on_train_begin(self, args: Any, state: Any, control: Any, model: torch.nn.Module = None, **_: Any) -> None:
        self.max_steps = state.max_steps
        self.attach(model)

    def on_train_end(self, *_: Any, **__: Any) -> None:
        self.detach()

    def attach(self, model: torch.nn.Module) -> None:
        """At the start of `train()`, on the model as training wrapped it: the B / 2B path reads `.grad` after each
        backward; the engine path hooks each micro-batch's local gradient, before accumulation and reduction (FSDP2:
        its unsharded parameters, which exist from the first forward on)."""
        params = [p for p in model.parameters() if p.requires_grad and not hasattr(p, "device_mesh")]
        if self.single:
            self._params = params
            return
        self._hook(params)
        if any(hasattr(m, "_get_fsdp_state") for m in model.modules()):
            self._hooks.append(model.register_forward_hook(self._hook_unsharded))

    def detach(self) -> None:
        """At the end of `train()` (also one that raised): hooks and the gradient buffer released."""
        for handle in self._hooks:
            handle.remove()
        self._hooks, self._hooked = [], set()
        self._buffer = self._parts = None

    def _hook_unsharded(self, model: torch.nn.Module, *_: Any) -> None:
        self._hook(fp._unsharded_param for m in model.modules() if hasattr(m, "_get_fsdp_state")
                   for fp in getattr(m._get_fsdp_state()._fsdp_param_group, "fsdp_params", [])
                   if hasattr(fp, "_unsharded_param") and fp._unsharded_param.requires_grad)

    def _hook(self, params: Any) -> None:
        for p in params:
            if id(p) not in self._hooked:
                self._hooked.add(id(p))
                self._hooks.append(p.register_hook(self._on_grad))

    def _on_grad(self, grad: torch.Tensor) -> None:
        """A micro-batch's local gradient, per parameter, before accumulation and reduction: one scalar kept."""
        if self.measuring:
            self.step.small_norm2 = self.step.small_norm2 + torch.linalg.vector_norm(
                grad.detach(), dtype=torch.promote_types(grad.dtype, torch.float32)).square()

    def after_backward(self, step: int, scale: torch.Tensor | None = None) -> None:
        """A micro-batch's backward is done: on the B / 2B path (its one micro-batch), `.grad` before clipping and,
        under an fp16 loss scaler, before unscaling (`scale`: the device tensor it ran under, guards.loss_scale)."""
        if self.single and self.measuring:
            self._read_pair(step, scale)

    def _read_pair(self, step: int, scale: torch.Tensor | None) -> None:
        """B / 2B, before clipping, fused over the parameters: |g_(t-1) - g_t|² on a pair's second step, the
        link |g_(t-2) - g_t|² on a first step (Eq. A4), from the one buffer; a first step's gradient kept in it,
        unscaled (the loss scale may change between the two steps)."""
        # A parameter without a gradient (unused this step) counts as 0.
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._params]
        if self._buffer is None:
            self._buffer = torch.empty(sum(g.numel() for g in grads), dtype=grads[0].dtype, device=grads[0].device)
            self._parts = [x.view(g.shape) for x, g in zip(self._buffer.split([g.numel() for g in grads]), grads)]
        if self.held_step in (step - 1, step - 2):
            # At this step's scale, in place: no second gradient-sized buffer.
            if scale is not None:
                torch._foreach_mul_(self._parts, scale)
            torch._foreach_sub_(self._parts, grads)
            diff2 = torch.stack(torch._foreach_norm(
                self._parts, dtype=torch.promote_types(self._buffer.dtype, torch.float32))).square().sum()
            self.step.pair_diff2 = diff2 if scale is None else diff2 / scale.square()
            # On a pair's second step, its first gradient goes back: the next pair's first step links to it.
            if step % 2:
                torch._foreach_add_(self._parts, grads)
                if scale is not None:
                    torch._foreach_div_(self._parts, scale)
        if step % 2 == 0:
            torch._foreach_copy_(self._parts, grads)
            if scale is not None:
                torch._foreach_div_(self._parts, scale)

    def add_work(self, counts: WorkCounts) -> None:
        """A micro-step's work, from its plan's counts, in `work_units`."""
        self.step.work += sum(weight * getattr(counts, name) for name, weight in self.units.items())

    def end_step(self, step: int, grad_norm: torch.Tensor | float | None, loss: torch.Tensor | None,
                 accumulation: int, accelerator: Any, scale: torch.Tensor | None = None) -> None:
        """Optimizer step `step` ended with the pre-clip, accumulated, reduced `grad_norm` (unscaled) and this
        process's `loss` (summed over its micro-steps, each divided by `accumulation`); `scale`: the fp16 loss scale its
        backwards ran under (a device copy), or None. One all-reduce of five scalars on every rank, every step (no
        device read here); read at the next decision, which drops a step the scaler skipped (non-finite)."""
        measured = self.step
        clip = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        # One micro-batch, one process: the pre-clip norm is its own gradient's.
        if self.single:
            measured.small_norm2 = clip ** 2 if clip is not None else None
        values = (measured.small_norm2, measured.pairs, measured.work, measured.pair_diff2, loss)
        local = torch.stack([torch.as_tensor(0.0 if x is None else x, dtype=torch.float64, device=accelerator.device)
                             for x in values])
        # The loss was divided by the accumulation steps; the hooks saw the gradients of the scaled loss.
        local[0] *= accumulation ** 2
        if scale is not None and not self.single:
            local[0] /= scale.to(local).square()
        self._pending = (step, accelerator.reduce(local, "sum"), accumulation * accelerator.num_processes, clip)
        if self.measuring and step % 2 == 0:
            self.held_step = step
        self.step = StepMeasurement()

    # ------------------------------------------------------------------------------------------ the estimate
    def _fold(self) -> None:
        """The last step's norms into the running sums: per-step estimates of tr Σ (per kind) and |G|² (exact)."""
        if self._pending is None:
            return
        (step, reduced, micro, clip), self._pending = self._pending, None
        # The five scalars `end_step` reduced, summed over processes.
        totals = StepTotals(*reduced.tolist())
        # A step the fp16 loss scaler skipped (its gradient overflowed) measures nothing.
        if not all(math.isfinite(value) for value in totals):
            return
        small2, pairs = totals.small_norm2, totals.pairs
        kind = self.kind(step)
        # Every kind of step: the loss's value is exact or unbiased.
        self.curve.add(step, totals.loss / (micro or 1))
        if kind == "choice":
            return
        self.stats.add(f"work_{kind}", totals.work / max(pairs, 1))
        sizes, drift = None, 0.0
        if not self.single and clip is not None:
            # A step of one micro-batch on one process (an epoch's last, short step) has no smaller batch to compare.
            if micro < 2:
                return
            sizes = small2 / micro, float(clip) ** 2, pairs / micro, pairs
            if not math.isfinite(sizes[1]):
                return
        elif self.single:
            # B and 2B pairs, and the drift between their two steps (None: not measured).
            sizes, drift = self._paired.add(step, kind, small2, totals.pair_diff2, pairs)
        # B / 2B: a pair's first step, or a pair without its link.
        if sizes is None or drift is None:
            return
        # B / 2B: b |g1 - g2|² / 2 = tr Σ + drift (A4).
        raw, raw_norm2 = trace_and_norm2(*sizes)
        # r from probes between exact blocks.
        self.probes.add(self.stats, kind, log_trace(raw, drift))
        if kind == "exact":
            # tr Σ, |G|² and their product (B_simple: a ratio estimator), each in units of the step's |G_small|².
            trace, norm2 = (raw - drift) / (sizes[0] or 1.0), raw_norm2 / (sizes[0] or 1.0)
            for name, value in (("trace", trace), ("norm2", norm2), ("cross", trace * norm2)):
                self.stats.add(f"{name}_exact", value)

    def _decide(self, step: int) -> None:
        """Choose (A1-A3) at the UPPER_Z bounds among the families resolved so far (the others keep p = 1); a family
        that even the opposite (optimistic) bounds keep at p = 1 is probed RARELY until they no longer do."""
        self._fold()
        # An idle family is decided: p = 1.
        s, idle = self.stats, branch_idle(self.stats)
        ready = [f for f in self.families if f in idle or s.count(f"ratio_{f}") >= MIN_SAMPLES - 0.1]
        half = min(s.mean("work_branch") / s.mean("work_exact"), 1.0) if "work_branch" in s.sums else 1.0
        # Decayed counts: 2 samples count 1.9995.
        if s.count("trace_exact") < MIN_SAMPLES - 0.1 or not ready:
            return
        (b_up, r), (b_low, r_low) = self._bounds(UPPER_Z, ready), self._bounds(-UPPER_Z, ready)
        room = [self.curve.room(step, self.max_steps, self.floor, z) for z in (UPPER_Z, -UPPER_Z)]
        prune_branch, prune_position = "branch" in ready and not idle, "position" in ready

        def pick(b_simple: float, ratios: dict, loss_room: float) -> tuple:
            return choose(b_simple, ratios.get("branch", 0.0), ratios.get("position", 0.0), self.batch, self.head,
                          prune_branch, prune_position, half, loss_room)

        choice, hope = pick(b_up, r, room[0]), pick(b_low, r_low, room[1])
        futile = sorted(f for f in ready if f not in idle and hope[("branch", "position").index(f)] == 1.0)
        # The reason's r of an idle family is not measured: say why it is idle instead.
        if idle:
            choice = (*choice[:3], choice[3] + f"; branch idle: a draw at 1/2 saves < {MIN_GAIN:.0%} of the work here")
        last_decided = (self.history or [{}])[-1].get("decided")
        if (choice[:2], ready) != (self.choice[:2], last_decided) or step % 10 == 0:
            self.history.append({
                "step": step, "decided": ready, "b_simple": s.ratio("trace_exact", "norm2_exact", "cross_exact"),
                "b_simple_upper": b_up, "b_simple_lower": b_low, "r_branch": r.get("branch"),
                "r_position": r.get("position"), "branch_half_cost": half, "branch_keep_prob": choice[0],
                "position_keep_prob": choice[1], "probed_rarely": futile, "loss_room": room[0], "reason": choice[3],
            })
        self.choice, self.futile = choice, futile

    def _bounds(self, z: float, ready: list[str]) -> tuple[float, dict]:
        """B_simple and each family's r at their 90% bounds on the pruning-averse side (z < 0: the optimistic side);
        log(r + 1) from probes between exact blocks, its standard error at least the exact blocks' (ProbeLevels)."""
        # One probe's variance.
        spread = 1.5 * self.stats.mean("jitter") if "jitter" in self.stats.sums else 0.0
        r = {f: max(math.exp(self.stats.mean(f"ratio_{f}", z, spread)) - 1, 0.0) for f in ready
             if f"ratio_{f}" in self.stats.sums}
        return self.stats.ratio("trace_exact", "norm2_exact", "cross_exact", z), r
