"""`auto` keep probabilities: the trainer picks `branch_keep_prob` / `position_keep_prob` itself.

The rule: minimise the expected wall-clock to a given loss,

    T(p) ∝ c(p) * (1 + B_simple * (1 + r(p)) / B)                                            (A1)

the critical-batch picture of McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training", Eq. 2.7: steps to
a loss grow like 1 + B_noise / B), with the extra estimator noise of pruning counted as added gradient noise:
r(p) = Var(pruned - exact) / Var(minibatch) per pair. c(p) is the relative cost of a step (token model below), B the
pairs per optimizer step, B_simple = tr(Σ) / |G|² the simple noise scale. Pruning pays when B >> B_simple (1 + r):
then its extra noise is nearly free; when B <~ B_simple it costs steps in proportion.

Among the settings (A1) predicts to cost at most MAX_STEP_INFLATION more steps, the cheapest is chosen; where none
saves MIN_GAIN, everything is kept. The extra steps, Var(pruned - exact) / (B |G|² + tr Σ) (A2), are read at the
one-sided UPPER_Z upper bound of a jackknife over the measurement's groups (one measurement is noisy).

Pure functions of numbers, except `AutoKeepProbs` (owned by the trainer): it measures B_simple and r on a few pairs
of the batch at fixed steps (exact gradients of GROUPS groups and one pruned draw, by `torch.autograd.grad`) and sets
each draw's probabilities *before* that draw, from past measurements and the batch's tokens only (so the estimators
stay unbiased). Near-copy pairs keep both branches: their branch gradients cancel in the pair (docs/quality.md).
"""

import logging
import math
import time
from dataclasses import dataclass, field

import torch

from .config import BRANCH_GRID, POSITION_GRID
from .method.masks import NEAR_COPY, pair_overlap, per_pair_branch_probs
from .reference import select_pairs

logger = logging.getLogger(__name__)

MEASURE_EVERY = 200  # optimizer steps between measurements (the first is at step 0)
MEASURE_PAIRS = 32  # pairs of the current batch a measurement uses, at most
GROUPS = 8  # the measured pairs are split in this many groups (k - 1 degrees of freedom for tr(Σ); the jackknife)
MIN_GAIN = 0.05  # prune only when (A1) predicts at least this saving: the measurements are noisy
# and only where (A1) predicts at most 5% more steps to a loss than the exact gradient, at the UPPER_Z bound of the
# measured noise (B_simple grows as training goes on: docs/quality.md, regimes)
MAX_STEP_INFLATION = 0.05
UPPER_Z = 1.28  # one-sided 90% bound on the extra steps (A2), from the jackknife over groups
EMA = 0.5  # weight of a new measurement in the running estimates


def head_share(config) -> float:
    """Share of a token's forward/backward FLOPs in the LM head, from a transformer config (0 if unknown).

    Per token and layer ~ 4 d² (attention projections) + 3 d f (gated MLP); the head is d V. Only the head's work
    shrinks with position pruning (the trunk still runs every position up to the last kept one)."""
    try:
        d, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
        ffn = getattr(config, "intermediate_size", None) or 4 * d
    except AttributeError:
        return 0.0
    head = d * vocab
    return head / (head + layers * (4 * d * d + 3 * d * ffn))


def relative_step_cost(branch_keep_prob: float, branch_half_cost: float, position_keep_prob: float,
                       head: float) -> float:
    """c(p): a step's work over the unpruned step's. Branch pruning: the expected work is linear in the keep
    probability, through `branch_half_cost`, the work of a draw at p = 1/2 over the exact work on the same pairs,
    *measured* in the plan's token units (forward 1, backward 2, reference forward 1), so it counts whatever the
    forward shares exactly (common prefix, the prompt executed once per pair) and the near-copies that keep both
    branches. Position pruning saves the head's share of what is not scored."""
    branch = 1.0 - 2.0 * (1.0 - branch_keep_prob) * (1.0 - branch_half_cost)
    return branch * (1.0 - head * (1.0 - position_keep_prob))


def extra_noise(r_half: float, keep_prob: float) -> float:
    """r(p) from r measured at p = 1/2: inverse-probability weighting at keep probability p adds variance in
    proportion to (1 - p) / p (Eqs. 1, 3), which is 1 at p = 1/2."""
    return r_half * (1.0 - keep_prob) / keep_prob


def steps_factor(b_simple: float, r: float, batch: int) -> float:
    """1 + B_noise (1 + r) / B: steps to a given loss, relative to infinite batch (McCandlish et al. Eq. 2.7)."""
    return 1.0 + b_simple * (1.0 + r) / batch


