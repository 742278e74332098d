"""The noise-scale arithmetic of `auto` (docs/method.md, "auto", Eqs. A1-A2): pure functions of numbers.

McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training"): B_simple = tr Σ / |G|² from squared gradient
norms at two batch sizes (App. A.1), steps to a loss ∝ 1 + B_noise / B (Eq. 2.7); pruning's extra variance counted as
added noise, r(p) per pair over tr Σ. auto.py measures; this module estimates and chooses.
"""

import math

from ..config import BRANCH_GRID, POSITION_GRID

MIN_GAIN, MAX_STEP_INFLATION, UPPER_Z = 0.05, 0.05, 1.28  # saving required; extra steps allowed; one-sided 90% bound
DECAY = 0.97  # weight of the past per measured sample in the running sums (~33 samples of memory)


def head_share(config) -> float:
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


def extra_noise(r_half: float, keep_prob: float) -> float:  # inverse-probability weights: ∝ (1 - p) / p (Eqs. 1, 3)
    return r_half * (1.0 - keep_prob) / keep_prob


def steps_factor(b_simple: float, r: float, batch: int) -> float:  # 1 + B_noise (1 + r) / B (McCandlish Eq. 2.7)
    return 1.0 + b_simple * (1.0 + r) / batch


def trace_and_norm2(small2: float, big2: float, small: float, big: float) -> tuple[float, float]:
    """tr Σ and |G|² from E|G_b|² = |G|² + tr Σ / b at b = small and big (McCandlish et al. App. A.1)."""
    return (small2 - big2) / (1.0 / small - 1.0 / big), (big * big2 - small * small2) / (big - small)


def choose(b_simple, r_branch, r_position, batch, head, branch_auto, position_auto, branch_half_cost=0.75):
    """(branch p, position p, time ratio, reason): (A1) minimised over the grids within +MAX_STEP_INFLATION steps."""
    if not math.isfinite(b_simple):
        return 1.0, 1.0, 1.0, "keep everything: the noise scale is not resolved yet"
    noise = lambda pb, pp: extra_noise(r_branch, pb) + extra_noise(r_position, pp)  # noqa: E731
    cost = lambda pb, pp: relative_step_cost(pb, branch_half_cost, pp, head)  # noqa: E731
    time = lambda pb, pp: cost(pb, pp) * steps_factor(b_simple, noise(pb, pp), batch)  # noqa: E731
    best, base = (1.0, 1.0), time(1.0, 1.0)
    for pb in sorted(BRANCH_GRID if branch_auto else (1.0,), reverse=True):
        for pp in sorted(POSITION_GRID if position_auto else (1.0,), reverse=True):
            inflation = steps_factor(b_simple, noise(pb, pp), batch) / steps_factor(b_simple, 0.0, batch)
            cheaper = time(pb, pp) < min(time(*best) * (1 - 1e-9), base * (1 - MIN_GAIN))
            if cheaper and inflation <= 1 + MAX_STEP_INFLATION:
                best = (pb, pp)
    verdict = "prune" if best != (1.0, 1.0) else f"keep everything (none saves {MIN_GAIN:.0%} within +5% steps)"
    return (*best, time(*best) / base, f"{verdict}: B_simple <= {b_simple:.1f} vs {batch} pairs per step; at 1/2 "
            f"branch adds <= {r_branch:.2f}x, position <= {r_position:.2f}x the minibatch noise; work per step "
            f"x{cost(*best):.2f}, time to a loss x{time(*best) / base:.2f}")


class Running:
    """Decayed sums per quantity: mean, and standard error from the spread and the effective sample count."""

    def __init__(self, state=None):  # name -> [Σ w, Σ w², Σ w x, Σ w x²], w = DECAY^age
        self.sums = dict(state or {})

    def add(self, name, x):
        w, w2, sx, sxx = self.sums.get(name, [0.0, 0.0, 0.0, 0.0])
        self.sums[name] = [DECAY * w + 1, DECAY ** 2 * w2 + 1, DECAY * sx + x, DECAY * sxx + x * x]

    def count(self, name):  # effective number of samples
        w, w2, _, _ = self.sums.get(name, [0.0, 1.0, 0.0, 0.0])
        return w * w / w2

    def mean(self, name, z=0.0):  # z: that many standard errors above (below, if negative) the mean
        w, w2, sx, sxx = self.sums[name]
        mean = sx / w
        return mean + z * math.sqrt(max(sxx / w - mean * mean, 0.0) / max(self.count(name) - 1, 1))

    def ratio(self, num, den, cross, z=0.0):
        """mean(num) / mean(den) of quantities added together (`cross`: their product), z standard errors above
        (below, if negative) by the delta method: from the spread of num - R den, so that a scale both share (the
        gradient norms shrinking as training goes on) cancels; an unresolved mean(den) shows as a wide spread. inf
        (0 if z < 0) while mean(den) <= 0."""
        (w, _, sn, snn), (_, _, sd, sdd), sc = self.sums[num], self.sums[den], self.sums[cross][2]
        if sd <= 0:
            return math.inf if z >= 0 else 0.0
        ratio = sn / sd
        spread = max(snn - 2 * ratio * sc + ratio * ratio * sdd, 0.0) / w  # E (num - R den)², its mean being 0
        return max(ratio + z * math.sqrt(spread / max(self.count(num) - 1, 1)) / (sd / w), 0.0)
