"""Launched by tests/test_distributed.py under `accelerate launch`: train the tiny local model a few steps per run and
record, per rank, what it did.

    accelerate launch --multi_gpu --num_processes 2 tests/distributed/run_pruned.py --spec runs.json --out DIR

`runs.json` is a list of runs, executed in order in the same processes (one launch, one process group, several
trainers: the import and start-up cost is paid once). Each run is a dict:

    name        output folder under DIR
    trainer     "pruned" (PrunedDPOTrainer) or "stock" (trl.DPOTrainer)
    reference   "model" (a separate in-memory reference), "peft" (LoRA policy, reference = adapter disabled) or
                "precompute" (a separate reference, `precompute_ref_log_probs=True`)
    config      overrides of the config fields below (e.g. branch_keep_prob, gradient_accumulation_steps)
    data        "shared" (default: one dataset, sharded across ranks by the sampler), "per-rank" (rank 0 holds
                near-copy pairs only, every other rank dissimilar pairs only: the ranks' batches differ in kind) or
                "ragged" (shared, prompts of ragged length: the ranks' micro-batches group into passes differently)
    resume      optional checkpoint folder, relative to DIR, to resume from

Per run and rank it writes DIR/<name>/rank<r>.json (engine, log history, training loss, every mask draw with the
batch it was drawn for, the gradient buckets DDP all-reduced, per optimizer step the passes run and those the rank's
own tokens alone would group, what it said about the merged step) and DIR/<name>/weights_rank<r>.pt (the trainable
parameters after training, gathered in full
whatever the sharding), plus DIR/<name>/weights_initial.pt (rank 0, before training). Nothing touches a hub.

RUN_PRUNED_FSDP_ON_CPU=1 lets accelerate's FSDP run on CPU (see `allow_fsdp_on_cpu`). DeepSpeed runs on CPU as is
(`DS_ACCELERATOR=cpu`, gloo), less a JIT-compiled op it does not need here (see `skip_deepspeed_shm_op`).
"""

import argparse
import copy
import json
import os
import sys
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]  # the local tokenizer and model builder; the package, uninstalled
from tiny import QUIET_TRAINING, char_tokenizer, preference_rows, ragged_rows, tiny_model  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl import DPOConfig, DPOTrainer  # noqa: E402

from trl_pruned_dpo import PrunedDPOConfig, PrunedDPOTrainer  # noqa: E402
from trl_pruned_dpo.merged_step import default_budget  # noqa: E402
from trl_pruned_dpo.method.plan import group_passes, unpruned_tokens  # noqa: E402
from trl_pruned_dpo.reference import HOST_KEY  # noqa: E402

BASE_CONFIG = dict(QUIET_TRAINING, per_device_train_batch_size=2, seed=0, max_length=64)


STORED_REFERENCE = ("ref_chosen_logps", "ref_rejected_logps", "ref_chosen_token_logps", "ref_rejected_token_logps")


def build(run: dict, out: Path, tokenizer, dataset):
    pruned = run.get("trainer", "pruned") == "pruned"
    config_cls, trainer_cls = (PrunedDPOConfig, PrunedDPOTrainer) if pruned else (DPOConfig, DPOTrainer)
    reference = run.get("reference", "model")
    overrides = dict(run.get("config", {}))
    if reference == "precompute":
        overrides["precompute_ref_log_probs"] = True
    if not torch.cuda.is_available():  # gloo; DeepSpeed's CPU accelerator otherwise has no backend to ask for
        overrides.setdefault("ddp_backend", "gloo")
    args = config_cls(output_dir=str(out / run["name"]), **{**BASE_CONFIG, **overrides})
    model = tiny_model(tokenizer, seed=0)
    if reference == "peft":
        from peft import LoraConfig

        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        trainer = trainer_cls(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                              peft_config=lora)
        # Move the adapter off zero (same draw on every rank) so the policy differs from the reference
        with torch.no_grad():
            g = torch.Generator().manual_seed(5)
            for name, p in sorted(trainer.model.named_parameters()):
                if "lora_B" in name:
                    p.add_(0.1 * torch.randn(p.shape, generator=g).to(p.device, p.dtype))
        return trainer
    ref_model = copy.deepcopy(model)
    with torch.no_grad():  # move the policy off the reference so the log-ratios are not all zero
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return trainer_cls(model=model, ref_model=ref_model, args=args, train_dataset=dataset,
                       processing_class=tokenizer)


