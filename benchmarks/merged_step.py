"""The merged step (docs/method.md, "Merged steps"): passes over the model per optimizer step, and the update's
agreement with stock TRL's accumulation, stock against the plugin unmerged, at the default budget and whole.

    python -m benchmarks.merged_step                      # ultrafeedback hh multiturn main, x0.25 lengths
    python -m benchmarks.merged_step ultrafeedback main   # some of them

Bench model (workload.py), 8 pairs x accumulation 4, live reference (perturbed), gradient checkpointing on, fp32 CPU,
one optimizer step of plain SGD at learning rate 1 without clipping, so the update is minus the accumulated gradient.
A pass is one forward over the model: decoder-layer calls (forward hooks) of the policy and of the reference, divided
by the layers. On CPU the packed attention runs SDPA per segment: pass counts, not times, are what carries to a GPU.
"""

from __future__ import annotations

import sys
from dataclasses import replace

import torch

from benchmarks.step_time import MAIN
from benchmarks.workload import (
    Workload, build_dataset, build_model, load_tokenizer, perturbed_copy, quiet, scratch_dir,
)

WHOLE_STEP = 10**9
SIDES = {"stock": None, "unmerged": 0, "default": "default", "whole": WHOLE_STEP}


def workload(name: str) -> Workload:
    """The bench model's workload `name`: a ragged length model at x0.25, or `main` (near-uniform lengths)."""
    if name == "main":
        return replace(MAIN, batch_size=8, num_batches=4, reference_noise=0.01)
    return Workload(batch_size=8, num_batches=4, lengths=name, length_scale=0.25, reference_noise=0.01)


def one_step(w: Workload, side: str) -> tuple[torch.Tensor, dict[str, int]]:
    """(update, {"policy", "reference": passes}) of one optimizer step of `side` (a key of SIDES)."""
    from trl import DPOConfig, DPOTrainer

    from trl_pruned_dpo import PrunedDPOConfig, PrunedDPOTrainer

    model = build_model(w)
    reference = perturbed_copy(model, w.reference_noise, w.seed)
    budget = SIDES[side]
    config_cls, trainer_cls = (DPOConfig, DPOTrainer) if side == "stock" else (PrunedDPOConfig, PrunedDPOTrainer)
    extra = {} if budget in (None, "default") else {"step_token_budget": budget}
    args = config_cls(
        output_dir=scratch_dir(side), per_device_train_batch_size=w.batch_size, gradient_accumulation_steps=4,
        max_steps=1, max_length=None, gradient_checkpointing=True, bf16=False, use_cpu=True, optim="sgd",
        learning_rate=1.0, max_grad_norm=0.0, lr_scheduler_type="constant", seed=w.seed, data_seed=w.seed,
        report_to=[], logging_steps=1, save_strategy="no", dataloader_num_workers=0, disable_tqdm=True, **extra)
    trainer = trainer_cls(model=model, ref_model=reference, args=args, train_dataset=build_dataset(w),
                          processing_class=load_tokenizer(w))
    calls = {"policy": 0, "reference": 0}
    for name, module in (("policy", trainer.model), ("reference", trainer.ref_model)):
        for layer in module.model.layers:
            layer.register_forward_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    update = torch.cat([(p.detach() - before[name]).flatten() for name, p in trainer.model.named_parameters()])
    layers = len(trainer.model.model.layers)
    return update, {name: count // layers for name, count in calls.items()}


def row(name: str) -> str:
    """One table row: passes (policy + reference) per side and their ratio to stock's; the update's distance to
    stock's (unmerged, default, whole) and to the unmerged one (default, whole), relative to the reference's norm."""
    w = workload(name)
    results = {side: one_step(w, side) for side in SIDES}
    stock_update, stock_passes = results["stock"]
    stock_total = sum(stock_passes.values())
    cells = []
    for side, (_, passes) in results.items():
        ratio = sum(passes.values()) / stock_total
        cells.append(f"{passes['policy']} + {passes['reference']}" + ("" if side == "stock" else f" ({ratio:.2f}x)"))
    unmerged_update = results["unmerged"][0]
    to_stock = [relative(results[side][0], stock_update) for side in ("unmerged", "default", "whole")]
    to_unmerged = [relative(results[side][0], unmerged_update) for side in ("default", "whole")]
    return (f"| {name} | " + " | ".join(cells) + " | " + ", ".join(f"{d:.1e}" for d in to_stock) + " | "
            + ", ".join(f"{d:.1e}" for d in to_unmerged) + " |")


def relative(update: torch.Tensor, reference: torch.Tensor) -> float:
    """|update - reference| / |reference|."""
    return float((update - reference).norm() / reference.norm())


def main(argv: list[str] | None = None) -> None:
    quiet()
    torch.set_num_threads(1)
    names = (argv if argv is not None else sys.argv[1:]) or ["ultrafeedback", "hh", "multiturn", "main"]
    print("| workload | stock | unmerged | default budget | whole step | \\|update − stock's\\| / \\|stock's\\| "
          "(unmerged, default, whole) | \\|update − unmerged\\| / \\|unmerged\\| (default, whole) |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        print(row(name), flush=True)


if __name__ == "__main__":
    main()
