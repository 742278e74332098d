"""One run of the real-model study: a (model, task, setting, seed) cell, DPO with LoRA, held-out metrics on the way.

Every run of a (model, task) starts from the same weights (the model, or its SFT warm start: `warm_start`), trains a
LoRA adapter (the reference is the model with its adapter off), on the same train pairs (the task's split for seed 0;
the run's seed draws the data order and the adapter's initialisation). The learning-rate schedule is the model spec's:
the first study's is constant (no warm-up: HF's first warm-up step has a learning rate of 0), so a curve read at step k
does not depend on how long the run goes on; the pre-registered study's (docs/study.md) is linear warm-up then linear
decay to 0 over the run's own steps.

Held-out pairs: the first `curve_pairs` at every evaluation (the curves, read at equal CPU time), all `eval_pairs`
after the last step (the equal-steps numbers): a forward over 224 pairs costs ~2 minutes of one CPU core on SmolLM2,
more than a dozen training steps, so the curve's points use fewer pairs.

Clocks, both recorded: this process's CPU time (user + system, `step_cpu`) and its user CPU time alone (`step_user`,
`resource.getrusage`), one torch thread, from each optimizer step's start to its end (`on_step_begin` ..
`on_step_end`: forward, backward, `auto`'s measurements, clipping, the optimizer); evaluation, loading and data
preparation are excluded.

Held-out metrics are forward-only and exact (nothing pruned): each pair's chosen and rejected log-probabilities under
the policy, against the reference's, computed once per (model, task) (the adapter starts at zero, so step 0 is the
reference itself: every margin a tie, accuracy 0.5 by the convention below, margin 0).

Held-out readouts (`held_out_readouts`, docs/study.md "Changes"): the DPO loss, mean -log sigmoid(margin) over the
pairs, the mean margin, and reward accuracy, which counts a tie as half a win (TRL's `rewards/accuracies` counts it as
a loss, which puts step 0 at 0.0 instead of the coin flip it is); after one step there are no ties. A non-finite margin
(a diverged policy) is never a win: a miss in accuracy, and in the loss and the mean margin the evaluation's lowest
finite margin or 0, whichever is lower; such margins are counted (`nonfinite`) and make the run diverged.
"""

import contextlib
import hashlib
import json
import math
import random
import resource
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from transformers.trainer_callback import PrinterCallback

# A chat template for a built-in model without one (the tiny smoke model): roles as tags, the answer after
# "<assistant>". Real models keep their own (SmolLM2's ChatML; Gemma 3's from TRL).
PLAIN_CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                       "{% if add_generation_prompt %}<assistant>{% endif %}")


# The study's settings (docs/quality.md): stock, then the exact preset alone and with each estimator.
EXACT = {"prune_common_prefix": True}  # the exact preset: the defaults (prompt once, no padding) + common prefix
SETTINGS = {
    "stock": None,
    "exact": EXACT,
    "branch": {**EXACT, "branch_keep_prob": 0.5},
    "position": {**EXACT, "position_keep_prob": 0.5},
    "prefix": {**EXACT, "prefix_prune_prob": 0.5},
    "all": {**EXACT, "branch_keep_prob": 0.5, "position_keep_prob": 0.5, "prefix_prune_prob": 0.5},
    "auto": {**EXACT, "branch_keep_prob": "auto", "position_keep_prob": "auto"},
}
LABELS = {"stock": "stock DPOTrainer", "exact": "exact preset", "branch": "exact + branch 0.5",
          "position": "exact + position 0.5", "prefix": "exact + prefix 0.5", "all": "exact + all three 0.5",
          "auto": "exact + auto"}


@dataclass(frozen=True)
class ModelSpec:
    """A model of the study and how it is trained (LoRA on every linear layer of its blocks, or every weight)."""

    path: str  # a builtin: name or a folder
    pairs: int = 4  # pairs per optimizer step
    learning_rate: float = 1e-3
    lora_r: int = 16  # 0: full fine-tuning, the reference a frozen copy of the starting model (TRL's)
    lora_targets: tuple = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    warm_start: dict = field(default_factory=dict)  # SFT on the task's chosen answers first (`steps`, `batch_size`, ...)
    max_length: int = 256
    lr_scheduler: str = "constant"  # HF's lr_scheduler_type
    warmup_ratio: float = 0.0  # of the run's steps (HF's warmup_steps below 1)


