"""`trl-pruned-dpo --config configs/demo.yaml --compare`: stock `trl.DPOTrainer`, then `PrunedDPOTrainer`, on the
same model, data, seed and DPO settings, the pruned one with the config's pruning fields.

It prints, first, how much faster the pruned run trained (CPU time and wall time), then one row per trainer
(training wall time and CPU time, final held-out reward accuracy, tokens executed as a share of the full graph), and
writes ``<output_dir>/compare.json``, ``<output_dir>/compare.png`` (held-out accuracy against step and against
training time) and the pruned model (as a plain run would); each trainer's own scratch output goes
to a temporary folder, removed afterwards. Training time excludes the evaluations, which are TRL's own unpruned
path in both. The runs are sequential, in this process: on a shared machine their wall times move with the load, so
compare them on an otherwise idle machine, at one thread (the demo's `env: OMP_NUM_THREADS: "1"`).
"""

import dataclasses
import json
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ..errors import PROG, InputError
from ..safety.disk_writes import give_default_modes
from .data import apply_thread_count, check_splits, go_offline, load_data, resolve_model

if TYPE_CHECKING:
    from datasets import Dataset
    from trl import DatasetMixtureConfig, DPOConfig, ModelConfig, ScriptArguments

    from ..config import PrunedDPOConfig


class _HeldOutCurve(TrainerCallback):
    """Records (step, training CPU seconds, held-out reward accuracy) at each evaluation. Training time is the optimizer
    steps' own, from each step's start to its end (evaluation, logging and saving excluded), on two clocks: wall time
    and this process's CPU time (user + system, all threads), which a busy shared machine disturbs much less."""

    def __init__(self) -> None:
        self.points = []
        self.wall, self.cpu = 0.0, 0.0
        self.started = None

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: Any) -> None:
        self.started = (time.perf_counter(), time.process_time())

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        if self.started is not None:
            self.wall += time.perf_counter() - self.started[0]
            self.cpu += time.process_time() - self.started[1]
            self.started = None

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    metrics: dict[str, float] | None = None, **kwargs: Any) -> None:
        if not metrics or "eval_rewards/accuracies" not in metrics:
            return
        self.points.append((state.global_step, self.cpu, float(metrics["eval_rewards/accuracies"])))


def _stock_config(pruned_args: "PrunedDPOConfig") -> "DPOConfig":
    """A `trl.DPOConfig` with every DPOConfig field of `pruned_args` (the pruning fields dropped), and `padding_free`
    False: TRL 1.16 ignores it (it pads, with a warning) and the plugin's default is True."""
    from trl import DPOConfig

    values = {f.name: getattr(pruned_args, f.name) for f in dataclasses.fields(DPOConfig) if f.init}
    return DPOConfig(**{**values, "padding_free": False})


def _run(trainer_class: type, args: "DPOConfig", model_path: str, train_dataset: "Dataset",
         eval_dataset: "Dataset | None", peft_config: Any = None) -> tuple[object, dict]:
    curve = _HeldOutCurve()
    trainer = trainer_class(model=model_path, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                            callbacks=[curve], peft_config=peft_config)
    trainer.train()
    if not curve.points or curve.points[-1][0] != trainer.state.global_step:
        # The final point: the run ends with an evaluation, as the CLI's runs do.
        trainer.evaluate()
    history = trainer.state.log_history
    shares = [e["prune/tokens_executed"] for e in history if "prune/tokens_executed" in e]
    return trainer, {
        "trainer": trainer_class.__name__,
        "steps": trainer.state.global_step,
        "train_seconds": curve.wall,
        "train_cpu_seconds": curve.cpu,
        "held_out_accuracy": curve.points[-1][2],
        # Stock runs the full graph.
        "tokens_executed": sum(shares) / len(shares) if shares else 1.0,
        "curve": curve.points,
    }


def speed_line(rows: list[dict]) -> str:
    """The headline: how much faster the pruned run trained, on both clocks, and what it did to held-out accuracy."""
    stock, pruned = rows
    return (f"pruned vs stock: {stock['train_cpu_seconds'] / pruned['train_cpu_seconds']:.2f}x faster in CPU time "
            f"({stock['train_seconds'] / pruned['train_seconds']:.2f}x in wall time), executing "
            f"{100 * pruned['tokens_executed']:.0f}% of the tokens, held-out reward accuracy "
            f"{pruned['held_out_accuracy'] - stock['held_out_accuracy']:+.3f}")