def trace_and_norm2(small2: float, big2: float, small: int, big: int) -> tuple[float, float]:
    """tr(Σ) and |G|² per pair from squared gradient norms at `small` and `big` pairs (McCandlish et al. App. A.1):
    E|G_b|² = |G|² + tr(Σ) / b, solved at b = small and b = big."""
    trace = (small2 - big2) / (1.0 / small - 1.0 / big)
    return trace, (big * big2 - small * small2) / (big - small)


def gram_matrix(grads: list[torch.Tensor]) -> list[list[float]]:
    """g_i · g_j of the groups' exact gradients: all the measurement needs of them (B_simple and the (A2) bound)."""
    return [[float(a.dot(b)) for b in grads] for a in grads]


def extra_steps_bound(gram: list[list[float]], extra: list[float], pairs_per_group: int,
                      batch: int) -> tuple[float, float]:
    """(A2) Var(pruned - exact) / (B |G|² + tr Σ) per pair, and its one-sided UPPER_Z upper bound, from k groups of
    `pairs_per_group` pairs: `gram` the products of their exact gradients, `extra` their n |ĝ_i - g_i|² (one pruned
    draw each). The denominator is B E|G_B|², the squared norm of a B-pair minibatch gradient (tr Σ from the spread
    of the groups, McCandlish et al. App. A.1); the bound is a jackknife over the groups (inf when a subsample cannot
    resolve |G|)."""
    k, n = len(gram), pairs_per_group

    def share(groups: list[int]) -> float:
        kk = len(groups)
        small2 = sum(gram[i][i] for i in groups) / kk  # mean |g_i|², n pairs each
        big2 = sum(gram[i][j] for i in groups for j in groups) / kk ** 2  # |mean g_i|², kk n pairs
        trace, norm2 = trace_and_norm2(small2, big2, n, kk * n)
        denominator = batch * norm2 + trace
        return sum(extra[i] for i in groups) / kk / denominator if denominator > 0 else math.inf

    point = share(list(range(k)))
    leave_one_out = [share([i for i in range(k) if i != j]) for j in range(k)]
    if not (math.isfinite(point) and all(map(math.isfinite, leave_one_out))):
        return point, math.inf
    mean = sum(leave_one_out) / k
    error = math.sqrt((k - 1) / k * sum((x - mean) ** 2 for x in leave_one_out))
    return point, point + UPPER_Z * error


@dataclass
class Choice:
    branch_keep_prob: float
    position_keep_prob: float
    time_ratio: float  # (A1) at the choice over (A1) unpruned
    reason: str


def choose(b_simple: float, r_branch: float, r_position: float, batch: int, near_copy_fraction: float, head: float,
           branch_auto: bool, position_auto: bool, branch_half_cost: float = 0.75, r_fixed: float = 0.0,
           branch_fixed: float = 1.0, position_fixed: float = 1.0) -> Choice:
    """Minimise (A1) over the grids (a fixed probability where that family is not "auto"), among the settings that
    (A1) predicts cost at most MAX_STEP_INFLATION more steps than the exact gradient, the noise `r_fixed` of the
    user's fixed families included (so where that alone is over the limit, "auto" adds nothing): a run keeps its
    quality at equal steps, and time is saved only where pruning's noise is cheap.
    Pruning must also win by MIN_GAIN, else the exact setting is kept. Near-copy pairs keep both branches whatever is
    chosen; their share is in `branch_half_cost` (measured) and scales the branch noise."""
    branches = BRANCH_GRID if branch_auto else (branch_fixed,)
    positions = POSITION_GRID if position_auto else (position_fixed,)
    exact = (1.0 if branch_auto else branch_fixed, 1.0 if position_auto else position_fixed)
    if not math.isfinite(b_simple):
        return Choice(*exact, 1.0, "keep everything: on the measured pairs the gradient noise hides the mean gradient "
                                   "(B_simple too large to resolve, far above the batch)")
    half_cost = branch_half_cost if branch_auto else 1.0

    def noise(pb, pp):
        far = 1.0 - near_copy_fraction
        return r_fixed + (far * extra_noise(r_branch, pb) if branch_auto else 0.0) + \
            (extra_noise(r_position, pp) if position_auto else 0.0)

    def cost(pb, pp):
        return relative_step_cost(pb if branch_auto else 1.0, half_cost, pp, head)

    def expected(pb, pp):
        return cost(pb, pp) * steps_factor(b_simple, noise(pb, pp), batch)

    base = expected(*exact)
    best, best_value = exact, base
    for pb in sorted(branches, reverse=True):
        for pp in sorted(positions, reverse=True):
            value = expected(pb, pp)
            inflation = steps_factor(b_simple, noise(pb, pp), batch) / steps_factor(b_simple, 0.0, batch)
            if value < best_value * (1.0 - 1e-9) and value <= base * (1.0 - MIN_GAIN) and \
                    inflation <= 1.0 + MAX_STEP_INFLATION:
                best, best_value = (pb, pp), value
    work = cost(*best) / cost(*exact)
    verdict = "prune" if best != exact else \
        f"keep everything (no setting saves {MIN_GAIN:.0%} within +{MAX_STEP_INFLATION:.0%} steps)"
    steps = steps_factor(b_simple, noise(*best), batch) / steps_factor(b_simple, 0.0, batch)
    reason = (f"{verdict}: gradient noise scale B_simple {b_simple:.1f} vs {batch} pairs per step; pruning at 0.5 adds "
              f"{r_branch:.2f}x (branch) and {r_position:.2f}x (position) the minibatch noise"
              f"{f', your fixed settings {r_fixed:.2f}x' if r_fixed else ''}; "
              f"{near_copy_fraction:.0%} near-copy pairs keep both branches; predicted steps x{steps:.2f}, work per "
              f"step x{work:.2f}, time to a loss x{best_value / base:.2f}")
    return Choice(best[0], best[1], best_value / base, reason)


