"""The noise-scale arithmetic of `auto` (docs/method.md, "auto", Eqs. A1-A4): functions of numbers, and the few
numbers they keep between steps (running sums, the loss curve, the B / 2B pairs, the exact blocks around a probe).

McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training"): B_simple = tr Σ / |G|² from squared gradient
norms at two batch sizes (App. A.1), steps to a loss ∝ 1 + B_noise / B (Eq. 2.7); pruning's extra variance counted as
added noise, r(p) per pair over tr Σ; the loss curve bounds what extra steps cost by the end of the run (A3). auto.py
measures (tensors); this module estimates and chooses (floats).
"""

import math
from typing import Any

from ..config import BRANCH_GRID, POSITION_GRID

# The saving required, the extra steps allowed, and a one-sided 90% bound.
MIN_GAIN, MAX_STEP_INFLATION, UPPER_Z = 0.05, 0.05, 1.28
# The weight of the past per measured sample in the running sums (~33 samples of memory).
DECAY = 0.97
# For (A3): the share of the loss gained so far that pruning may give up, and the recent steps it reads.
MAX_LOSS_GIVEN_UP, LOSS_WINDOW = 0.1, 8
# The r + 1 of a probe whose tr Σ (or its neighbours') the drift hides: prune at no probability.
UNRESOLVED = 10.0


def student(z: float, dof: float) -> float:
    """Student's t quantile at the normal quantile z for `dof` degrees of freedom (Cornish-Fisher, three terms: within
    4% from one degree of freedom on): a bound read from few samples is as wide as they allow."""
    d = max(dof, 1.0)
    return (z + (z ** 3 + z) / (4 * d) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * d ** 2)
            + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * d ** 3))


def head_share(config: Any) -> float:
    """Share of a token's FLOPs in the LM head (d V against ~4 d² + 3 d f per layer); 0 if unknown."""
    d, layers, vocab = (getattr(config, k, None) for k in ("hidden_size", "num_hidden_layers", "vocab_size"))
    if None in (d, layers, vocab):
        return 0.0
    ffn = getattr(config, "intermediate_size", None) or 4 * d
    return d * vocab / (d * vocab + layers * (4 * d * d + 3 * d * ffn))


def relative_step_cost(branch_keep_prob: float, branch_half_cost: float, position_keep_prob: float,
                       head: float) -> float:
    """c(p): linear in the branch keep probability through the measured work of a draw at 1/2 over the exact work;
    position pruning saves the head's share of what is not scored."""
    return (1.0 - 2.0 * (1.0 - branch_keep_prob) * (1.0 - branch_half_cost)) * (1.0 - head * (1.0 - position_keep_prob))


# Inverse-probability weights: ∝ (1 - p) / p (Eqs. 1, 3).
def extra_noise(r_half: float, keep_prob: float) -> float:
    return r_half * (1.0 - keep_prob) / keep_prob


# The factor 1 + B_noise (1 + r) / B on the steps (McCandlish Eq. 2.7).
def steps_factor(b_simple: float, r: float, batch: int) -> float:
    return 1.0 + b_simple * (1.0 + r) / batch


def trace_and_norm2(small2: float, big2: float, small: float, big: float) -> tuple[float, float]:
    """tr Σ and |G|² from E|G_b|² = |G|² + tr Σ / b at b = small and big (McCandlish et al. App. A.1)."""
    return (small2 - big2) / (1.0 / small - 1.0 / big), (big * big2 - small * small2) / (big - small)


def pair_drift(link: float, first: float, second: float) -> float:
    """|d|², the change of the mean gradient per step squared, from two consecutive B / 2B pairs (steps t, t+1 and
    t+2, t+3) under a linear drift (Eq. A4): within a pair E|g_t - g_(t+1)|² = |d|² + 2 tr Σ_t / b (`first`,
    `second`); across them E|g_(t+2) - g_t|² = 4 |d|² + (tr Σ_t + tr Σ_(t+2)) / b (`link`)."""
    return (link - (first + second) / 2) / 3