@dataclass(frozen=True)
class RunPlan:
    steps: int = 20
    evals: tuple = (10, 20)  # steps after which held-out pairs are evaluated (step 0 is the reference)
    eval_pairs: int = 224  # the first n held-out pairs, evaluated after the last step
    curve_pairs: int = 64  # the first n of them, evaluated at every point of `evals` (the curves: CPU-time readings)
    eval_batch: int = 16  # sequences per forward
    beta: float = 0.1
    stop_on_divergence: bool | None = None  # the pruned trainer's field (None: its default); False: every run ends
    train_pairs: int | None = None  # the first n train pairs only (smoke tests)
    pair_margins: bool = False  # keep every evaluated pair's margin in the record (the pre-registered study)


# Fields added after the first study's cells were stored: left out of a cell's key at their default, so those cells
# keep their keys (real_models.cell_key).
LATE_FIELDS = {"lr_scheduler": "constant", "warmup_ratio": 0.0, "stop_on_divergence": None, "train_pairs": None,
               "pair_margins": False}


def key_fields(spec_or_plan) -> dict:
    return {k: v for k, v in asdict(spec_or_plan).items() if not (k in LATE_FIELDS and v == LATE_FIELDS[k])}


def cpu_seconds() -> float:
    return time.process_time()


def user_cpu_seconds() -> float:
    """This process's user CPU time (no system time: page faults and allocator work the kernel does are left out)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_utime


DIVERGENCE_FACTOR = 10.0  # docs/study.md: a logged training loss above 10x the first one


def divergence(losses: list[float], final_accuracy: float | None, nonfinite_margins: int = 0) -> str | None:
    """Why a run counts as diverged (docs/study.md), or None: a non-finite training loss (logged unfiltered:
    `logging_nan_inf_filter=False`), a loss above DIVERGENCE_FACTOR x the first step's, a non-finite held-out margin
    at any evaluation, or held-out accuracy below 0.5 at its last evaluation."""
    for step, loss in enumerate(losses, start=1):
        if not math.isfinite(loss):
            return f"training loss {loss} at step {step}"
        if losses and math.isfinite(losses[0]) and abs(loss) > DIVERGENCE_FACTOR * abs(losses[0]):
            return f"training loss {loss:.4g} at step {step}, above {DIVERGENCE_FACTOR:g}x the first ({losses[0]:.4g})"
    if nonfinite_margins:
        return f"{nonfinite_margins} non-finite held-out margin(s)"
    if final_accuracy is not None and final_accuracy < 0.5:
        return f"held-out accuracy {final_accuracy:.3f} at the end, below 0.5"
    return None


# ---------------------------------------------------------------------------------------------------- held-out metrics


def _sequences(rows) -> list[tuple[list[int], int]]:
    """(prompt + answer ids, answer length) for each row's chosen then rejected answer, as TRL tokenized them."""
    out = []
    for row in rows:
        for key in ("chosen_ids", "rejected_ids"):
            out.append((list(row["prompt_ids"]) + list(row[key]), len(row[key])))
    return out


@torch.no_grad()
def answer_log_probs(model, sequences, pad_id: int, batch: int) -> list[float]:
    """Summed log-probability of each sequence's answer (its last `n` tokens): left-padded batches of similar lengths,
    positions counted from each row's first real token, logits only for the answers' positions (`logits_to_keep`)."""
    was_training = model.training
    model.eval()
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i][0]))
    sums = [0.0] * len(sequences)
    try:
        for start in range(0, len(order), batch):
            chunk = order[start:start + batch]
            width = max(len(sequences[i][0]) for i in chunk)
            keep = max(sequences[i][1] for i in chunk) + 1
            ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, i in enumerate(chunk):
                tokens = sequences[i][0]
                ids[row, width - len(tokens):] = torch.tensor(tokens)
                mask[row, width - len(tokens):] = 1
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=keep).logits
            # logits[:, j] predicts the token at position width - keep + j + 1
            logp = logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, width - keep + 1:, None]).squeeze(-1)
            for row, i in enumerate(chunk):
                sums[i] = float(logp[row, keep - 1 - sequences[i][1]:].sum())
    finally:
        model.train(was_training)
    return sums


def dpo_loss(margin: float) -> float:
    """-log sigmoid(margin), computed without overflow."""
    return math.log1p(math.exp(-margin)) if margin >= 0 else -margin + math.log1p(math.exp(margin))