def format_rows(rows: list[dict]) -> str:
    lines = [speed_line(rows),
             f"{'trainer':<18} {'steps':>5} {'train time':>11} {'CPU time':>10} {'held-out acc.':>14} "
             f"{'tokens executed':>16}"]
    for row in rows:
        lines.append(f"{row['trainer']:<18} {row['steps']:>5} {row['train_seconds']:>9.1f} s "
                     f"{row['train_cpu_seconds']:>8.1f} s {row['held_out_accuracy']:>14.3f} "
                     f"{100 * row['tokens_executed']:>15.1f}%")
    lines.append("held-out reward accuracy before training: 0.5 (policy = reference: every margin is a tie, which TRL "
                 "counts as 0). Training time: the optimizer steps only; CPU time is this process's, all threads. "
                 "One seed, sequential runs: wall times move with the machine's load.")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> bool:
    """Both held-out curves, against step and against training CPU time; False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, axes = plt.subplots(1, 2, figsize=(8, 3), sharey=True)
    for row in rows:
        steps, seconds, accuracy = zip(*row["curve"])
        axes[0].plot(steps, accuracy, marker="o", label=row["trainer"])
        axes[1].plot(seconds, accuracy, marker="o", label=row["trainer"])
    for axis in axes:
        # 0.5 is a coin flip; step 0 itself scores 0 (policy = reference: every margin is a tie).
        axis.axhline(0.5, color="grey", linestyle="--", linewidth=1)
    axes[0].set(xlabel="step", ylabel="held-out reward accuracy", ylim=(0.4, 1.0), xlim=(0, None))
    axes[1].set(xlabel="training CPU time (s, evaluation excluded)")
    figure.suptitle(speed_line(rows).replace(", held-out", ",\nheld-out"), fontsize=8)
    axes[0].legend(loc="lower right")
    for axis in axes:
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True


def compare(script_args: "ScriptArguments", training_args: "PrunedDPOConfig", model_args: "ModelConfig",
            dataset_args: "DatasetMixtureConfig") -> int:
    """Train stock, then pruned; print the rows, write compare.json and compare.png. Returns the exit code."""
    from trl import DPOTrainer, get_peft_config

    from ..config import uses_pruned_forward
    from ..trainer import PrunedDPOTrainer

    if training_args.eval_strategy == "no":
        raise InputError("--compare needs held-out pairs: set `eval_strategy: steps` (and `eval_steps`).")
    if not uses_pruned_forward(training_args):
        raise InputError("--compare needs settings that differ from stock: the exact savings (`share_prompt`, "
                         "`padding_free`, on by default) or a pruning, e.g. `prefix_prune_prob: 0.5`.")
    apply_thread_count()
    # The demo is offline; a hub model must be in the local cache.
    go_offline()
    model_path = resolve_model(model_args.model_name_or_path, model_args.model_revision)
    dataset, name = load_data(script_args, dataset_args)
    train_dataset, eval_dataset = check_splits(dataset, name, script_args, training_args)
    output = Path(training_args.output_dir)
    rows = []
    for label, trainer_class, args in (("stock", DPOTrainer, _stock_config(training_args)),
                                       ("pruned", PrunedDPOTrainer, training_args)):
        print(f"--compare: training {trainer_class.__name__} ({label}) ...", flush=True)
        # A scratch folder for what a trainer writes on its own.
        with tempfile.TemporaryDirectory(prefix=f"compare-{label}-") as scratch:
            args.output_dir = scratch
            # `use_peft`: the same LoRA for both trainers.
            trainer, row = _run(trainer_class, args, model_path, train_dataset, eval_dataset,
                                get_peft_config(model_args))
            rows.append(row)
    # The pruned model, where a plain run of the same config saves it.
    trainer.save_model(str(output))
    give_default_modes(output)
    (output / "compare.json").write_text(json.dumps(rows, indent=1))
    drawn = plot(rows, output / "compare.png")
    print(f"\n{PROG} --compare (model {model_args.model_name_or_path}, data {name})\n{format_rows(rows)}")
    print(f"wrote {output / 'compare.json'}" + (f" and {output / 'compare.png'}" if drawn else
                                                  " (no PNG: `pip install matplotlib` to draw the curves)")
          + f"; the pruned model is saved in {output}")
    return 0
