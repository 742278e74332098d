"""One run of the study: a setting and a seed, DPO from the cached starting policy, exact evaluation along the way.

Same for every setting of a seed: starting weights (policy and reference both load the SFT folder), data and data
order (`seed` = `data_seed`; the pruned trainer never draws from the global RNG, and a hash of every training batch is
recorded to prove it), hyperparameters, and a constant learning rate after a short warmup, so a curve read at step k
does not depend on how long the run goes on (pruned runs go further than stock, to be read at equal wall-clock).

Wall-clock is the time spent inside training steps (forward, backward, clipping, optimizer), measured between the
Trainer's `on_step_begin` and `on_step_end`; evaluation and data loading are excluded. The work of each step is also
counted in token units (forward = 1 per executed token, backward = 2 per backpropagated token), a hardware-free proxy.
"""

import hashlib
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, TrainerCallback
from transformers.trainer_callback import PrinterCallback
from trl import DPOConfig, DPOTrainer

from trl_pruned_dpo import PrunedDPOConfig, PrunedDPOTrainer

from .evaluate import generation_accuracy, preference_metrics
from .prototypes import AnnealKeepProbs, prototype_class
from .settings import Setting
from .sft import load_policy


@dataclass(frozen=True)
class RunConfig:
    steps: int = 150  # the equal-steps budget N
    pruned_steps_factor: float = 1.5  # every run goes on to this many times N, to be read at equal wall-clock
    batch_size: int = 8  # pairs per step
    learning_rate: float = 1e-4
    warmup: int = 10
    beta: float = 0.1
    max_grad_norm: float = 1.0
    eval_every: int = 20
    gen_every: int = 40
    eval_batch_size: int = 32
    generate: bool = True  # greedy-generation accuracy at gen steps (the regimes study leaves it out: cost)

    def max_steps(self, setting: Setting) -> int:
        # Stock too: its curve past N is the curve of the exact-but-faster baselines (common prefix only).
        return int(round(self.steps * self.pruned_steps_factor))