@dataclass
class NoiseEstimates:
    """Running (EMA) estimates, all per pair: |G_small|², |G_big|² at pair counts small/big (McCandlish App. A.1),
    and the extra variance of one pruned draw (m |Ĝ - G|², per family)."""

    small2: float | None = None
    big2: float | None = None
    small: int = 0
    big: int = 0
    extra: dict = field(default_factory=dict)

    def update(self, name: str, value: float):
        old = getattr(self, name) if name in ("small2", "big2") else self.extra.get(name)
        new = value if old is None else (1 - EMA) * old + EMA * value
        if name in ("small2", "big2"):
            setattr(self, name, new)
        else:
            self.extra[name] = new

    def trace_sigma(self) -> float:
        return trace_and_norm2(self.small2, self.big2, self.small, self.big)[0]

    def b_simple(self) -> float:
        if self.small2 is None:
            return math.inf
        trace, g2 = trace_and_norm2(self.small2, self.big2, self.small, self.big)
        if g2 <= 0 or trace <= 0:  # noise dominates what one batch can resolve: treat as noise-bound
            return math.inf
        return trace / g2

    def ratio(self, family: str) -> float:
        trace = self.trace_sigma() if self.small2 is not None else 0.0
        if family not in self.extra or trace <= 0:
            return math.inf
        return self.extra[family] / trace


