"""The `prune/*` metrics, and TRL's stock-named metrics re-estimated or renamed where pruning changes what they mean.

Stock-named metrics stay only where their value is stock's or their expectation over the masks is: the per-branch sums
(logps, rewards, margins) and the per-token means (entropy, logits, token accuracy) are Horvitz-Thompson sums over
exact counts (docs/method.md, Eqs. 1-2). The others are logged once, under `prune/` names that say what they are. The
MoE router loss keeps its stock name, `aux_loss`: it is the aux loss this run adds to its loss (the grad rows' own),
as `loss` is the loss at the estimate. The plugin's diagnostics (`DEBUG_KEYS`, and fractions that are 1 under the
run's settings) are logged only with `prune_log_level="debug"`. Every key, and why it is exact or an estimate:
docs/metrics.md.

A micro-step's record (`MicroStepRecord`: its masks, counts, auxiliary loss and run means) is handed in by the trainer;
nothing here reads the trainer. No device->host read per micro-step: each micro-step's counts stay on the device, and
TRL's metric lists hold a `Pending` entry for each value derived from them. `PendingMetrics` owns those counts: its
`flush` resolves every pending entry with one gather and one read, when TRL logs (`PrunedDPOTrainer.log`) or a
checkpoint saves the logging window, so the plugin's metrics ride on the logging step. Outside `train()` (a direct
`compute_loss` call) they are resolved at once.
"""

import dataclasses

import torch

from .config import AUTO
from .method.masks import PruneMasks

_COUNTS = ("positions_scored", "response_positions", "policy_tokens_executed", "grad_tokens_executed", "full_tokens",
           "grad_rows", "rows")
# Diagnostics, logged only with `prune_log_level="debug"`: auto's internals (the keep probabilities it drew with, whose
# effect the work fractions show at "info", and its noise scale) and the cost model's choice.
DEBUG_KEYS = frozenset({"prune/branch_keep_prob", "prune/position_keep_prob", "prune/auto_b_simple",
                        "prune/pairs_shared"})
# Index of each value in a micro-step's counts vector; the second line's only with `prune_common_prefix`.
SCORED, RESPONSE, EXECUTED, GRAD_TOKENS, FULL, GRAD_ROWS, ROWS, TOP1, CHOSEN = range(9)
ENTROPY, EXACT, LOGITS_W, COUNT_W, LOGITS_L, COUNT_L = range(9, 15)


class Pending:
    """A metric value not read from the device yet: `formula` of the gathered counts of micro-step `row`."""

    __slots__ = ("row", "formula")

    def __init__(self, row: int, formula):
        self.row, self.formula = row, formula

    def __repr__(self):
        return f"Pending(row={self.row})"


def _samples(keep_prob) -> bool:
    """Whether a keep probability can drop something (below 1, or "auto")."""
    return keep_prob == AUTO or keep_prob < 1


def _work_fractions(args) -> list[tuple[str, object]]:
    """The work fractions logged under `args`, as (key, formula of the counts): the executed and backpropagated
    tokens always; the scored positions and the backpropagated branches where they can be below 1 (at "debug":
    always)."""
    debug = args.prune_log_level == "debug"
    positions = (debug or _samples(args.position_keep_prob) or args.prefix_prune_prob > 0
                 or args.prune_common_prefix)
    fractions = [("prune/positions_scored", _ratio(SCORED, RESPONSE))] if positions else []
    fractions += [("prune/tokens_executed", _ratio(EXECUTED, FULL)),
                  ("prune/tokens_backpropagated", _ratio(GRAD_TOKENS, FULL))]
    if debug or _samples(args.branch_keep_prob):
        fractions.append(("prune/branches_backpropagated", _ratio(GRAD_ROWS, ROWS)))
    return fractions


def _ratio(num: int, den: int, floor: float = 1.0):
    return lambda t: t[num] / max(t[den], floor)


def _ratio_or_zero(num: int, den: int):
    return lambda t: t[num] / t[den] if t[den] > 0 else 0.0


@dataclasses.dataclass
class MicroStepRecord:
    """What one training micro-step did, handed to `log_pruned_metrics` and to auto.py (`trainer.last_micro_step`)."""

    # (global step, micro-step) of the draw, and the draw's sampling options (`masks.draw_masks`'s keywords)
    step: tuple[int, int]
    options: dict
    # The masks on the device, and the raw counts of the work done (tokens executed, positions scored, rows ...)
    masks: PruneMasks
    counts: dict[str, int]
    # The MoE router loss of the backpropagated rows (None without one)
    aux_loss: torch.Tensor | None = None
    # (name, total, count) of the run's means this micro-step adds to (auto's choices)
    run_means: list = dataclasses.field(default_factory=list)
    # Whether prompts ran once per pair (the cost model's split of pairs is then logged)
    share_prompt: bool = False


