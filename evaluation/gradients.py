"""Gradient diagnostics: the pruned gradient against the full (stock) gradient on fixed batches, and step timing.

For a policy state and a fixed batch B, g_B is stock TRL's gradient and g^ the pruned trainer's, one mask draw per
global step (the mask seed is a function of the step, so K steps give K independent draws). Per setting:

- ``cos``: E[cos(g^, g_B)], averaged over draws and batches.
- ``rel_mse``: E|g^ - g_B|^2 / |g_B|^2 (variance plus squared bias), averaged over batches.
- ``rel_bias``: |mean_K g^ - g_B|^2 / |g_B|^2 less its expected noise floor rel_mse / K: ~0 when the estimator is
  unbiased for this batch. (Unbiasedness holds for the sampled objective, not the full one, docs/method.md "Bias,
  honestly"; this measures how far that is from the full gradient.)
- ``noise_vs_sgd``: E|g^ - g_B|^2 divided by the minibatch noise of stock SGD at the same batch size,
  E|g_B - g_pool|^2 (pool = all the fixed batches, corrected for its finite size). Pruning at noise ratio r acts
  like shrinking the batch from B pairs to about B / (1 + r) pairs: ``eff_batch``.
- ``cost``: the work of a pruned step relative to stock, in token units (forward 1, backward 2, reference forward 1).

`step_times` times full training steps (forward, backward, clip, optimizer) for several settings round-robin on the
same batches, so that drift in the load of a shared machine hits every setting alike; it reports medians and the
ratio to stock within each round.
"""

import copy
import statistics
import tempfile
import time

import torch
from transformers import AutoTokenizer
from trl import DPOConfig, DPOTrainer

from trl_pruned_dpo import PrunedDPOConfig, PrunedDPOTrainer
from trl_pruned_dpo.seam import train_metrics

from .prototypes import prototype_class
from .settings import Setting


def _trainer(setting: Setting, model, ref_model, tokenizer, train_ds, cfg, output_dir, seed=0):
    common = dict(
        output_dir=output_dir, per_device_train_batch_size=cfg.batch_size, per_device_eval_batch_size=cfg.batch_size,
        learning_rate=cfg.learning_rate, beta=cfg.beta, max_grad_norm=cfg.max_grad_norm, gradient_checkpointing=False,
        bf16=False, fp16=False, use_cpu=True, seed=seed, report_to=[], save_strategy="no", max_length=None,
        disable_tqdm=True, lr_scheduler_type="constant",
    )
    if setting.stock:
        return DPOTrainer(model=model, ref_model=ref_model, args=DPOConfig(**common), train_dataset=train_ds,
                          processing_class=tokenizer)
    prototype = setting.mask_law != "trainer" or setting.balanced
    cls = prototype_class(setting.mask_law, setting.balanced) if prototype else PrunedDPOTrainer
    return cls(model=model, ref_model=ref_model, args=PrunedDPOConfig(**common, **setting.pruning),
               train_dataset=train_ds, processing_class=tokenizer)


def _batches(trainer):
    """The fixed batches, in order, collated exactly as training collates them."""
    loader = trainer.get_eval_dataloader(trainer.train_dataset)
    return [trainer._prepare_inputs(batch) for batch in loader]


def _gradient(trainer, batch, step: int) -> tuple[torch.Tensor, int]:
    """Flat gradient of the training loss on `batch` with the masks of global step `step`, and its token cost."""
    model = trainer.model
    model.train()
    model.zero_grad(set_to_none=True)
    trainer.state.global_step = step
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    train_metrics(trainer).clear()
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()])
    stats = getattr(trainer, "last_prune_stats", None)
    if stats:
        cost = stats["policy_tokens_executed"] + 2 * stats["grad_tokens_executed"] + stats["reference_tokens_executed"]
    else:
        cost = 4 * batch["input_ids"].numel()
    return flat.double(), cost