def dissimilar_rows(n: int = 16):
    """Pairs whose rejected answer shares no start with the chosen one (reversed, plus a tail)."""
    return [{**r, "rejected": r["rejected"][::-1] + "xyz"} for r in preference_rows(n)]


def record_draws(trainer) -> list:
    """Wrap the trainer's mask draw to keep, per micro-step, the masks, the batch they were drawn for, the keep
    probabilities drawn with (this rank's mean over its pairs) and how many micro-steps its forward merged (`pass`:
    1 alone, more in a merged step's pass)."""
    draws = []
    if not hasattr(trainer, "last_micro_step"):
        return draws
    merged_forward = trainer.merged_forward  # every pass, of one micro-batch (`concatenated_forward`) or several

    def record(done, inputs, merged: int) -> None:
        (step, micro), masks, drawn = done.step, done.masks, done.options
        draws.append({
            "step": step,
            "micro": micro,
            "pass": merged,
            "input_ids": inputs["input_ids"].tolist(),
            "completion_mask": inputs["completion_mask"].tolist(),
            "scored": masks.scored.int().tolist(),
            "backprop": masks.backprop.int().tolist(),
            **{key: float(torch.as_tensor(drawn[key], dtype=torch.float64).mean())
               for key in ("branch_keep_prob", "position_keep_prob")},
        })

    def recording_merged(model, batches):
        records = merged_forward(model, batches)
        for done, inputs in zip(records, batches):
            record(done, inputs, len(batches))
        return records

    trainer.merged_forward = recording_merged
    return draws


def record_passes(trainer) -> list:
    """Wrap the trainer's prefetch of an optimizer step's micro-batches to keep, per step, the pass sizes it runs
    (`ran`; one per micro-batch where it does not merge) and those this rank's own tokens and default budget alone
    would give (`own`): ranks whose `own` differ must still run the same `ran` (merged_step.py)."""
    steps = []
    if not hasattr(trainer, "last_micro_step"):
        return steps
    fetch = trainer.get_batch_samples

    def recording(epoch_iterator, num_batches, device):
        batches, num_items = fetch(epoch_iterator, num_batches, device)
        passes = trainer._merger.passes  # the test runner may read the trainer's private state
        ran = [len(members) for members in passes.passes] if passes is not None else [1] * len(batches)
        own = None
        if batches and all(HOST_KEY in batch for batch in batches):
            tokens = [unpruned_tokens(batch[HOST_KEY], trainer.forward_choice.share_prompt) for batch in batches]
            own = group_passes(tokens, default_budget(batches))
        steps.append({"ran": ran, "own": own})
        return batches, num_items

    trainer.get_batch_samples = recording
    return steps


class CountReductions(TrainerCallback):
    """Under DDP, counts the gradient buckets all-reduced (a communication hook on the wrapped model, registered once
    training has wrapped it): a step reduced once holds `buckets` of them."""

    def __init__(self, trainer):
        self.trainer, self.reductions = trainer, 0

    def on_train_begin(self, args, state, control, **kwargs):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.nn.parallel import DistributedDataParallel

        model = self.trainer.model_wrapped
        if not isinstance(model, DistributedDataParallel):
            return

        def counting(process_group, bucket):
            self.reductions += 1
            return allreduce_hook(process_group, bucket)

        model.register_comm_hook(None, counting)


def trainable_parameters(trainer) -> tuple[dict[str, torch.Tensor], int]:
    """Every trainable parameter in full (a collective under FSDP / ZeRO-3: all ranks call it), and how many elements
    of them this rank holds (fewer than in full when they are sharded)."""
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if hasattr(params[0][1], "ds_id"):  # DeepSpeed ZeRO-3: gather the partitions
        import deepspeed

        local = sum(p.ds_tensor.numel() for _, p in params)
        with deepspeed.zero.GatheredParameters([p for _, p in params]):
            return {n: p.detach().float().cpu().clone() for n, p in params}, local
    full, local = {}, 0
    for name, p in params:
        if hasattr(p, "full_tensor"):  # FSDP2 DTensor
            local += p.to_local().numel()
            p = p.full_tensor()
        else:
            local += p.numel()
        full[name.replace("_fsdp_wrapped_module.", "")] = p.detach().float().cpu().clone()
    return full, local