class PendingMetrics:
    """The device counts of the micro-steps since the last flush, which TRL's metric lists point into (`Pending`).

    `deferred`: inside `train()`, values are read at the logging step; outside it, at once. `accelerator` gathers
    the counts (every process flushes together)."""

    def __init__(self, accelerator):
        self.accelerator, self.counts, self.deferred = accelerator, [], False

    def add(self, counts: torch.Tensor) -> int:
        """Keep a micro-step's counts; returns their row for the `Pending` entries."""
        self.counts.append(counts)
        return len(self.counts) - 1

    def flush(self, trl_metrics: dict) -> None:
        """Resolve every pending value of `trl_metrics` (TRL's train metrics): one gather of the stacked counts (the
        same number on every process), one device->host read. A collective: every process calls it together."""
        if not self.counts:
            return
        width = max(c.numel() for c in self.counts)
        stacked = torch.stack([torch.nn.functional.pad(c, (0, width - c.numel())) for c in self.counts])
        totals = self.accelerator.gather(stacked.unsqueeze(0)).sum(dim=0).tolist()
        self.counts.clear()
        for values in trl_metrics.values():
            for i, value in enumerate(values):
                if isinstance(value, Pending):
                    values[i] = value.formula(totals[value.row])

    def discard(self, trl_metrics: dict) -> None:
        """Forget unresolved values (a `train()` that raised left them): each new `train()` starts clean."""
        self.counts.clear()
        for values in trl_metrics.values():
            values[:] = [v for v in values if not isinstance(v, Pending)]


def log_pruned_metrics(record: MicroStepRecord, per_token: dict, args, trl_metrics: dict,
                       pending: PendingMetrics) -> None:
    """Record this micro-step's counts on the device, append the `prune/` fractions (and TRL's token accuracy
    re-estimated from the scored positions) to `trl_metrics` as pending entries, move the stock-named metrics that do
    not estimate stock's value (`relabel_stock_metrics`), and resolve them unless `pending` defers them."""
    masks, stats = record.masks, record.counts
    chosen_weights = masks.weights.chunk(2)[0]
    chosen_top1 = per_token["is_top1"].chunk(2)[0].float()
    device = masks.weights.device
    debug = args.prune_log_level == "debug"
    means = [mean for mean in record.run_means if debug or mean[0] not in DEBUG_KEYS]
    # Which execution the cost model picked (docs/method.md): host counts.
    if record.share_prompt and debug:
        shared, split = stats.get("shared_pairs", 0), stats.get("split_pairs", 0)
        means.append(("prune/pairs_shared", float(shared), float(shared + split)))
    host = torch.tensor([stats[name] for name in _COUNTS] + [0.0, stats["chosen_response_positions"]]
                        + [x for _, total, count in means for x in (total, count)], dtype=torch.float64)
    top1 = (chosen_top1 * chosen_weights).sum().double().reshape(1)
    counts = host.to(device, non_blocking=True)
    counts = torch.cat([counts[:TOP1], top1.to(device), counts[CHOSEN:CHOSEN + 1]]), counts[CHOSEN + 1:]
    # The sums `relabel_stock_metrics` needs ride along.
    if args.prune_common_prefix:
        exact_w, exact_l = masks.exact.chunk(2)
        mean_logits_w, mean_logits_l = per_token["mean_logits"].chunk(2)
        counts = torch.cat([counts[0], torch.stack([
            per_token["entropy"].sum(), masks.exact.sum(),
            mean_logits_w.sum(), exact_w.sum(), mean_logits_l.sum(), exact_l.sum(),
        ]).double().to(device)]), counts[1]
    # The run's means come after the counts (the same layout on every process).
    first = counts[0].numel()
    row = pending.add(torch.cat(counts))
    metrics = trl_metrics
    # TRL counted only scored positions as correct; use the HT estimate.
    if metrics["mean_token_accuracy"]:
        metrics["mean_token_accuracy"][-1] = Pending(row, _ratio_or_zero(TOP1, CHOSEN))
    for name, formula in _work_fractions(args):
        metrics[name].append(Pending(row, formula))
    for i, (name, _, _) in enumerate(means):
        metrics[name].append(Pending(row, _ratio_or_zero(first + 2 * i, first + 2 * i + 1)))
    relabel_stock_metrics(metrics, args, row, record.options["position_keep_prob"])
    if not pending.deferred:
        pending.flush(metrics)


def relabel_stock_metrics(metrics: dict, args, row: int, position_keep_prob: float) -> None:
    """Move this step's stock-named metrics that do not estimate what stock logs to names that say what they are.

    Moved, because no unbiased value exists (docs/metrics.md):
    - `rewards/accuracies` where this step's margins are random (positions sampled at `position_keep_prob` < 1, the
      step's own with "auto", or prefixes cut): a step function of the noisy margin. Where they are exact, it is
      stock's value and keeps its name;
    - under `prune_common_prefix`, every per-branch and per-token metric: the common prefix is never scored, so they
      cover the response after it (token means re-estimated over those positions).
    """

    def move(name, value=None, new=None):
        old = metrics[name].pop()
        # TRL's `log` averages every key: no empty list may stay behind.
        if not metrics[name]:
            del metrics[name]
        metrics[new or f"prune/{name}"].append(old if value is None else value)

    if position_keep_prob < 1 or args.prefix_prune_prob > 0:
        move("rewards/accuracies", new="prune/rewards/accuracies_of_estimate")
    if args.prune_common_prefix:
        suffix = "_after_common_prefix"
        move("entropy", Pending(row, _ratio_or_zero(ENTROPY, EXACT)), "prune/entropy" + suffix)
        move("logits/chosen", Pending(row, _ratio_or_zero(LOGITS_W, COUNT_W)), "prune/logits/chosen" + suffix)
        move("logits/rejected", Pending(row, _ratio_or_zero(LOGITS_L, COUNT_L)), "prune/logits/rejected" + suffix)
        move("mean_token_accuracy", Pending(row, _ratio_or_zero(TOP1, COUNT_W)), "prune/mean_token_accuracy" + suffix)
        for name in ("logps/chosen", "logps/rejected", "rewards/chosen", "rewards/rejected"):
            move(name, new=f"prune/{name}{suffix}")
