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

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .config import AUTO

if TYPE_CHECKING:
    from .pruned_forward import MicroStepRecord

# Diagnostics, logged only with `prune_log_level="debug"`: auto's internals (the keep probabilities it drew with, whose
# effect the work fractions show at "info", and its noise scale) and the cost model's choice.
DEBUG_KEYS = frozenset({"prune/branch_keep_prob", "prune/position_keep_prob", "prune/auto_b_simple",
                        "prune/pairs_shared"})
# The plan's counts the fractions read (host ints, plan.WorkCounts).
COUNTED = ("positions_scored", "response_positions", "policy_tokens_executed", "grad_tokens_executed", "full_tokens",
           "grad_rows", "rows", "chosen_response_positions")
# Totals of a micro-step, by name, once gathered and summed over processes.
Totals = dict[str, float]


class Pending:
    """A metric value not read from the device yet: `formula` of the gathered totals of micro-step `row`."""

    __slots__ = ("row", "formula")

    def __init__(self, row: int, formula: Callable[[Totals], float]):
        self.row = row
        self.formula = formula

    def __repr__(self) -> str:
        return f"Pending(row={self.row})"


def _samples(keep_prob: float | str) -> bool:
    """Whether a keep probability can drop something (below 1, or "auto")."""
    return keep_prob == AUTO or keep_prob < 1


def _work_fractions(args: Any, prunes_branches: bool) -> list[tuple[str, Callable[[Totals], float]]]:
    """The work fractions logged under `args`, as (key, formula of the totals): the executed and backpropagated
    tokens always; the scored positions where they can be below 1; the backpropagated branches where this run can
    drop one (`prunes_branches`: "auto" on adapter training never does). At "debug": all of them."""
    debug = args.prune_log_level == "debug"
    positions = (debug or _samples(args.position_keep_prob) or args.prefix_prune_prob > 0
                 or args.prune_common_prefix)
    fractions = [("prune/positions_scored", _ratio("positions_scored", "response_positions"))] if positions else []
    fractions += [("prune/tokens_executed", _ratio("policy_tokens_executed", "full_tokens")),
                  ("prune/tokens_backpropagated", _ratio("grad_tokens_executed", "full_tokens"))]
    if debug or prunes_branches:
        fractions.append(("prune/branches_backpropagated", _ratio("grad_rows", "rows")))
    return fractions


def _ratio(num: str, den: str) -> Callable[[Totals], float]:
    return lambda totals: totals[num] / max(totals[den], 1.0)


def _ratio_or_zero(num: str, den: str) -> Callable[[Totals], float]:
    return lambda totals: totals[num] / totals[den] if totals[den] > 0 else 0.0


class PendingMetrics:
    """The device values of the micro-steps since the last flush, which TRL's metric lists point into (`Pending`).

    `deferred`: inside `train()`, values are read at the logging step; outside it, at once. `accelerator` gathers
    the values (every process flushes together)."""

    def __init__(self, accelerator: Any):
        self.accelerator = accelerator
        self.rows: list[tuple[tuple[str, ...], torch.Tensor]] = []
        self.deferred = False

    def add(self, names: tuple[str, ...], values: torch.Tensor) -> int:
        """Keep a micro-step's values (one per name); returns their row for the `Pending` entries."""
        self.rows.append((names, values))
        return len(self.rows) - 1

    def flush(self, trl_metrics: dict) -> None:
        """Resolve every pending value of `trl_metrics` (TRL's train metrics): one gather of the stacked values (the
        same layout on every process), one device->host read. A collective: every process calls it together."""
        if not self.rows:
            return
        width = max(values.numel() for _, values in self.rows)
        stacked = torch.stack([torch.nn.functional.pad(values, (0, width - values.numel()))
                               for _, values in self.rows])
        summed = self.accelerator.gather(stacked.unsqueeze(0)).sum(dim=0).tolist()
        totals = [dict(zip(names, row)) for (names, _), row in zip(self.rows, summed)]
        self.rows.clear()
        for values in trl_metrics.values():
            for i, value in enumerate(values):
                if isinstance(value, Pending):
                    values[i] = value.formula(totals[value.row])

    def discard(self, trl_metrics: dict) -> None:
        """Forget unresolved values (a `train()` that raised left them): each new `train()` starts clean."""
        self.rows.clear()
        for values in trl_metrics.values():
            values[:] = [v for v in values if not isinstance(v, Pending)]


