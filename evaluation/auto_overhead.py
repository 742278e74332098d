"""What `auto` costs where it keeps everything (issue 32): the demo's run (configs/demo.yaml: builtin:tiny-demo-sft,
builtin:sort-short near-copies, 8 pairs per step) with `branch_keep_prob` / `position_keep_prob` "auto" against the
same run at 1.0 (the exact path, every other setting equal), alternating in one process, one torch thread, CPU time
(`time.process_time`) of each optimizer step (on_step_begin -> on_step_end: forward, backward, auto's hooks and
reduction, clipping, optimizer); medians.

    python -m evaluation.auto_overhead --rounds 4 --steps 60 [--model builtin:small-demo] [--profile]
"""

import argparse
import os
import statistics
import tempfile
import time


def build(model_path, dataset, steps, auto: bool, batch: int, output_dir: str, extra: dict):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_pruned_dpo import PrunedDPOConfig, PrunedDPOTrainer

    probs = "auto" if auto else 1.0
    config = PrunedDPOConfig(
        output_dir=output_dir, per_device_train_batch_size=batch, max_steps=steps, learning_rate=1e-4,
        lr_scheduler_type="cosine", warmup_steps=10, beta=0.1, bf16=False, gradient_checkpointing=False,
        logging_steps=25, save_strategy="no", report_to="none", seed=0, disable_tqdm=True, use_cpu=True,
        dataloader_num_workers=0, prune_common_prefix=True, share_prompt=True, padding_free=True,
        branch_keep_prob=probs, position_keep_prob=probs, **extra)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return PrunedDPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_path),
                            ref_model=AutoModelForCausalLM.from_pretrained(model_path), args=config,
                            train_dataset=dataset, processing_class=tokenizer)


def timed_run(trainer) -> list[float]:
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback

    class StepClock(TrainerCallback):
        def __init__(self):
            self.times, self.t0 = [], None

        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.process_time() - self.t0)

    clock = StepClock()
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(clock)
    trainer.train()
    return clock.times


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m evaluation.auto_overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny-demo-sft")
    parser.add_argument("--dataset", default="builtin:sort-short")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prefix", type=float, default=0.5, help="prefix_prune_prob (the demo's 0.5)")
    parser.add_argument("--profile", action="store_true", help="one run each under torch.profiler; top ops")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from trl_pruned_dpo.demo.model import resolve_model
    from trl_pruned_dpo.demo.tasks import load_builtin

    torch.set_num_threads(1)
    path, dataset = resolve_model(args.model), load_builtin(args.dataset)["train"]
    extra = {"prefix_prune_prob": args.prefix, "prefix_min_ratio": 0.5}
    per_step = {True: [], False: []}
    ratios, totals = [], {True: [], False: []}
    with tempfile.TemporaryDirectory() as out:
        for r in range(args.rounds):
            order = (True, False) if r % 2 == 0 else (False, True)
            medians = {}
            for auto in order:
                trainer = build(path, dataset, args.steps, auto, args.batch, out, extra)
                if args.profile and r == 0:
                    from torch.profiler import ProfilerActivity, profile
                    with profile(activities=[ProfilerActivity.CPU]) as prof:
                        times = timed_run(trainer)
                    print(f"--- auto={auto}\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
                else:
                    times = timed_run(trainer)
                per_step[auto] += times[2:]
                medians[auto], totals[auto] = statistics.median(times[2:]), totals[auto] + [sum(times)]
                history = trainer.auto_keep_probs.history if auto else []
                kinds = history[-1]["reason"][:60] if history else ""
                print(f"round {r} auto={auto}: median step {medians[auto] * 1e3:.2f} ms, total {sum(times):.2f} s "
                      f"{kinds}", flush=True)
            ratios.append(medians[True] / medians[False])
    print(f"auto on / off, median step CPU time per round: {[round(x, 3) for x in ratios]}; "
          f"median {statistics.median(ratios):.3f}; pooled medians {statistics.median(per_step[True]) * 1e3:.2f} vs "
          f"{statistics.median(per_step[False]) * 1e3:.2f} ms; total CPU s (median over rounds) "
          f"{statistics.median(totals[True]):.2f} vs {statistics.median(totals[False]):.2f}")


if __name__ == "__main__":
    main()