def diagnose(settings: list[Setting], policy_dir: str, reference_dir: str, rows, cfg, draws: int, batches: int,
             log=print, on_result=None) -> dict:
    """Diagnostics of every setting at the policy in `policy_dir` (reference from `reference_dir`). `rows` are split
    into consecutive batches of `cfg.batch_size` pairs: all of them measure stock's minibatch noise, the first
    `batches` get `draws` mask draws per setting. Returns {setting name: metrics} (and "_meta"); `on_result` is
    called with the results so far after each setting (to save progress)."""
    from datasets import Dataset

    from .sft import load_policy

    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    model, ref_model = load_policy(policy_dir), load_policy(reference_dir)
    train_ds = Dataset.from_list(rows)
    with tempfile.TemporaryDirectory(prefix="quality_grad_") as output_dir:
        stock = _trainer(Setting("stock", "stock", stock=True), model, ref_model, tokenizer, train_ds, cfg, output_dir)
        all_batches = _batches(stock)
        exact = [_gradient(stock, batch, 0) for batch in all_batches]
        full = [g for g, _ in exact]
        pool = torch.stack(full).mean(0)
        n = len(full)
        sgd_noise = sum(float((g - pool).pow(2).sum()) for g in full) / max(n - 1, 1)  # unbiased over batches
        exact, batches = exact[:batches], all_batches[:batches]
        results = {"_meta": {"batches": len(batches), "sgd_batches": n, "batch_size": cfg.batch_size, "draws": draws,
                             "sgd_noise": sgd_noise, "grad_norm": statistics.mean(float(g.norm()) for g in full),
                             "pooled_norm2": float(pool.pow(2).sum())}}
        for setting in settings:
            started = time.perf_counter()
            trainer = _trainer(setting, model, ref_model, tokenizer, train_ds, cfg, output_dir)
            cos, rel_mse, rel_bias, abs_mse, costs = [], [], [], [], []
            for (g, stock_cost), batch in zip(exact, batches):
                norm2 = float(g.pow(2).sum())
                draws_g = []
                for k in range(draws):
                    estimate, cost = _gradient(trainer, batch, k)
                    draws_g.append(estimate)
                    cos.append(float(torch.nn.functional.cosine_similarity(estimate, g, dim=0)))
                    costs.append(cost / stock_cost)
                stacked = torch.stack(draws_g)
                mse = float((stacked - g).pow(2).sum(1).mean())
                abs_mse.append(mse)
                rel_mse.append(mse / norm2)
                bias = float((stacked.mean(0) - g).pow(2).sum()) / norm2
                rel_bias.append(bias - rel_mse[-1] / draws)
            noise_ratio = statistics.mean(abs_mse) / sgd_noise if sgd_noise > 0 else float("nan")
            results[setting.name] = {
                "cos": statistics.mean(cos),
                "cos_min": min(cos),
                "rel_mse": statistics.mean(rel_mse),
                "rel_bias": statistics.mean(rel_bias),
                "noise_vs_sgd": noise_ratio,
                "eff_batch": cfg.batch_size / (1 + noise_ratio),
                "cost": statistics.mean(costs),
            }
            r = results[setting.name]
            if on_result is not None:
                on_result(results)
            log(f"    {setting.name:22s} cos {r['cos']:.3f}  rel_mse {r['rel_mse']:.3f}  bias {r['rel_bias']:+.4f}  "
                f"noise/sgd {r['noise_vs_sgd']:.2f}  cost {r['cost']:.2f}  ({time.perf_counter() - started:.0f}s)")
    return results


def step_times(settings: list[Setting], policy_dir: str, rows, cfg, rounds: int, steps_per_round: int,
               log=print) -> dict:
    """Median seconds per full training step of each setting, timed round-robin on the same batches, and the
    median over rounds of its ratio to stock's time in the same round."""
    from datasets import Dataset

    from .sft import load_policy

    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    base = load_policy(policy_dir)
    train_ds = Dataset.from_list(rows)
    names = [s.name for s in settings]
    times: dict[str, list[float]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="quality_time_") as output_dir:
        runners = {}
        for setting in settings:
            trainer = _trainer(setting, copy.deepcopy(base), copy.deepcopy(base), tokenizer, train_ds, cfg,
                               output_dir)
            trainer.create_optimizer()
            runners[setting.name] = (trainer, _batches(trainer))
        step = 0
        for _ in range(rounds):
            for setting in settings:
                trainer, batches = runners[setting.name]
                elapsed = 0.0
                for i in range(steps_per_round):
                    batch = batches[(step + i) % len(batches)]
                    started = time.perf_counter()
                    trainer.model.train()
                    trainer.state.global_step = step + i
                    loss = trainer.compute_loss(trainer.model, batch)
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), cfg.max_grad_norm)
                    trainer.optimizer.step()
                    trainer.optimizer.zero_grad(set_to_none=True)
                    elapsed += time.perf_counter() - started
                    train_metrics(trainer).clear()
                times[setting.name].append(elapsed / steps_per_round)
            step += steps_per_round
    stock = times[names[0]]
    result = {}
    for name in names:
        ratios = [t / s for t, s in zip(times[name], stock)]
        result[name] = {"step_s": statistics.median(times[name]), "ratio": statistics.median(ratios),
                        "ratio_min": min(ratios), "ratio_max": max(ratios)}
        log(f"    {name:22s} {result[name]['step_s'] * 1e3:7.1f} ms/step  x{result[name]['ratio']:.3f} of stock "
            f"[{result[name]['ratio_min']:.3f}, {result[name]['ratio_max']:.3f}]")
    return result