def held_out_readouts(margins: list[float]) -> dict[str, float]:
    """One evaluation's readouts from its per-pair margins (docs/study.md, "Changes"): `loss`, the held-out DPO loss
    (mean -log sigmoid(margin), primary), `margin`, the mean margin (primary), and `accuracy` (a finite tie counts
    half; secondary). A non-finite margin is never a win: a miss in accuracy, and in the loss and the mean margin the
    lowest finite margin of the evaluation or 0, whichever is lower (`nonfinite` counts them)."""
    finite = [m for m in margins if math.isfinite(m)]
    worst = min([0.0, *finite])
    scored = [m if math.isfinite(m) else worst for m in margins]
    wins = [0.0 if not math.isfinite(m) else 1.0 if m > 0 else 0.0 if m < 0 else 0.5 for m in margins]
    n = len(margins)
    out = {"loss": sum(map(dpo_loss, scored)) / n, "margin": sum(scored) / n, "accuracy": sum(wins) / n}
    return {**out, "nonfinite": n - len(finite)} if len(finite) < n else out


def pair_metrics(policy: list[float], reference: list[float], beta: float, curve_pairs: int,
                 keep_margins: bool = False) -> dict:
    """`held_out_readouts` of the reward margins from chosen/rejected log-probabilities laid out as `_sequences` lays
    them out: over every pair given, and accuracy and margin over the first `curve_pairs` (`curve_accuracy`,
    `curve_margin`: the first study's curves); `margins`, every pair's rounded, with `keep_margins`."""
    margins = [beta * ((policy[i] - reference[i]) - (policy[i + 1] - reference[i + 1]))
               for i in range(0, len(policy), 2)]
    every, head = held_out_readouts(margins), held_out_readouts(margins[:curve_pairs])
    out = {**every, "pairs": len(margins), "curve_accuracy": head["accuracy"], "curve_margin": head["margin"]}
    if keep_margins:
        out["margins"] = [round(m, MARGIN_DECIMALS) if math.isfinite(m) else m for m in margins]
    return out


MARGIN_DECIMALS = 5  # a stored per-pair margin (beta x log-ratios, ~0.01-2 here): 1e-5 is far below any difference read


# ------------------------------------------------------------------------------------------------------ the trainers


class _Counted:
    """Mixin for both trainers: the policy tokens executed by each training micro-step (stock: the padded batch of
    chosen and rejected rows; the plugin: what its plan executed, `last_prune_stats`)."""

    tokens_executed = 0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        if model.training:
            stats = getattr(self, "last_prune_stats", None)
            if stats and "policy_tokens_executed" in stats:
                self.tokens_executed += stats["policy_tokens_executed"]
            else:
                self.tokens_executed += inputs["input_ids"].numel()
        return out


def _trainer_classes():
    from trl import DPOTrainer

    from trl_pruned_dpo import PrunedDPOTrainer

    return type("CountedDPOTrainer", (_Counted, DPOTrainer), {}), type("CountedPruned", (_Counted, PrunedDPOTrainer), {})


class _Clock(TrainerCallback):
    """Training CPU time per step (process and user clocks) and the held-out evaluations at the planned steps."""

    def __init__(self, evaluate, eval_steps, log):
        self.evaluate, self.eval_steps, self.log = evaluate, set(eval_steps), log
        self.step_cpu, self.step_user, self.started, self.points = [], [], None, []

    def on_step_begin(self, args, state, control, **kwargs):
        self.started = (cpu_seconds(), user_cpu_seconds())

    def on_step_end(self, args, state, control, **kwargs):
        self.step_cpu.append(cpu_seconds() - self.started[0])
        self.step_user.append(user_cpu_seconds() - self.started[1])
        if state.global_step in self.eval_steps:
            began = cpu_seconds()
            point = {"step": state.global_step, "cpu": sum(self.step_cpu), "user": sum(self.step_user),
                     **self.evaluate(state.global_step)}
            self.points.append(point)
            self.log(f"    step {point['step']:3d}  train CPU {point['cpu']:7.1f} s (user {point['user']:.1f})  "
                     f"accuracy {point['accuracy']:.3f} ({point['pairs']} pairs)  margin {point['margin']:+.4f}  "
                     f"loss {point['loss']:.4f}  (eval {cpu_seconds() - began:.0f} s CPU)")