def _device_sums(record: "MicroStepRecord", common_prefix: bool) -> dict[str, torch.Tensor]:
    """The sums only the device holds: TRL's token accuracy re-estimated from the scored chosen positions, and under
    `common_prefix` the sums the relabelled token means need (`relabel_stock_metrics`)."""
    masks, per_token = record.masks, record.per_token
    sums = {"top1": (per_token["is_top1"].chunk(2)[0].float() * masks.weights.chunk(2)[0]).sum()}
    if common_prefix:
        exact_chosen, exact_rejected = masks.exact.chunk(2)
        logits_chosen, logits_rejected = per_token["mean_logits"].chunk(2)
        sums.update(entropy=per_token["entropy"].sum(), exact=masks.exact.sum(),
                    logits_chosen=logits_chosen.sum(), exact_chosen=exact_chosen.sum(),
                    logits_rejected=logits_rejected.sum(), exact_rejected=exact_rejected.sum())
    return sums


def log_pruned_metrics(record: "MicroStepRecord", args: Any, trl_metrics: dict, pending: PendingMetrics,
                       drops_branches: bool) -> None:
    """Record this micro-step's values on the device, append the `prune/` fractions (and TRL's token accuracy
    re-estimated from the scored positions) to `trl_metrics` as pending entries, move the stock-named metrics that do
    not estimate stock's value (`relabel_stock_metrics`), and resolve them unless `pending` defers them.
    `drops_branches`: whether this run can drop a branch at all (else the backpropagated fraction is always 1)."""
    counts = record.counts.as_dict()
    debug = args.prune_log_level == "debug"
    means = [mean for mean in record.means if debug or mean[0] not in DEBUG_KEYS]
    # Which execution the cost model picked (docs/method.md): host counts.
    if record.layout.share and debug:
        shared, split = counts.get("shared_pairs", 0), counts.get("split_pairs", 0)
        means.append(("prune/pairs_shared", float(shared), float(shared + split)))
    host = {name: float(counts[name]) for name in COUNTED}
    for i, (_, total, count) in enumerate(means):
        host[f"mean{i}"], host[f"count{i}"] = float(total), float(count)
    device = record.masks.weights.device
    sums = _device_sums(record, args.prune_common_prefix)
    # The host values cross in one copy; the device sums join them there. The same names on every process.
    names = tuple(host) + tuple(sums)
    values = torch.cat([torch.tensor(list(host.values()), dtype=torch.float64).to(device, non_blocking=True),
                        torch.stack(list(sums.values())).double()])
    row = pending.add(names, values)
    metrics = trl_metrics
    # TRL counted only scored positions as correct; use the HT estimate.
    if metrics["mean_token_accuracy"]:
        metrics["mean_token_accuracy"][-1] = Pending(row, _ratio_or_zero("top1", "chosen_response_positions"))
    for name, formula in _work_fractions(args, drops_branches):
        metrics[name].append(Pending(row, formula))
    for i, (name, _, _) in enumerate(means):
        metrics[name].append(Pending(row, _ratio_or_zero(f"mean{i}", f"count{i}")))
    relabel_stock_metrics(metrics, args, row, record.options["position_keep_prob"])
    if not pending.deferred:
        pending.flush(metrics)


def relabel_stock_metrics(metrics: dict, args: Any, row: int, position_keep_prob: float | torch.Tensor) -> None:
    """Move this step's stock-named metrics that do not estimate what stock logs to names that say what they are.

    Moved, because no unbiased value exists (docs/metrics.md):
    - `rewards/accuracies` where this step's margins are random (positions sampled at `position_keep_prob` < 1, the
      step's own with "auto", or prefixes cut): a step function of the noisy margin. Where they are exact, it is
      stock's value and keeps its name;
    - under `prune_common_prefix`, every per-branch and per-token metric: the common prefix is never scored, so they
      cover the response after it (token means re-estimated over those positions).
    """

    def move(name: str, value: Pending | None = None, new: str | None = None) -> None:
        old = metrics[name].pop()
        # TRL's `log` averages every key: no empty list may stay behind.
        if not metrics[name]:
            del metrics[name]
        metrics[new or f"prune/{name}"].append(old if value is None else value)

    if position_keep_prob < 1 or args.prefix_prune_prob > 0:
        move("rewards/accuracies", new="prune/rewards/accuracies_of_estimate")
    if args.prune_common_prefix:
        suffix = "_after_common_prefix"
        move("entropy", Pending(row, _ratio_or_zero("entropy", "exact")), "prune/entropy" + suffix)
        move("logits/chosen", Pending(row, _ratio_or_zero("logits_chosen", "exact_chosen")),
             "prune/logits/chosen" + suffix)
        move("logits/rejected", Pending(row, _ratio_or_zero("logits_rejected", "exact_rejected")),
             "prune/logits/rejected" + suffix)
        move("mean_token_accuracy", Pending(row, _ratio_or_zero("top1", "exact_chosen")),
             "prune/mean_token_accuracy" + suffix)
        for name in ("logps/chosen", "logps/rejected", "rewards/chosen", "rewards/rejected"):
            move(name, new=f"prune/{name}{suffix}")