class PairedSteps:
    """The B / 2B path (one process, no accumulation): a pair of consecutive steps t, t+1 of one kind is a batch of b
    and one of 2b; linked to the previous pair by |g_t - g_(t-2)|², it also gives the mean gradient's drift that
    b |g_t - g_(t+1)|² / 2 includes besides tr Σ (Eq. A4). `carried`: the drift read before a checkpoint, for the
    first pair after it (its link's gradient is not saved). A pair whose two steps hold different numbers of pairs (an
    epoch's short last step) is not a b / 2b pair: no sample, and no link for the next."""

    def __init__(self, carried: float | None = None):
        # `first`: [|g_t|², t, kind, pairs, link] of a pair's first step; `last`: [t, within].
        self.first, self.last = None, None
        self.carried, self.latest = carried, None

    def add(self, step: int, kind: str, small2: float, diff2: float, pairs: float):
        """A step's |g|² and its squared distance to the pair's first step (on a first step: to the previous pair's,
        the link) -> (the four arguments of trace_and_norm2, the drift in tr Σ's units or None) once a pair is
        whole."""
        if step % 2 == 0:
            link = diff2 if self.last and self.last[0] == step - 2 else None
            self.first = [small2, step, kind, pairs, link]
            return None, None
        if self.first is None or self.first[1:4] != [step - 1, kind, pairs]:
            return None, None
        (first, *_, link), self.first = self.first, None
        # `within` is |g_t - g_(t+1)|²; |g_t + g_(t+1)|² = 2 |g_t|² + 2 |g_(t+1)|² - within.
        within = diff2
        drift = self.carried if link is None else pairs * pair_drift(link, self.last[1], within) / 2
        self.last, self.carried, self.latest = [step - 1, within], None, drift
        return ((first + small2) / 2, (2 * (first + small2) - within) / 4, pairs, 2 * pairs), drift

    def split(self) -> "PairedSteps":
        """A fresh one at a checkpoint: the pair it splits yields no sample; the next reads the drift before it."""
        return PairedSteps(self.latest if self.latest is not None else self.carried)


def log_trace(raw: float, drift: float) -> float | None:
    """A block's log tr Σ, its estimate less the drift (Eq. A4; 0 on the engine path); None (unresolved) if <= 0."""
    return math.log(raw - drift) if raw > drift else None


def probe_sample(probe: float | None, before: float | None, after: float | None) -> float:
    """log(r + 1) of one probe: its log tr Σ less the mean of the exact blocks' on either side of it (a scale all
    three share cancels to first order); log UNRESOLVED where any of them is unresolved."""
    return math.log(UNRESOLVED) if None in (probe, before, after) else probe - (before + after) / 2


class ProbeLevels:
    """The last three exact blocks' log tr Σ (None: unresolved) and a probe block waiting for the exact block after
    it: each probe's log(r + 1) sample, `ratio_<family>`, and the exact blocks' `jitter`, into a Running."""

    def __init__(self, state: dict | None = None):
        self.levels, self.probe = list((state or {}).get("levels", [])), (state or {}).get("probe")

    def state_dict(self) -> dict:
        return {"levels": self.levels, "probe": self.probe}

    def add(self, stats: "Running", kind: str, level: float | None):
        if kind == "exact":
            if self.probe:
                stats.add(f"ratio_{self.probe[1]}", probe_sample(self.probe[0], self.levels[-1], level))
            self.probe, self.levels = None, [*self.levels[-2:], level]
            if (jitter := level_jitter(self.levels)) is not None:
                stats.add("jitter", jitter)
        elif self.levels:
            # The probe waits for the next exact block.
            self.probe = [level, kind]


def level_jitter(levels: list) -> float | None:
    """σ² of one block's log tr Σ, from three consecutive exact blocks: (l1 - 2 l2 + l3)² / 6 (a linear trend
    cancels). A probe sample has 1.5 σ²: its bound is never read narrower than that, whatever two probes happen to
    show."""
    return None if len(levels) < 3 or None in levels else (levels[0] - 2 * levels[1] + levels[2]) ** 2 / 6


