"""The `prune/*` metrics, and TRL's stock-named metrics re-estimated or renamed where pruning changes what they mean.

Stock-named metrics stay only where their expectation over the masks is stock's value: the per-branch sums (logps,
rewards, margins) and the per-token means (entropy, logits, token accuracy) are Horvitz-Thompson sums over exact counts
(docs/method.md, Eqs. 1-2). The others move to `prune/` names that say what they are (docs/parity.md). The MoE router
loss keeps its stock name, `aux_loss`: it is the aux loss this run adds to its loss (the grad rows' own), as `loss` is
the loss at the estimate.

No device->host read per micro-step: each micro-step's counts stay on the device, and the metric lists hold a
`Pending` entry for each value derived from them. `flush` resolves every pending entry with one gather and one read,
when TRL logs (`PrunedDPOTrainer.log`) or a checkpoint saves the logging window: the plugin's metrics ride on the
logging step. Outside `train()` (a direct `compute_loss` call) they are resolved at once.
"""

import torch

from .config import AUTO

_COUNTS = ("positions_scored", "response_positions", "policy_tokens_executed", "grad_tokens_executed", "full_tokens",
           "grad_rows", "rows")
# Index of each value in a micro-step's counts vector
SCORED, RESPONSE, EXECUTED, GRAD_TOKENS, FULL, GRAD_ROWS, ROWS, TOP1, CHOSEN = range(9)
ENTROPY, EXACT, LOGITS_W, COUNT_W, LOGITS_L, COUNT_L = range(9, 15)  # with `prune_common_prefix` only


class Pending:
    """A metric value not read from the device yet: `formula` of the gathered counts of micro-step `row`."""

    __slots__ = ("row", "formula")

    def __init__(self, row: int, formula):
        self.row, self.formula = row, formula

    def __repr__(self):
        return f"Pending(row={self.row})"


def _ratio(num: int, den: int, floor: float = 1.0):
    return lambda t: t[num] / max(t[den], floor)


def _ratio_or_zero(num: int, den: int):
    return lambda t: t[num] / t[den] if t[den] > 0 else 0.0


def log_run_mean(trainer, name: str, total: float, count: float = 1.0) -> None:
    """Log `name` as the run's mean, total / count summed over every process (a host value of this micro-step: a
    per-rank mean is `mean * count`). It rides in the micro-step's counts vector (`log_pruned_metrics`), gathered
    with them at the logging step: the way TRL reduces its own metrics (gather, then mean), with no sync of its own."""
    trainer.__dict__.setdefault("_run_means", []).append((name, float(total), float(count)))


def log_pruned_metrics(trainer, per_token: dict) -> int:
    """Record this micro-step's counts on the device and append the `prune/` fractions (and TRL's token accuracy
    re-estimated from the scored positions) as pending entries. Returns the counts' row for `relabel_stock_metrics`."""
    masks, stats, args = trainer._last_masks, trainer.last_prune_stats, trainer.args
    chosen_weights = masks.weights.chunk(2)[0]
    chosen_top1 = per_token["is_top1"].chunk(2)[0].float()
    device = trainer.accelerator.device
    if trainer._share_backend is not None:  # which execution the cost model picked (docs/method.md); host counts
        shared, split = stats.get("shared_pairs", 0), stats.get("split_pairs", 0)
        log_run_mean(trainer, "prune/pairs_shared", shared, shared + split)
    means = trainer.__dict__.pop("_run_means", [])  # host values of the run's means (auto's choice), summed below
    host = torch.tensor([stats[name] for name in _COUNTS] + [0.0, stats["chosen_response_positions"]]
                        + [x for _, total, count in means for x in (total, count)], dtype=torch.float64)
    top1 = (chosen_top1 * chosen_weights).sum().double().reshape(1)
    counts = host.to(device, non_blocking=True)
    counts = torch.cat([counts[:TOP1], top1.to(device), counts[CHOSEN:CHOSEN + 1]]), counts[CHOSEN + 1:]
    if args.prune_common_prefix:  # the sums `relabel_stock_metrics` needs ride along
        exact_w, exact_l = masks.exact.chunk(2)
        mean_logits_w, mean_logits_l = per_token["mean_logits"].chunk(2)
        counts = torch.cat([counts[0], torch.stack([
            per_token["entropy"].sum(), masks.exact.sum(),
            mean_logits_w.sum(), exact_w.sum(), mean_logits_l.sum(), exact_l.sum(),
        ]).double().to(device)]), counts[1]
    first = counts[0].numel()  # the run's means after the counts (the same layout on every process)
    counts = torch.cat(counts)
    pending = trainer.__dict__.setdefault("_pending_counts", [])
    pending.append(counts)
    row = len(pending) - 1
    metrics = trainer._metrics["train"]
    if metrics["mean_token_accuracy"]:  # TRL counted only scored positions as correct; use the HT estimate
        metrics["mean_token_accuracy"][-1] = Pending(row, _ratio_or_zero(TOP1, CHOSEN))
    metrics["prune/positions_scored"].append(Pending(row, _ratio(SCORED, RESPONSE)))
    metrics["prune/tokens_executed"].append(Pending(row, _ratio(EXECUTED, FULL)))
    metrics["prune/tokens_backpropagated"].append(Pending(row, _ratio(GRAD_TOKENS, FULL)))
    metrics["prune/branches_backpropagated"].append(Pending(row, _ratio(GRAD_ROWS, ROWS)))
    for i, (name, _, _) in enumerate(means):
        metrics[name].append(Pending(row, _ratio_or_zero(first + 2 * i, first + 2 * i + 1)))
    return row


