"""The `prune/*` metrics, and TRL's stock-named metrics re-estimated or renamed where pruning changes what they mean.

Stock-named metrics stay only where their expectation over the masks is stock's value: the per-branch sums (logps,
rewards, margins) and the per-token means (entropy, logits, token accuracy) are Horvitz-Thompson sums over exact counts
(docs/method.md, Eqs. 1-2). The others move to `prune/` names that say what they are (docs/parity.md).
"""

import torch

from .config import AUTO


def log_pruned_metrics(trainer, per_token: dict):
    """The `prune/` fractions, and TRL's token accuracy re-estimated from the scored positions only.

    One gather (the step's one sync). With `prune_common_prefix`, returns the summed (chosen top-1 estimate, entropy,
    exact positions, chosen logits, chosen exact positions, rejected logits, rejected exact positions) for
    `relabel_stock_metrics`; else None."""
    masks, stats, args = trainer._last_masks, trainer.last_prune_stats, trainer.args
    chosen_weights = masks.weights.chunk(2)[0]
    chosen_top1 = per_token["is_top1"].chunk(2)[0].float()
    counts = torch.tensor(
        [
            stats["positions_scored"],
            stats["response_positions"],
            stats["policy_tokens_executed"],
            stats["grad_tokens_executed"],
            stats["full_tokens"],
            stats["grad_rows"],
            stats["rows"],
            stats["chosen_response_positions"],
        ],
        dtype=torch.float64,
    ).to(trainer.accelerator.device, non_blocking=True)
    top1_estimate = (chosen_top1 * chosen_weights).sum().double().reshape(1)
    counts = torch.cat([counts[:-1], top1_estimate, counts[-1:]])  # device values: the one sync is below
    if args.prune_common_prefix:  # the sums `relabel_stock_metrics` needs ride on the same gather
        exact_w, exact_l = masks.exact.chunk(2)
        mean_logits_w, mean_logits_l = per_token["mean_logits"].chunk(2)
        counts = torch.cat([counts, torch.stack([
            per_token["entropy"].sum(), masks.exact.sum(),
            mean_logits_w.sum(), exact_w.sum(), mean_logits_l.sum(), exact_l.sum(),
        ]).double()])
    totals = trainer.accelerator.gather(counts.unsqueeze(0)).sum(dim=0).tolist()
    (scored, response, executed, grad_tokens, full, grad_rows, rows, top1, chosen_tokens) = totals[:9]
    metrics = trainer._metrics["train"]
    if metrics["mean_token_accuracy"]:  # TRL counted only scored positions as correct; use the HT estimate
        metrics["mean_token_accuracy"][-1] = top1 / chosen_tokens if chosen_tokens > 0 else 0.0
    metrics["prune/positions_scored"].append(scored / max(response, 1))
    metrics["prune/tokens_executed"].append(executed / max(full, 1))
    metrics["prune/tokens_backpropagated"].append(grad_tokens / max(full, 1))
    metrics["prune/branches_backpropagated"].append(grad_rows / max(rows, 1))
    if trainer._share_backend is not None:  # which execution the cost model picked (docs/method.md)
        shared, split = stats.get("shared_pairs", 0), stats.get("split_pairs", 0)
        metrics["prune/pairs_shared"].append(shared / max(shared + split, 1))
    return (top1, *totals[9:]) if args.prune_common_prefix else None


def relabel_stock_metrics(trainer, common_prefix_totals) -> None:
    """Move this step's stock-named metrics that do not estimate what stock logs to names that say what they are.

    Moved, because no unbiased value exists (docs/parity.md):
    - `rewards/accuracies` under random position/prefix pruning: a step function of the noisy margin;
    - `aux_loss` with pruning on: the router loss of the grad rows' executed columns only;
    - under `prune_common_prefix`, every per-branch and per-token metric: the common prefix is never scored, so they
      cover the response after it (token means re-estimated over those positions).
    """
    metrics, args = trainer._metrics["train"], trainer.args

    def move(name, value=None, new=None):
        old = metrics[name].pop()
        if not metrics[name]:
            del metrics[name]  # TRL's `log` averages every key: no empty list may stay behind
        metrics[new or f"prune/{name}"].append(old if value is None else value)

    if trainer.aux_loss_enabled and args.pruning_enabled:
        move("aux_loss", new="prune/aux_loss_grad_rows")
    if args.position_keep_prob == AUTO or args.position_keep_prob < 1 or args.prefix_prune_prob > 0:
        move("rewards/accuracies", new="prune/rewards/accuracies_of_estimate")
    if not args.prune_common_prefix:
        return
    top1_w, entropy, exact, logits_w, count_w, logits_l, count_l = common_prefix_totals
    suffix = "_after_common_prefix"
    move("entropy", entropy / exact if exact else 0.0, "prune/entropy" + suffix)
    move("logits/chosen", logits_w / count_w if count_w else 0.0, "prune/logits/chosen" + suffix)
    move("logits/rejected", logits_l / count_l if count_l else 0.0, "prune/logits/rejected" + suffix)
    move("mean_token_accuracy", top1_w / count_w if count_w else 0.0, "prune/mean_token_accuracy" + suffix)
    for name in ("logps/chosen", "logps/rejected", "rewards/chosen", "rewards/rejected"):
        move(name, new=f"prune/{name}{suffix}")
