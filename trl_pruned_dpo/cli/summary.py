"""The end-of-run summary: what ran, what pruning kept, what `auto` chose, the worst values, and where the model is
(or where the run stopped and how to resume)."""

from typing import TYPE_CHECKING, Any

from ..config import EXACT_SAVINGS
from ..errors import PROG
from ..safety import checkpoints
from ..safety.signals import resume_command

if TYPE_CHECKING:
    from ..forward_choice import ForwardChoice
    from ..safety.run_state import RunState

# Each logged `prune/*` key -> (its label, what the share is of: metrics.py's denominators). Both token shares divide
# by `full_tokens`, the tokens of stock's padded batch (prompts and padding included).
_PRUNE_METRICS = {
    "prune/tokens_executed": ("tokens executed", " of stock's padded batch"),
    "prune/positions_scored": ("positions scored", " of response positions"),
    "prune/branches_backpropagated": ("branches backpropagated", " of branches"),
    "prune/tokens_backpropagated": ("tokens backpropagated", " of stock's padded batch"),
}


def _mean(history: list[dict], key: str) -> float | None:
    values = [entry[key] for entry in history if key in entry]
    return sum(values) / len(values) if values else None


def pruning_line(args: Any) -> str:
    """The pruning settings that are on, by field name; "none" when the run computes stock DPO's loss (the exact
    savings, on or off, are `savings_line`'s)."""
    on = [name for name in ("prune_common_prefix",) if getattr(args, name, False)]
    if args.prefix_prune_prob:
        on.append(f"prefix_prune_prob {args.prefix_prune_prob:g} (min ratio {args.prefix_min_ratio:g})")
    if args.branch_keep_prob != 1:
        on.append(f"branch_keep_prob {args.branch_keep_prob} ({args.branch_sampling})")
    if args.position_keep_prob != 1:
        on.append(f"position_keep_prob {args.position_keep_prob}")
    return ", ".join(on) if on else "none: every keep probability 1 (stock DPO's computation)"


def savings_line(args: Any, choice: "ForwardChoice") -> str:
    """The exact savings (`share_prompt`, `padding_free`: on by default), whether the model ran them (`choice`: the
    trainer's forward choice), and how to turn them off; off: stock's forward (with no pruning)."""
    # Reversed, so that share_prompt comes first.
    on = [name for name in reversed(EXACT_SAVINGS) if getattr(args, name, False)]
    if not on:
        return "off (share_prompt and padding_free false): padded rows, as stock"
    # What the savings need is missing: said once, at the start.
    if not choice.pruned and choice.why:
        return f"{', '.join(on)} ignored ({choice.why}): TRL's own forward ran"
    # The model's attention cannot run packed (with a pruning on).
    if not choice.packed:
        return f"{', '.join(on)} ignored for this model: padded rows ran (exact)"
    return f"{', '.join(on)} (exact; off: --share_prompt false --padding_free false)"


def auto_choice(auto_keep_probs: Any) -> dict | None:
    """The last choice of a keep probability "auto" (trl_pruned_dpo/auto.py; `auto_keep_probs`: the trainer's, or
    None), restored with a resumed checkpoint."""
    history = getattr(auto_keep_probs, "history", None)
    return history[-1] if history else None


def auto_details(choice: dict | None) -> str | None:
    """The whole reason of auto's last choice (`auto_choice`'s; for the log above the summary, which gives its first
    clause)."""
    return None if choice is None else f"auto at step {choice['step']}: {choice['reason']}"


def summarize(trainer: Any, model_name: str, model_path: str, wall_seconds: float) -> str:
    """What ran, one short line per fact: steps and time, the last training loss, the held-out accuracy, what "auto"
    chose (its reason's first clause: the whole reason is printed above), the mean `prune/*` fractions, the worst
    values and where the model is. A fact the run did not produce is left out, not shown as n/a."""
    args, state = trainer.args, trainer.state
    history = state.log_history
    train_log = next((e for e in reversed(history) if "train_runtime" in e), {})
    # With fewer steps than `logging_steps`, TRL folds the metrics into the closing entry (loss as `train_loss`).
    last = next((e for e in reversed(history) if "loss" in e), {**train_log, "loss": train_log.get("train_loss")})
    last_eval = next((e for e in reversed(history) if "eval_rewards/accuracies" in e), None)
    pairs = state.global_step * args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
    runtime = train_log.get("train_runtime")
    timing = f"{runtime:.1f} s of training, " if runtime is not None else ""
    lines = [
        f"{PROG} summary",
        ("model", model_name if model_name == model_path else f"{model_name} -> {model_path}"),
        ("pruning", pruning_line(args)),
        ("exact savings", savings_line(args, trainer.forward_choice)),
        *([("attention kernel", trainer.forward_choice.kernel)] if trainer.forward_choice.kernel else []),
        ("steps", f"{state.global_step} ({pairs} pairs), {timing}{wall_seconds:.1f} s in all"),
    ]
    if last.get("loss") is not None:
        lines.append(("last training loss", f"{last['loss']:.3f} (step {last.get('step', state.global_step)})"))
    if last.get("rewards/accuracies") is not None:
        lines.append(("training reward acc.", f"{last['rewards/accuracies']:.3f} (last logged batches)"))
    if last_eval is not None:
        lines.append(("held-out reward acc.", f"{last_eval['eval_rewards/accuracies']:.3f} "
                                              f"(step {last_eval.get('step')}, eval split)"))
    choice = auto_choice(trainer.auto_keep_probs)
    # The verdict only: the numbers behind it are in the line printed above the summary.
    if choice is not None:
        verdict = choice["reason"].split(":", 1)[0]
        lines.append(("auto chose", f"branch {choice['branch_keep_prob']:g}, position "
                                    f"{choice['position_keep_prob']:g} at step {choice['step']}: {verdict}"))
    for key, (label, of) in _PRUNE_METRICS.items():
        share = _mean(history, key)
        if share is not None:
            lines.append((label, f"{100 * share:.1f}%{of}"))
    # Worst values, resume note, saved model or where the run stopped.
    lines += closing_lines(args, trainer.run_state, state.global_step)
    # Printed just above the summary: the log keeps the whole reason.
    details = auto_details(choice)
    return "\n".join(([details] if details else []) +
                     [line if isinstance(line, str) else f"  {line[0]:<24} {line[1]}" for line in lines])


def closing_lines(args: Any, run: "RunState", global_step: int) -> list:
    """Summary lines (label, text) or plain strings: worst values, resume note, then saved model or stop. `run`: the
    trainer's run state, `global_step`: the step training ended at."""
    lines = []
    stop, guard = run.stop_request, run.divergence_guard
    worst = guard.summary() if guard is not None else None
    if worst:
        lines.append(("worst values", worst))
    if run.resumed_from:
        start = checkpoints.checkpoint_step(run.resumed_from)
        note = f"{run.resumed_from}: the training time covers steps {start + 1 if start is not None else '?'}-"
        note += f"{global_step} only"
        if not run.restored_logging_window:
            note += "; the first logged loss and prune/* figures after it cover only the resumed steps"
        lines.append(("resumed from", note))
    if stop is not None and stop.signal_number is not None:
        saved = f"checkpoint {stop.checkpoint} saved" if stop.checkpoint else "no checkpoint saved"
        lines.append(f"stopped at step {stop.step} of {stop.max_steps} by {stop.signal_name}; {saved}; resume with "
                     f"`{resume_command()}`")
    else:
        lines.append(("saved", f"{args.output_dir} (model and tokenizer)"))
    return lines