class _AutoSteps(TrainerCallback):
    """`auto`'s keep probabilities (branch, position) at each step, as it drew them: the kind of the step (an exact
    step, a probe, or its current choice) read from its public `kind` and `choice` after the step."""

    def __init__(self, auto):
        self.auto, self.keep_probs = auto, []

    def on_step_end(self, args, state, control, **kwargs):
        from trl_pruned_dpo.auto import KIND_PROBS

        kind = self.auto.kind(state.global_step - 1)  # the step the draw used (the global step before it ended)
        self.keep_probs.append([float(p) for p in KIND_PROBS.get(kind, self.auto.choice[:2])])


def auto_record(trainer) -> dict:
    """What `auto` chose and why (its callback's public `choice` and `history`), or {} for a run without auto."""
    for callback in trainer.callback_handler.callbacks:
        if type(callback).__name__ == "AutoKeepProbs":
            return {"auto_choice": list(callback.choice), "auto_history": callback.history}
    return {}


def load_tokenizer(path: str):
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.chat_template is None:
        tokenizer.chat_template = PLAIN_CHAT_TEMPLATE
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def build_trainer(model_path: str, spec: ModelSpec, plan: RunPlan, setting: dict | None, seed: int, train_rows,
                  eval_rows, output_dir: str):
    """The trainer of one cell, not yet trained: stock `DPOTrainer` for `setting` None, else `PrunedDPOTrainer` with
    the `PrunedDPOConfig` fields it sets; its schedule over `plan.steps`. Also what the calibration
    (study_calibration.py) times, so it times the cells' own steps."""
    from peft import LoraConfig
    from trl import DPOConfig

    from trl_pruned_dpo import PrunedDPOConfig

    stock_class, pruned_class = _trainer_classes()
    tokenizer = load_tokenizer(model_path)
    common = dict(
        per_device_train_batch_size=spec.pairs, max_steps=plan.steps, learning_rate=spec.learning_rate,
        lr_scheduler_type=spec.lr_scheduler, warmup_steps=spec.warmup_ratio, beta=plan.beta, max_length=spec.max_length,
        gradient_checkpointing=False, bf16=False, fp16=False, use_cpu=True, seed=seed, data_seed=seed, report_to=[],
        logging_steps=1, save_strategy="no", eval_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        model_init_kwargs={"dtype": torch.float32},
        # A non-finite loss is logged as it is (HF's filter logs the running mean instead): divergence reads it.
        logging_nan_inf_filter=False,
    )
    lora = LoraConfig(r=spec.lora_r, lora_alpha=2 * spec.lora_r, lora_dropout=0.0,
                      target_modules=list(spec.lora_targets), task_type="CAUSAL_LM") if spec.lora_r else None
    if setting is None:
        cls, args = stock_class, DPOConfig(output_dir=output_dir, **common)
    else:
        extra = {} if plan.stop_on_divergence is None else {"stop_on_divergence": plan.stop_on_divergence}
        cls, args = pruned_class, PrunedDPOConfig(output_dir=output_dir, **common, **setting, **extra)
    trainer = cls(model=model_path, args=args, train_dataset=train_rows, eval_dataset=eval_rows,
                  processing_class=tokenizer, peft_config=lora)
    trainer.remove_callback(PrinterCallback)
    return trainer