class _Costed:
    """Mixin for both trainers: counts each training micro-step's work and hashes its batch."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        if self.model.training:
            stats = getattr(self, "last_prune_stats", None)
            if stats:
                cost = stats["policy_tokens_executed"] + 2 * stats["grad_tokens_executed"]
                cost += stats.get("reference_tokens_executed", 0)
            else:  # stock: policy forward and backward, reference forward, over the whole padded batch
                cost = 4 * inputs["input_ids"].numel()
            self.cost_units = getattr(self, "cost_units", 0) + cost
            self.batch_hashes = getattr(self, "batch_hashes", [])
            self.batch_hashes.append(hashlib.sha256(inputs["input_ids"].cpu().numpy().tobytes()).hexdigest()[:16])
        return out


class StockTrainer(_Costed, DPOTrainer):
    pass


class PrunedTrainer(_Costed, PrunedDPOTrainer):
    pass


def _prototype_trainer(setting: Setting):
    return type("PrototypeTrainer", (_Costed, prototype_class(setting.mask_law, setting.balanced)), {})


class _StudyLogger(TrainerCallback):
    """Times training steps and runs the exact held-out evaluation at the planned steps."""

    def __init__(self, trainer_box, eval_steps, gen_steps, gen_rows, tokenizer, log):
        self.box, self.eval_steps, self.gen_steps = trainer_box, set(eval_steps), set(gen_steps)
        self.gen_rows, self.tokenizer, self.log = gen_rows, tokenizer, log
        self.train_time, self.records, self._t0 = 0.0, [], None

    def on_step_begin(self, args, state, control, **kwargs):
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.train_time += time.perf_counter() - self._t0
        if state.global_step in self.eval_steps:
            self.evaluate(state.global_step)

    def evaluate(self, step):
        trainer = self.box[0]
        started = time.perf_counter()
        record = {"step": step, "time": self.train_time, "cost": getattr(trainer, "cost_units", 0)}
        record.update(preference_metrics(trainer, trainer.eval_dataset))
        if step in self.gen_steps:
            record.update(generation_accuracy(trainer.model, self.tokenizer, self.gen_rows))
        trainer.model.train()  # evaluate() leaves it in eval mode; TRL's log() picks its metrics by that mode
        self.records.append(record)
        gen = f"  gen {record['gen_acc']:.3f}" if "gen_acc" in record else ""
        self.log(f"    step {step:4d}  t {self.train_time:6.1f}s  pref {record['pref_acc']:.3f}  "
                 f"margin {record['margin']:+.3f}{gen}  (eval {time.perf_counter() - started:.1f}s)")


def build_trainer(setting: Setting, policy_dir: str, train_ds, eval_ds, seed: int, cfg: RunConfig, max_steps: int,
                  output_dir: str):
    """The trainer of `setting` from the starting policy in `policy_dir` (policy and reference both load it)."""
    common = dict(
        output_dir=output_dir, per_device_train_batch_size=cfg.batch_size // setting.accumulation,
        gradient_accumulation_steps=setting.accumulation, per_device_eval_batch_size=cfg.eval_batch_size, max_steps=max_steps, learning_rate=cfg.learning_rate,
        lr_scheduler_type="constant_with_warmup", warmup_steps=cfg.warmup, beta=cfg.beta,
        max_grad_norm=cfg.max_grad_norm, gradient_checkpointing=False, bf16=False, fp16=False, use_cpu=True,
        seed=seed, data_seed=seed, report_to=[], logging_steps=1, save_strategy="no", eval_strategy="no",
        max_length=None, disable_tqdm=True, dataloader_num_workers=0,
    )
    if setting.stock:
        args, cls = DPOConfig(**common), StockTrainer
    else:
        # The study records auto's internals too (docs/metrics.md: "debug" keys).
        args = PrunedDPOConfig(**common, **setting.pruning, prune_log_level="debug")
        cls = _prototype_trainer(setting) if setting.mask_law != "trainer" or setting.balanced else PrunedTrainer
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    return cls(model=load_policy(policy_dir), ref_model=load_policy(policy_dir), args=args, train_dataset=train_ds,
               eval_dataset=eval_ds, processing_class=tokenizer), tokenizer


def package_digest() -> str:
    """A hash of the trl_pruned_dpo sources (the trainer may change while a long study runs; the report checks it)."""
    import trl_pruned_dpo

    root = Path(trl_pruned_dpo.__file__).parent
    digest = hashlib.sha256()
    # Every module of the trainer, in its subpackages too (method/, safety/, cli/); the demo is not the trainer.
    for path in sorted(root.rglob("*.py")):
        name = path.relative_to(root)
        if name.parts[0] != "demo":
            digest.update(name.as_posix().encode() + path.read_bytes())
    return digest.hexdigest()[:12]


def run(setting: Setting, seed: int, policy_dir: str, train_ds, eval_ds, gen_rows, cfg: RunConfig, log=print,
        save_dir: str | None = None) -> dict:
    """Train `setting` with `seed`; return its record: config, eval curve, per-step train logs, timings. With
    `save_dir`, the final policy is saved there too (the gradient diagnostics' "trained" state)."""
    max_steps = cfg.max_steps(setting)
    eval_steps = sorted({*range(cfg.eval_every, max_steps + 1, cfg.eval_every), cfg.steps, max_steps})
    gen_steps = sorted({*range(cfg.gen_every, max_steps + 1, cfg.gen_every), cfg.steps, max_steps}) if cfg.generate \
        else []
    with tempfile.TemporaryDirectory(prefix="quality_") as output_dir:
        trainer, tokenizer = build_trainer(setting, policy_dir, train_ds, eval_ds, seed, cfg, max_steps, output_dir)
        box = [trainer]
        logger = _StudyLogger(box, eval_steps, gen_steps, gen_rows, tokenizer, log)
        trainer.remove_callback(PrinterCallback)  # the per-step log dicts; the study prints its own lines
        trainer.add_callback(logger)
        if setting.anneal:
            trainer.add_callback(AnnealKeepProbs(setting.anneal, horizon=cfg.steps))
        started = time.perf_counter()
        trainer.train()
        total = time.perf_counter() - started
        if save_dir:
            trainer.model.save_pretrained(save_dir)
            tokenizer.save_pretrained(save_dir)
    history = trainer.state.log_history
    keys = ("loss", "grad_norm", "rewards/accuracies", "rewards/margins", "prune/positions_scored",
            "prune/tokens_executed", "prune/tokens_backpropagated", "prune/branches_backpropagated",
            "prune/branch_keep_prob", "prune/position_keep_prob", "prune/auto_b_simple")
    train_log = [{"step": h["step"], **{k: h[k] for k in keys if k in h}} for h in history if "loss" in h]
    norms = [h["grad_norm"] for h in train_log if "grad_norm" in h]
    return {
        "setting": setting.name,
        "seed": seed,
        "config": asdict(cfg),
        "max_steps": max_steps,
        "curve": logger.records,
        "train_log": train_log,
        "train_time": logger.train_time,
        "wall_total": total,
        "cost_units": getattr(trainer, "cost_units", 0),
        "clip_fraction": sum(n > cfg.max_grad_norm for n in norms) / max(len(norms), 1),
        # The data order over the equal-steps budget: identical for every setting of a seed (checked in report.py).
        "data_digest": hashlib.sha256("".join(trainer.batch_hashes[: cfg.steps]).encode()).hexdigest()[:16],
        "threads": torch.get_num_threads(),
        "package_digest": package_digest(),
        **_auto_record(trainer),
    }


def _auto_record(trainer) -> dict:
    """What `auto` measured and chose (trl_pruned_dpo/auto.py), and the time its measurements took."""
    auto = getattr(trainer, "auto_keep_probs", None)
    if auto is None:
        return {}
    # its measurement runs no extra pass (gradient norms of the steps themselves): no work of its own to count
    return {"auto": auto.history, "auto_measure_seconds": 0.0, "auto_measure_cost": 0}