def branch_idle(stats: "Running") -> set:
    """{"branch"} where a branch draw saves less than MIN_GAIN of an exact step's work, 90% sure (near-copies keep both
    branches): a property of the data, not of the run's progress, so no keep probability will ever pay, and the
    family's probes, which cost accuracy, stop."""
    return {"branch"} if stats.count("work_branch") > 1.9 and stats.mean("work_branch", -UPPER_Z) > (
        1 - MIN_GAIN) * stats.mean("work_exact") else set()


def choose(b_simple: float, r_branch: float, r_position: float, batch: int, head: float, branch_auto: bool,
           position_auto: bool, branch_half_cost: float = 0.75,
           room: float = 0.0) -> tuple[float, float, float, str]:
    """(branch p, position p, time ratio, reason): (A1) minimised over the grids within +MAX_STEP_INFLATION steps; where
    the loss curve allows more (`room`, LossCurve.room: 1 - 1/f up to it, A3), the least work per step within it."""
    # Equal steps: the curve has flattened (A3).
    flat = room > 1 - 1 / (1 + MAX_STEP_INFLATION)
    if not (math.isfinite(b_simple) or flat):
        return 1.0, 1.0, 1.0, "keep everything: the noise scale is not resolved yet"
    noise = lambda pb, pp: extra_noise(r_branch, pb) + extra_noise(r_position, pp)  # noqa: E731
    cost = lambda pb, pp: relative_step_cost(pb, branch_half_cost, pp, head)  # noqa: E731
    # steps to a loss over the exact gradient's, (A1)'s factor; as B_simple grows without bound, 1 + r
    steps = lambda pb, pp: (steps_factor(b_simple, noise(pb, pp), batch) / steps_factor(b_simple, 0.0, batch)  # noqa
                            if math.isfinite(b_simple) else 1 + noise(pb, pp))
    time = lambda pb, pp: cost(pb, pp) * steps(pb, pp)  # noqa: E731
    goal, best = (cost if flat else time), (1.0, 1.0)
    for pb in sorted(BRANCH_GRID if branch_auto else (1.0,), reverse=True):
        for pp in sorted(POSITION_GRID if position_auto else (1.0,), reverse=True):
            inflation = steps(pb, pp)
            within = inflation <= 1 + MAX_STEP_INFLATION or (flat and 1 - 1 / inflation <= room)
            if within and goal(pb, pp) < min(goal(*best) * (1 - 1e-9), goal(1.0, 1.0) * (1 - MIN_GAIN)):
                best = (pb, pp)
    rule = f"loss given up <= {MAX_LOSS_GIVEN_UP:.0%} of the loss gained" if flat else "+5% steps"
    verdict = "prune" if best != (1.0, 1.0) else f"keep everything (none saves {MIN_GAIN:.0%} within {rule})"
    return (*best, time(*best), f"{verdict}: B_simple <= {b_simple:.1f} vs {batch} pairs per step; at 1/2 "
            f"branch adds <= {r_branch:.2f}x, position <= {r_position:.2f}x the minibatch noise; work per step "
            f"x{cost(*best):.2f}, time to a loss x{time(*best):.2f}" + (
                f", steps to a loss x{1 / (1 - room):.2f} allowed by the flat loss curve" if flat and room < 1 else
                ", any steps allowed by the flat loss curve" if flat else ""))