def train_one(model_path: str, spec: ModelSpec, plan: RunPlan, setting: dict | None, seed: int, train_rows, eval_rows,
              reference_cache: dict, log=print) -> dict:
    """Train one cell; returns its record (curve, per-step CPU times, tokens, auto's choice). `setting` None is stock
    `DPOTrainer`; otherwise the `PrunedDPOConfig` fields it sets. `reference_cache` keeps the reference's held-out
    log-probabilities between runs of the same (model, task) (a dict the caller owns)."""
    with tempfile.TemporaryDirectory(prefix="real_models_") as scratch:
        trainer = build_trainer(model_path, spec, plan, setting, seed, train_rows, eval_rows, scratch)
        lora = spec.lora_r > 0
        sequences = _sequences(trainer.eval_dataset)
        pad = trainer.processing_class.pad_token_id

        def evaluate(step):  # the curve's pairs at every point, every pair after the last step
            chosen = sequences if step == plan.steps else sequences[:2 * plan.curve_pairs]
            return pair_metrics(answer_log_probs(trainer.model, chosen, pad, plan.eval_batch),
                                reference_cache["logps"], plan.beta, plan.curve_pairs, plan.pair_margins)

        if "logps" not in reference_cache:
            began = cpu_seconds()
            with trainer.model.disable_adapter() if lora else contextlib.nullcontext():
                reference = trainer.model if lora else trainer.ref_model
                reference_cache["logps"] = answer_log_probs(reference, sequences, pad, plan.eval_batch)
            reference_cache["cpu"] = cpu_seconds() - began
            log(f"    reference log-probabilities of {len(sequences) // 2} held-out pairs: "
                f"{reference_cache['cpu']:.0f} s CPU")
        clock = _Clock(evaluate, plan.evals, log)
        trainer.add_callback(clock)
        auto = getattr(trainer, "auto_keep_probs", None)
        auto_steps = _AutoSteps(auto) if auto is not None else None
        if auto_steps is not None:
            trainer.add_callback(auto_steps)
        trainer.train()
    history = trainer.state.log_history
    shares = [h["prune/tokens_executed"] for h in history if "prune/tokens_executed" in h]
    losses = [h["loss"] for h in history if "loss" in h]
    late = {}  # the pre-registered study's fields (absent from the first study's records)
    if spec.lr_scheduler != "constant" or plan.stop_on_divergence is not None:
        nonfinite = sum(p.get("nonfinite", 0) for p in clock.points)
        late.update(steps_done=trainer.state.global_step, learning_rates=[h["learning_rate"] for h in history
                                                                          if "learning_rate" in h],
                    nonfinite_losses=sum(not math.isfinite(x) for x in losses), nonfinite_margins=nonfinite,
                    divergence=divergence(losses, clock.points[-1]["accuracy"] if clock.points else None, nonfinite),
                    tokens_executed_steps=[round(x, 4) for x in shares])
        if auto_steps is not None:
            late["auto_keep_probs_steps"] = auto_steps.keep_probs
    return {
        "curve": [{"step": 0, "cpu": 0.0, "accuracy": 0.5, "margin": 0.0, "curve_accuracy": 0.5, "curve_margin": 0.0}
                  | ({"loss": math.log(2)} if late else {})]
        + clock.points,
        "step_cpu": clock.step_cpu,
        "step_user": clock.step_user,
        **late,
        "tokens_executed": trainer.tokens_executed,
        "tokens_executed_share": sum(shares) / len(shares) if shares else 1.0,
        "losses": losses,
        "threads": torch.get_num_threads(),
        **auto_record(trainer),
    }


# ------------------------------------------------------------------------------------------------ the SFT warm start


def conversational_examples(tokenizer, rows) -> list[tuple[list[int], int]]:
    """(ids, first answer index) for each row's prompt and chosen answer through the chat template, as TRL's DPO
    tokenizes a conversational pair: the prompt with the generation prompt, then the rest of the whole conversation."""
    out = []
    for row in rows:
        prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
        full = tokenizer.apply_chat_template(row["prompt"] + row["chosen"], tokenize=True)
        prompt, full = (list(x["input_ids"]) if isinstance(x, dict) or hasattr(x, "keys") else list(x)
                        for x in (prompt, full))
        if full[:len(prompt)] == prompt and len(full) > len(prompt):
            out.append((full, len(prompt)))
    return out


def warm_start_folder(model_path: str, task: str, train_rows, recipe: dict, cache: Path, log=print) -> str:
    """The model after a short SFT on the task's chosen answers (train split only), cached in `cache` by a hash of
    the model, task and recipe, shared by every setting and seed. The loop is the demo's (trl_pruned_dpo/demo/sft.py,
    `train_causal_lm`), full fine-tuning."""
    from trl_pruned_dpo.demo.sft import train_causal_lm

    key = hashlib.sha256(json.dumps([model_path, task, recipe], sort_keys=True).encode()).hexdigest()[:12]
    folder = cache / f"sft-{Path(model_path).name}-{task}-{key}"
    if (folder / "model.safetensors").is_file():
        return str(folder)
    log(f"  warm start: SFT of {model_path} on {task}'s chosen answers ({recipe}), cached at {folder}")
    tokenizer = load_tokenizer(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    began = cpu_seconds()
    examples = conversational_examples(tokenizer, train_rows)
    train_causal_lm(model, examples, steps=recipe["steps"], batch_size=recipe["batch_size"],
                    learning_rate=recipe["learning_rate"], warmup=recipe.get("warmup", 2), pad_id=tokenizer.pad_token_id,
                    order=random.Random(f"real-models/sft/{task}"), log=log, log_every=max(1, recipe["steps"] // 4))
    log(f"  warm start done: {cpu_seconds() - began:.0f} s CPU")
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=cache))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "warm_start.json").write_text(json.dumps({"model": model_path, "task": task, **recipe}, indent=1))
    tmp.rename(folder)
    return str(folder)


