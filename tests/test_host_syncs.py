"""Device->host reads the plugin adds during training (issue 22, item 5), counted.

Every call that reads a tensor's value on the host (`item`, `tolist`, `float()`, `int()`, `bool()`, `numpy`) and every
collective (`gather`, `reduce`) made from the plugin's own code is recorded with the phase it happened in:

- a micro-step (`training_step`): none. The plugin's metrics stay on the device as counts (metrics.py);
- the end of an optimizer step (`_maybe_log_save_evaluate`, before logging): one fused read (loss, gradient norm,
  stop flag: guards.step_values) when the guard is on, none when it is off;
- a logging step (`log`): one gather and one read for all the plugin's metrics of the window (metrics.flush).

The host planner (method/masks.py, method/packing.py, method/plan.py, method/tree.py) is not counted: it reads the
collator's host copy of the token ids (packing.HostBatch), never a device tensor; test_share_prompt.py checks that the
batch it plans from is that copy.
On a CPU-only machine a host tensor and a device tensor cannot be told apart, hence the exclusion by module.
"""

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from tiny import SAVINGS_OFF, build_trainer, preference_rows
from trl_pruned_dpo import PrunedDPOConfig, PrunedDPOTrainer

PACKAGE = str(Path(__file__).resolve().parents[1] / "trl_pruned_dpo")
HOST_PLANNER = ("method/masks.py", "method/packing.py", "method/plan.py", "method/tree.py")
READS = ("item", "tolist", "__float__", "__int__", "__bool__", "numpy")
STEPS, ACCUMULATION, LOGGING = 4, 2, 2


def count_reads(monkeypatch, trainer) -> Counter:
    """Patch the reads and the trainer's phases; returns the counter of (phase, kind) it fills."""
    counts, phase = Counter(), ["outside"]

    def plugin_caller() -> str | None:
        frame = sys._getframe(2)
        name = frame.f_code.co_filename
        if not name.startswith(PACKAGE) or name.endswith(HOST_PLANNER):
            return None
        return f"{Path(name).relative_to(PACKAGE)}:{frame.f_lineno}"

    for method in READS:
        original = getattr(torch.Tensor, method)

        def counting(self, *args, _original=original, **kwargs):
            if plugin_caller():
                counts[(phase[-1], "read")] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, counting)
    for collective in ("gather", "reduce"):
        original = getattr(trainer.accelerator, collective)

        def counting_collective(*args, _original=original, **kwargs):
            if plugin_caller():
                counts[(phase[-1], "collective")] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(trainer.accelerator, collective, counting_collective)

    def in_phase(name, function):
        def wrapped(*args, **kwargs):
            phase.append(name)
            counts[(name, "calls")] += 1
            try:
                return function(*args, **kwargs)
            finally:
                phase.pop()
        return wrapped

    monkeypatch.setattr(trainer, "training_step", in_phase("micro-step", trainer.training_step))
    trainer.merge_safe_overrides = True  # the wrapper only observes: the step still merges
    monkeypatch.setattr(trainer, "_maybe_log_save_evaluate",
                        in_phase("step end", trainer._maybe_log_save_evaluate))
    monkeypatch.setattr(trainer, "log", in_phase("log", trainer.log))
    return counts


@pytest.mark.parametrize("pruning", ["on", "on-padded", "off"])
def test_plugin_reads_per_micro_step_optimizer_step_and_log(pruning, tokenizer, tmp_path, monkeypatch):
    """"on": pruning with the default exact savings (packed); "on-padded": pruning with them off; "off": every pruning
    and exact saving off (stock's code)."""
    prune = {"branch_keep_prob": 0.5, "position_keep_prob": 0.5, "prefix_prune_prob": 0.5}
    options = {"on": prune, "on-padded": {**prune, **SAVINGS_OFF}, "off": SAVINGS_OFF}[pruning]
    trainer = build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, Dataset.from_list(preference_rows(16)),
                            tmp_path, max_steps=STEPS, gradient_accumulation_steps=ACCUMULATION,
                            per_device_train_batch_size=2, logging_steps=LOGGING, **options)
    counts = count_reads(monkeypatch, trainer)
    trainer.train()
    print(f"pruning {pruning}:", dict(counts))
    assert counts[("micro-step", "calls")] == STEPS * ACCUMULATION
    # the end of each optimizer step; transformers calls it once more at the end of the epoch (no new step then)
    assert counts[("step end", "calls")] in (STEPS, STEPS + 1)
    logs = counts[("log", "calls")]
    assert logs == STEPS // LOGGING + 1  # + the end-of-training summary log
    assert counts[("micro-step", "read")] == 0 and counts[("micro-step", "collective")] == 0
    # (`log` runs inside the step end; its reads count under "log")
    if pruning != "off":
        assert counts[("step end", "read")] == STEPS  # one fused read per optimizer step: the guard (and the stop flag)
        assert counts[("log", "read")] == counts[("log", "collective")] == STEPS // LOGGING  # one per window
        logged = [h for h in trainer.state.log_history if "loss" in h]
        assert len(logged) == STEPS // LOGGING and all(
            0 < h["prune/positions_scored"] < 1 and isinstance(h["prune/positions_scored"], float) for h in logged)
    else:
        assert counts[("step end", "read")] == 0 and counts[("log", "read")] == 0
        assert not any(k.startswith("prune/") for h in trainer.state.log_history for k in h)
