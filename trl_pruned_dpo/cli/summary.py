"""The end-of-run summary: what ran, what pruning kept, what `auto` chose, the worst values, and where the model is
(or where the run stopped and how to resume)."""

from ..errors import PROG
from ..safety import checkpoints
from ..safety.signals import resume_command

_PRUNE_METRICS = {
    "prune/tokens_executed": "tokens executed",
    "prune/positions_scored": "positions scored",
    "prune/branches_backpropagated": "branches backpropagated",
    "prune/tokens_backpropagated": "tokens backpropagated",
}


def _mean(history: list[dict], key: str) -> float | None:
    values = [entry[key] for entry in history if key in entry]
    return sum(values) / len(values) if values else None


def summarize(trainer, model_name: str, model_path: str, wall_seconds: float) -> str:
    """What ran: steps, time, the last logged loss and accuracies, and the mean `prune/*` fractions (n/a if the
    trainer logged none)."""
    args, state = trainer.args, trainer.state
    history = state.log_history
    train_log = next((e for e in reversed(history) if "train_runtime" in e), {})
    # With fewer steps than `logging_steps`, TRL folds the metrics into the closing entry (loss as `train_loss`).
    last = next((e for e in reversed(history) if "loss" in e), {**train_log, "loss": train_log.get("train_loss")})
    last_eval = next((e for e in reversed(history) if "eval_rewards/accuracies" in e), None)
    pairs = state.global_step * args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size

    def fmt(value, pattern="{:.3f}"):
        return "n/a" if value is None else pattern.format(value)

    lines = [
        f"{PROG} summary",
        ("model", model_name if model_name == model_path else f"{model_name} -> {model_path}"),
        ("pruning", f"position_keep_prob={args.position_keep_prob} prefix_prune_prob={args.prefix_prune_prob} "
                    f"(min ratio {args.prefix_min_ratio}) branch_keep_prob={args.branch_keep_prob} "
                    f"({args.branch_sampling}) prune_common_prefix={args.prune_common_prefix} "
                    f"share_prompt={args.share_prompt}"),
        ("steps", f"{state.global_step} ({pairs} pairs) in {fmt(train_log.get('train_runtime'), '{:.1f}')} s of "
                  f"training, {wall_seconds:.1f} s in all"),
        ("last loss / reward acc.", f"{fmt(last.get('loss'))} / {fmt(last.get('rewards/accuracies'))} "
                                    f"(step {last.get('step', 'n/a')}, training batches)"),
    ]
    if last_eval is not None:
        lines.append(("held-out reward acc.", f"{fmt(last_eval['eval_rewards/accuracies'])} "
                                              f"(step {last_eval.get('step')}, eval split)"))
    auto = getattr(trainer, "_auto_probs", None)
    if auto is not None and auto.history:  # what "auto" chose last, and why (trl_pruned_dpo/auto.py)
        choice = auto.history[-1]
        lines.append(("auto chose", f"branch {choice['branch_keep_prob']:g}, position {choice['position_keep_prob']:g} "
                                    f"at step {choice['step']}: {choice['reason']}"))
    for key, label in _PRUNE_METRICS.items():
        share = _mean(history, key)
        suffix = {"prune/tokens_executed": " of the full graph", "prune/positions_scored": " of response positions"}
        lines.append((label, "n/a" if share is None else f"{100 * share:.1f}%{suffix.get(key, '')}"))
    lines += closing_lines(trainer)  # worst values, resume note, saved model or where the run stopped
    return "\n".join(line if isinstance(line, str) else f"  {line[0]:<24} {line[1]}" for line in lines)



def closing_lines(trainer) -> list:
    """Summary lines (label, text) or plain strings: worst values, resume note, then saved model or stop."""
    args, lines, stop = trainer.args, [], getattr(trainer, "stop_request", None)
    guard = getattr(trainer, "divergence_guard", None)
    worst = guard.summary() if guard is not None else None
    if worst:
        lines.append(("worst values", worst))
    if getattr(trainer, "resumed_from", None):
        start = checkpoints.checkpoint_step(trainer.resumed_from)
        note = f"{trainer.resumed_from}: the training time covers steps {start + 1 if start is not None else '?'}-"
        note += f"{trainer.state.global_step} only"
        if not getattr(trainer, "restored_logging_window", False):
            note += "; the first logged loss and prune/* figures after it cover only the resumed steps"
        lines.append(("resumed from", note))
    if stop is not None and stop.signal_number is not None:
        saved = f"checkpoint {stop.checkpoint} saved" if stop.checkpoint else "no checkpoint saved"
        lines.append(f"stopped at step {stop.step} of {stop.max_steps} by {stop.signal_name}; {saved}; resume with "
                     f"`{resume_command()}`")
    else:
        lines.append(("saved", f"{args.output_dir} (model and tokenizer)"))
    return lines