def allow_fsdp_on_cpu():
    """Test-only shim: let accelerate run FSDP over gloo on CPU.

    accelerate turns `--use_fsdp` into `DistributedType.FSDP` only on accelerator devices; on CPU it stays MULTI_CPU
    and the model gets DDP. torch's FSDP2 itself runs on CPU with gloo, so this finishes what accelerate does on a GPU
    (`AcceleratorState.__init__`): switch the type to FSDP and keep the plugin. Used when RUN_PRUNED_FSDP_ON_CPU=1.
    """
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    init = AcceleratorState.__init__

    def __init__(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = self.distributed_type

    AcceleratorState.__init__ = __init__


def skip_deepspeed_shm_op():
    """Test-only: DeepSpeed's CPU accelerator JIT-compiles a shared-memory all-reduce op at start-up (about two
    minutes of C++ on a small runner). It only speeds up inference all-reduces; without it DeepSpeed uses gloo."""
    import deepspeed.comm.torch  # noqa: F401 - `deepspeed.comm.torch` the attribute is torch itself, hence sys.modules

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True, help="JSON file: the list of runs")
    parser.add_argument("--out", required=True)
    cli = parser.parse_args()
    if os.environ.get("RUN_PRUNED_FSDP_ON_CPU") == "1":
        allow_fsdp_on_cpu()
    if os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true" and not torch.cuda.is_available():
        skip_deepspeed_shm_op()
    out = Path(cli.out)
    runs = json.loads(Path(cli.spec).read_text())
    tokenizer = char_tokenizer()
    dataset = Dataset.from_list(preference_rows(16))
    rank = int(os.environ.get("RANK", "0"))  # set by `accelerate launch`
    per_rank = Dataset.from_list(preference_rows(16) if rank == 0 else dissimilar_rows(16))
    data = {"shared": dataset, "per-rank": per_rank, "ragged": Dataset.from_list(ragged_rows(16))}
    for run in runs:
        trainer = build(run, out, tokenizer, data[run.get("data", "shared")])
        draws = record_draws(trainer)
        passes = record_passes(trainer)
        reductions = CountReductions(trainer)
        trainer.add_callback(reductions)
        folder = out / run["name"]
        folder.mkdir(parents=True, exist_ok=True)
        rank = trainer.accelerator.process_index
        if rank == 0:  # before `train()` prepares (wraps or shards) the model
            params = trainer.model.named_parameters()
            torch.save({n: p.detach().float().cpu().clone() for n, p in params if p.requires_grad},
                       folder / "weights_initial.pt")
        resume = str(out / run["resume"]) if run.get("resume") else None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = trainer.train(resume_from_checkpoint=resume)
        # What the run said about the merged step (merged_step.StepMerger); every other warning shown once
        merged_step_said = [str(w.message) for w in caught if str(w.message).startswith("Merged step off")]
        others = {(str(w.message), w.category, w.filename, w.lineno) for w in caught}
        for message, category, filename, lineno in sorted(others, key=str):
            if message not in merged_step_said:
                warnings.showwarning(message, category, filename, lineno)
        weights, local_numel = trainable_parameters(trainer)
        torch.save(weights, folder / f"weights_rank{rank}.pt")
        report = {
            "rank": rank,
            "world_size": trainer.accelerator.num_processes,
            "distributed_type": str(trainer.accelerator.distributed_type),
            "model_class": type(trainer.model_wrapped).__name__,
            "local_numel": local_numel,
            "full_numel": sum(w.numel() for w in weights.values()),
            "training_loss": result.training_loss,
            "global_step": trainer.state.global_step,
            "log_history": trainer.state.log_history,
            "draws": draws,
            "reductions": reductions.reductions,
            "passes": passes,
            "merged_step_said": merged_step_said,
            # auto (auto.py): what it measured and chose, the same on every rank
            "auto": {"history": trainer.auto_keep_probs.history, "choice": list(trainer.auto_keep_probs.choice)}
            if getattr(trainer, "auto_keep_probs", None) is not None else None,
            # the precomputed reference (each rank computed a shard; every rank must hold the whole, in order)
            "stored_reference": {c: v for c, v in trainer.train_dataset[:].items() if c in STORED_REFERENCE},
        }
        (folder / f"rank{rank}.json").write_text(json.dumps(report))
        trainer.accelerator.wait_for_everyone()
        del trainer


if __name__ == "__main__":
    main()
