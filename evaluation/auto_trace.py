"""The long-run trace of `auto` (docs/quality.md, "`auto` on the regimes cells"): the demo task and model, `auto`
branch probabilities, the noise scale B_simple and the choice every 10 steps.

    python -m evaluation.auto_trace --steps 1000 --out runs/auto_trace.json [--model builtin:tiny-demo-sft]
"""

import argparse
import json
import os
import time
from pathlib import Path


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m evaluation.auto_trace", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=8, help="pairs per micro-batch")
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--model", default="builtin:tiny-demo-sft")
    parser.add_argument("--dataset", default="builtin:sort-short")
    parser.add_argument("--out", type=Path, default=Path("runs/auto_trace.json"))
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_pruned_dpo import PrunedDPOConfig, PrunedDPOTrainer
    from trl_pruned_dpo.demo.model import resolve_model
    from trl_pruned_dpo.demo.tasks import load_builtin

    torch.set_num_threads(1)
    path = resolve_model(args.model)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    config = PrunedDPOConfig(output_dir=str(args.out.parent / "auto_trace_run"), per_device_train_batch_size=args.batch,
                             gradient_accumulation_steps=args.accumulation, max_steps=args.steps, learning_rate=1e-4,
                             branch_keep_prob="auto", prune_common_prefix=True, report_to="none", save_strategy="no",
                             logging_steps=10, use_cpu=True, bf16=False, disable_tqdm=True, seed=0,
                             prune_log_level="debug")
    trainer = PrunedDPOTrainer(model=model, args=config, train_dataset=load_builtin(args.dataset)["train"],
                               processing_class=tokenizer)
    started = time.perf_counter()
    trainer.train()
    logs = [{k: h[k] for k in ("step", "loss", "rewards/accuracies", "prune/branch_keep_prob") if k in h}
            for h in trainer.state.log_history if "loss" in h]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"steps": args.steps, "seconds": time.perf_counter() - started, "logs": logs,
              "pairs_per_step": args.batch * args.accumulation, "history": trainer.auto_keep_probs.history}
    args.out.write_text(json.dumps(record, indent=1, default=str))


if __name__ == "__main__":
    main()