class AutoKeepProbs:
    """Owned by the trainer when a keep probability is "auto": measures, chooses, and logs why."""

    def __init__(self, args, model_config, loss):
        """`loss(model, inputs)`: the package's own training loss (not a subclass's: its bookkeeping must not see the
        measurement as a step), under the trainer's `_forced_mask_options`."""
        self.loss = loss
        self.branch_auto = args.branch_keep_prob == "auto"
        self.position_auto = args.position_keep_prob == "auto"
        self.args = args
        self.head = head_share(model_config)
        self.batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * max(args.world_size, 1)
        self.noise = NoiseEstimates()
        self.upper_factor: dict[str, float] = {}  # per family: (A2)'s upper bound over its point estimate, last measured
        self.branch_half_cost = 1.0  # measured work of a branch draw at p = 1/2 over the exact work (relative_step_cost)
        self.position_head_too_small = False  # then position pruning is neither measured nor chosen
        self.choice = Choice(1.0, 1.0, 1.0, "before the first measurement: keep everything")
        self.measure_seconds = 0.0
        self.measure_tokens = 0  # work of the measurements in the trainer's token units (forward 1, backward 2)
        self.history: list[dict] = []
        self._measured_step = -1

    # ------------------------------------------------------------------------------------------------ measurement
    def _gradient(self, trainer, model, inputs, options: dict) -> tuple[torch.Tensor, int]:
        """The flat gradient of the package's loss under `options`, and the work it took (token units)."""
        params = [p for p in model.parameters() if p.requires_grad]
        trainer._forced_mask_options = options
        try:
            loss = self.loss(model, inputs)
        finally:
            trainer._forced_mask_options = None
        stats = trainer.last_prune_stats
        work = stats.get("policy_tokens_executed", 0) + 2 * stats.get("grad_tokens_executed", 0) \
            + stats.get("reference_tokens_executed", 0)
        self.measure_tokens += work
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        # float32: a measurement holds GROUPS of these (4 bytes per trainable parameter each); the rounding of their
        # products is far below the sampling noise the measurement estimates
        flat = torch.cat([(g if g is not None else torch.zeros_like(p)).flatten().float() for g, p in
                          zip(grads, params)])
        return flat, work

    def _fixed_families_prune(self, base_options: dict) -> bool:
        return (not self.branch_auto and float(base_options["branch_keep_prob"]) < 1.0) or \
            (not self.position_auto and float(base_options["position_keep_prob"]) < 1.0) or \
            base_options["prefix_prune_prob"] > 0.0

    def measure(self, trainer, model, inputs, base_options: dict, generator: torch.Generator):
        """Exact gradients on GROUPS disjoint groups of up to MEASURE_PAIRS pairs (B_simple), and on the same pairs
        one pruned draw per "auto" family at p = 1/2 (its r, and for branches its work), plus one draw at the user's
        fixed probabilities when those prune (their r, counted by every choice). Trainer metrics and counters are
        restored afterwards."""
        started = time.perf_counter()
        pairs = inputs["input_ids"].size(0) // 2
        groups = min(GROUPS, pairs)
        m = min(MEASURE_PAIRS, pairs) // groups * groups
        if groups < 2:
            return
        metrics = {k: len(v) for k, v in trainer._metrics["train"].items()}
        stats, masks = dict(trainer.last_prune_stats), getattr(trainer, "_last_masks", None)
        exact = {**base_options, "position_keep_prob": 1.0, "prefix_prune_prob": 0.0, "branch_keep_prob": 1.0,
                 "generator": generator}
        index = torch.randperm(pairs, generator=generator)[:m]
        chunks = [select_pairs(inputs, chunk, pairs) for chunk in index.chunk(groups)]
        per_group = [self._gradient(trainer, model, chunk, exact) for chunk in chunks]
        exact_grads = [grad for grad, _ in per_group]
        exact_work = sum(work for _, work in per_group)
        gram = gram_matrix(exact_grads)
        # McCandlish et al. App. A.1 with small = m / k pairs (the mean over groups) and big = m pairs.
        n = m // groups
        self.noise.small, self.noise.big = n, m
        self.noise.update("small2", sum(gram[i][i] for i in range(groups)) / groups)  # mean |g_i|²
        self.noise.update("big2", sum(map(sum, gram)) / groups ** 2)  # |mean g_i|²

        def draw(family: str, options, scale: float = 1.0):
            """One draw over the m pairs, run in the same groups as the exact gradients (per-pair masks: the same law
            as one draw over all m; the same packing, so its work compares with `exact_work`): the family's extra
            variance per pair (over `scale`), its (A2) bound, and the draw's work."""
            extra, work = [], 0
            for chunk, exact_grad in zip(chunks, exact_grads):
                pruned, chunk_work = self._gradient(trainer, model, chunk, {**exact, **options(chunk)})
                extra.append(n * float((pruned - exact_grad).pow(2).sum()) / scale)
                work += chunk_work
            self.noise.update(family, sum(extra) / groups)
            point, upper = extra_steps_bound(gram, extra, n, self.batch)
            self.upper_factor[family] = upper / point if point > 0 else 1.0
            return work

        both = select_pairs(inputs, index, pairs)
        # A family that cannot save MIN_GAIN is not measured: all near-copies (no branch is ever frozen), or an LM head
        # too small a share of the work for position pruning to matter; it is then kept at 1 with no extra noise.
        overlap = pair_overlap(both["input_ids"], both["completion_mask"])
        far = float((overlap < NEAR_COPY).double().mean())
        if self.branch_auto and far > 0:
            # per pair of the pairs that are pruned (near-copies add no extra noise)
            work = draw("branch", lambda chunk: {"branch_keep_prob": per_pair_branch_probs(
                pair_overlap(chunk["input_ids"], chunk["completion_mask"]), 0.5)}, scale=far)
            self.branch_half_cost = work / max(exact_work, 1)
        elif self.branch_auto:
            self.noise.update("branch", 0.0)
            self.branch_half_cost = 1.0
        if self.position_auto and self.head * (1.0 - min(POSITION_GRID)) >= MIN_GAIN:
            draw("position", lambda chunk: {"position_keep_prob": 0.5})
        elif self.position_auto:
            self.noise.update("position", 0.0)
            self.position_head_too_small = True
        if self._fixed_families_prune(base_options):
            fixed = {**base_options, "generator": generator}
            for name in ("branch", "position"):
                if getattr(self, f"{name}_auto"):
                    fixed[f"{name}_keep_prob"] = 1.0
            # one draw over all m pairs: a prefix cut is one per micro-batch, and its noise depends on the batch's size
            pruned, _ = self._gradient(trainer, model, both, fixed)
            pruned -= sum(exact_grads) / groups
            self.noise.update("fixed", m * float(pruned.pow(2).sum()))
        for k, v in trainer._metrics["train"].items():
            del v[metrics.get(k, 0):]
        trainer.last_prune_stats, trainer._last_masks = stats, masks
        self.measure_seconds += time.perf_counter() - started

    # ----------------------------------------------------------------------------------------------------- choice
    def options(self, trainer, model, inputs, base_options: dict, step: int, micro_step: int, generator) -> dict:
        """`base_options` with every "auto" probability replaced: per-pair branch probabilities, a float position
        probability. Measures first when this step is due (micro-step 0 of steps 0, MEASURE_EVERY, ...)."""
        if micro_step == 0 and step % MEASURE_EVERY == 0 and step != self._measured_step:
            self._measured_step = step
            self.measure(trainer, model, inputs, base_options, generator)
            self._decide(inputs, step)
        overlap = pair_overlap(inputs["input_ids"], inputs["completion_mask"])
        options = dict(base_options)
        if self.branch_auto:
            options["branch_keep_prob"] = per_pair_branch_probs(overlap, self.choice.branch_keep_prob)
        if self.position_auto:
            options["position_keep_prob"] = self.choice.position_keep_prob
        branch = options["branch_keep_prob"]
        trainer._metrics["train"]["prune/branch_keep_prob"].append(
            float(branch.mean()) if torch.is_tensor(branch) else float(branch))
        trainer._metrics["train"]["prune/position_keep_prob"].append(float(options["position_keep_prob"]))
        trainer._metrics["train"]["prune/auto_b_simple"].append(min(self.noise.b_simple(), 1e9))
        return options

    def _decide(self, inputs, step: int):
        overlap = pair_overlap(inputs["input_ids"], inputs["completion_mask"])
        near = float((overlap >= NEAR_COPY).double().mean())
        b_simple = self.noise.b_simple()
        points = {family: self.noise.ratio(family) if getattr(self, f"{family}_auto") else 0.0
                  for family in ("branch", "position")}
        # the choice reads each ratio at its (A2) upper bound: r scales (A2) linearly at a given B_simple
        bounds = {family: r * self.upper_factor.get(family, 1.0) if r > 0 else r for family, r in points.items()}
        r_branch, r_position = bounds["branch"], bounds["position"]
        r_fixed = self.noise.ratio("fixed") if "fixed" in self.noise.extra else 0.0
        if not (math.isfinite(r_branch) and math.isfinite(r_position) and math.isfinite(r_fixed)):
            b_simple = math.inf
        fixed_b = 1.0 if self.branch_auto else float(self.args.branch_keep_prob)
        fixed_p = 1.0 if self.position_auto else float(self.args.position_keep_prob)
        position_auto = self.position_auto and not self.position_head_too_small
        self.choice = choose(b_simple, r_branch, r_position, self.batch, near, self.head, self.branch_auto,
                             position_auto, self.branch_half_cost, r_fixed, fixed_b, fixed_p)
        if self.position_auto and not position_auto:
            self.choice.reason += (f"; position kept at 1, not measured: the LM head is {self.head:.0%} of the work, "
                                   f"too little for position pruning to save {MIN_GAIN:.0%}")
        if any(r > 0 for r in points.values()):
            self.choice.reason += (f"; the noise ratios are {1 - 0.5 * math.erfc(UPPER_Z / math.sqrt(2.0)):.0%} upper bounds from {GROUPS} groups "
                                   f"(point estimates: branch {points['branch']:.2f}, position "
                                   f"{points['position']:.2f})")
        record = {"step": step, "b_simple": b_simple, "r_branch": r_branch, "r_position": r_position,
                  "r_branch_point": points["branch"], "r_position_point": points["position"],
                  "r_fixed": r_fixed, "branch_half_cost": self.branch_half_cost, "near_copy_fraction": near,
                  "branch_keep_prob": self.choice.branch_keep_prob,
                  "position_keep_prob": self.choice.position_keep_prob, "time_ratio": self.choice.time_ratio,
                  "reason": self.choice.reason, "measure_seconds": self.measure_seconds,
                  "measure_tokens": self.measure_tokens}
        self.history.append(record)
        logger.info(f"auto keep probabilities at step {step}: branch {self.choice.branch_keep_prob} (near-copies 1.0), "
                    f"position {self.choice.position_keep_prob}. Why: {self.choice.reason}.")