class LossCurve:
    """The training loss of each optimizer step (reduced over ranks): its start, and its recent level and rate as
    one-sided UPPER_Z bounds from a least-squares line over the last LOSS_WINDOW steps (A3)."""

    def __init__(self, state: dict | None = None):
        self.start, self.recent = list((state or {}).get("start", [])), list((state or {}).get("recent", []))

    def state_dict(self) -> dict:
        return {"start": self.start, "recent": self.recent}

    def add(self, step: int, loss: float):
        if math.isfinite(loss):
            self.start = self.start if len(self.start) >= 2 else [*self.start, loss]
            self.recent = [*self.recent, [step, loss]][-LOSS_WINDOW:]

    def room(self, step: int, max_steps: int, floor: float | None, z: float = UPPER_Z) -> float:
        """(A3) The largest 1 - 1/f, f the steps to a loss over the exact gradient's, at which pruning from `step` on
        gives up at most MAX_LOSS_GIVEN_UP of the loss gained since the start by step `max_steps`: on a convex curve
        that is at most (1 - 1/f) R, R what the exact run can still gain, at most its rate now times the steps left
        and, for a loss bounded below by `floor`, the distance to it. 0 before LOSS_WINDOW steps; inf if R <= 0."""
        if len(self.recent) < LOSS_WINDOW or max_steps <= step:
            return 0.0
        n, (s, loss) = len(self.recent), zip(*self.recent)
        s_mean, l_mean = sum(s) / n, sum(loss) / n
        sxx = sum((x - s_mean) ** 2 for x in s)
        slope = sum((x - s_mean) * (y - l_mean) for x, y in zip(s, loss)) / sxx
        var = sum((y - l_mean - slope * (x - s_mean)) ** 2 for x, y in zip(s, loss)) / (n - 2)
        z = student(z, n - 2)
        now = l_mean + slope * (s[-1] - s_mean) + z * math.sqrt(var * (1 / n + (s[-1] - s_mean) ** 2 / sxx))
        rate = -slope + z * math.sqrt(var / sxx)
        # A rising curve is not the convex, falling curve (A3) reads.
        if rate <= 0:
            return 0.0
        rest = rate * (max_steps - step) if floor is None else min(rate * (max_steps - step), max(now - floor, 0.0))
        gained = sum(self.start) / len(self.start) - now
        return 0.0 if gained <= 0 else math.inf if rest <= 0 else MAX_LOSS_GIVEN_UP * gained / rest


class Running:
    """Decayed sums per quantity: mean, and standard error from the spread and the effective sample count."""

    def __init__(self, state: dict | None = None):
        # `sums`: name -> [Σ w, Σ w², Σ w x, Σ w x²], w = DECAY^age.
        self.sums = dict(state or {})

    def add(self, name: str, x: float) -> None:
        sums = self.sums.get(name, [0.0, 0.0, 0.0, 0.0])
        # The weights (Σ w, Σ w²) and the weighted moments (Σ w x, Σ w x²) age by one sample; x enters with w = 1.
        w, w2 = sums[:2]
        sx, sxx = sums[2:]
        self.sums[name] = [DECAY * w + 1, DECAY ** 2 * w2 + 1, DECAY * sx + x, DECAY * sxx + x * x]

    def count(self, name: str) -> float:
        # The effective number of samples.
        w, w2 = self.sums.get(name, [0.0, 1.0, 0.0, 0.0])[:2]
        return w * w / w2

    def mean(self, name: str, z: float = 0.0, spread: float = 0.0) -> float:
        # `z`: a normal quantile, the bound being Student's t at the samples' degrees of freedom; `spread`: a known
        # floor on one sample's variance.
        sums = self.sums[name]
        w = sums[0]
        sx, sxx = sums[2:]
        mean, dof = sx / w, max(self.count(name) - 1, 1)
        return mean + student(z, dof) * math.sqrt(max(sxx / w - mean * mean, 0.0, spread) / dof)

    def ratio(self, num: str, den: str, cross: str, z: float = 0.0) -> float:
        """mean(num) / mean(den) of quantities added together (`cross`: their product), z standard errors above
        (below, if negative) by the delta method: from the spread of num - R den, so that a scale both share (the
        gradient norms shrinking as training goes on) cancels; an unresolved mean(den) shows as a wide spread. inf
        (0 if z < 0) while mean(den) <= 0."""
        (w, _, sn, snn), (_, _, sd, sdd), sc = self.sums[num], self.sums[den], self.sums[cross][2]
        if sd <= 0:
            return math.inf if z >= 0 else 0.0
        ratio = sn / sd
        # E (num - R den)², its mean being 0.
        spread = max(snn - 2 * ratio * sc + ratio * ratio * sdd, 0.0) / w
        dof = max(self.count(num) - 1, 1)
        return max(ratio + student(z, dof) * math.sqrt(spread / dof) / (sd / w), 0.0)