def relabel_stock_metrics(trainer, row: int) -> None:
    """Move this step's stock-named metrics that do not estimate what stock logs to names that say what they are, then
    resolve the pending values unless `train()` defers them to the logging step.

    Moved, because no unbiased value exists (docs/parity.md):
    - `rewards/accuracies` under random position/prefix pruning: a step function of the noisy margin;
    - under `prune_common_prefix`, every per-branch and per-token metric: the common prefix is never scored, so they
      cover the response after it (token means re-estimated over those positions).
    """
    metrics, args = trainer._metrics["train"], trainer.args

    def move(name, value=None, new=None):
        old = metrics[name].pop()
        if not metrics[name]:
            del metrics[name]  # TRL's `log` averages every key: no empty list may stay behind
        metrics[new or f"prune/{name}"].append(old if value is None else value)

    if args.position_keep_prob == AUTO or args.position_keep_prob < 1 or args.prefix_prune_prob > 0:
        move("rewards/accuracies", new="prune/rewards/accuracies_of_estimate")
    if args.prune_common_prefix:
        suffix = "_after_common_prefix"
        move("entropy", Pending(row, _ratio_or_zero(ENTROPY, EXACT)), "prune/entropy" + suffix)
        move("logits/chosen", Pending(row, _ratio_or_zero(LOGITS_W, COUNT_W)), "prune/logits/chosen" + suffix)
        move("logits/rejected", Pending(row, _ratio_or_zero(LOGITS_L, COUNT_L)), "prune/logits/rejected" + suffix)
        move("mean_token_accuracy", Pending(row, _ratio_or_zero(TOP1, COUNT_W)), "prune/mean_token_accuracy" + suffix)
        for name in ("logps/chosen", "logps/rejected", "rewards/chosen", "rewards/rejected"):
            move(name, new=f"prune/{name}{suffix}")
    if not getattr(trainer, "_defer_metrics", False):
        flush(trainer)


def flush(trainer) -> None:
    """Resolve every pending metric value: one gather of the stacked counts of the micro-steps since the last flush
    (the same number on every process), one device->host read. A collective: every process calls it together."""
    pending = trainer.__dict__.get("_pending_counts")
    if not pending:
        return
    width = max(c.numel() for c in pending)
    stacked = torch.stack([torch.nn.functional.pad(c, (0, width - c.numel())) for c in pending])
    totals = trainer.accelerator.gather(stacked.unsqueeze(0)).sum(dim=0).tolist()
    pending.clear()
    for values in trainer._metrics["train"].values():
        for i, value in enumerate(values):
            if isinstance(value, Pending):
                values[i] = value.formula(totals[value.row])


def discard_pending(trainer) -> None:
    """Forget unresolved values (a `train()` that raised left them): each new `train()` starts clean."""
    trainer.__dict__["_pending_counts"], trainer.__dict__["_run_means"] = [], []
    for values in trainer._metrics["train"].values():
        values[:] = [v for v in values if not isinstance(v, Pending)]
