"""What GPU users run, on CPU (issue 48): fp16 with a loss scaler, an `IterableDataset`, `torch_compile`.

- fp16 + GradScaler. The overflow steps the scaler skips are not divergence; a non-finite loss and a scale that
  collapses (an overflow at a loss scale of 1 or less) still stop the run (safety/guards.py). Real here: torch's
  `GradScaler("cpu")`, fp16 autocast on CPU (accelerate's `native_amp` forward wrapper), transformers' default fused
  AdamW and the non-fused one, the whole Trainer loop with the plugin's pruned, packed forward. Stand-in: accelerate
  builds no scaler on CPU (it needs a GPU for fp16), so the test gives the accelerator the one it would build on
  CUDA; and the overflow is forced (a gradient hook multiplies the scaled gradient by inf), where a GPU run overflows
  by itself.
- `IterableDataset`: its batches carry the collator's host copy of the token layout, so the plan reads nothing from
  the device (reference.py), in one process or where each process collates its own batches; batches dispatched from
  process 0 arrive on the device, one fused read each, said once.
"""

import math
import os
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

from tiny import build_trainer, preference_rows, with_cpu_loss_scaler
from trl_pruned_dpo import PrunedDPOConfig, PrunedDPOTrainer
from trl_pruned_dpo.errors import TrainingDiverged
from trl_pruned_dpo.safety import guards
from trl_pruned_dpo.safety.guards import MIN_LOSS_SCALE, DivergenceGuard

# benchmarks/passes.py's probe counts the device reads (as tests/test_passes.py imports it)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRUNE = dict(position_keep_prob=0.5)


# --- fp16 with a loss scaler: the guard, with stand-ins ---------------------------------------------------------------
def test_a_step_the_scaler_skipped_is_not_divergence():
    """Failed before the fix: `observe(1, 0.69, inf)` said "gradient norm is inf" whatever the scaler did."""
    guard = DivergenceGuard()
    assert guard.observe(1, 0.69, math.inf, skipped=True, loss_scale=2.0**16) is None
    assert guard.observe(2, 0.69, math.nan, skipped=True, loss_scale=2.0**15) is None
    assert guard.observe(3, 0.68, 0.5) is None
    # the overflow's norm is not the model's: not the worst, not non-finite, counted as skipped
    assert guard.worst_grad_norm == (3, 0.5) and guard.nonfinite_steps == 0 and guard.skipped_steps == 2
    assert "2 of 3 steps skipped by the fp16 loss scaler" in guard.summary()
    # kept across a resume
    resumed = DivergenceGuard.from_run_state({"guard": guard.state_dict()})
    assert resumed.skipped_steps == 2
    # an older checkpoint's guard has no such count
    old = {k: v for k, v in guard.state_dict().items() if k != "skipped_steps"}
    assert DivergenceGuard.from_run_state({"guard": old}).skipped_steps == 0


def test_the_guard_still_stops_a_real_divergence_under_fp16():
    guard = DivergenceGuard()
    # the forward overflowed: no loss scale fixes that
    assert guard.observe(1, math.nan, math.inf, skipped=True, loss_scale=2.0**16) == "loss is nan"
    # the scale collapsed: an overflow at a scale of 1 or less
    assert guard.observe(2, 0.7, math.inf, skipped=True, loss_scale=2.0) is None
    assert guard.observe(3, 0.7, math.inf, skipped=True, loss_scale=MIN_LOSS_SCALE).startswith(
        "the fp16 loss scaler skipped it at loss scale 1: its gradient overflows fp16 even unscaled")
    # without a scaler's skip, a non-finite gradient norm stops as before
    assert guard.observe(4, 0.7, math.inf) == "gradient norm is inf"


class _StandInScaler:
    """What the guard reads of a `torch.amp.GradScaler`: `is_enabled()` and the device tensor `_scale`."""

    def __init__(self, scale: float):
        self._scale = torch.tensor(scale)

    def is_enabled(self) -> bool:
        return True


def _stand_in_accelerator(scale: float, flagged: bool) -> SimpleNamespace:
    return SimpleNamespace(scaler=_StandInScaler(scale), optimizer_step_was_skipped=flagged)


@pytest.mark.parametrize("flagged", [False, True], ids=["fused-optimizer", "accelerate-flag"])
def test_step_values_see_a_skip_either_way(flagged):
    """A fused optimizer leaves accelerate's flag False: the scale halved says it. A non-fused one: the flag says it."""
    before = torch.tensor(2.0**16)
    after = 2.0**16 if flagged else 2.0**15
    loss, norm, stop, skipped, scale = guards.step_values(_stand_in_accelerator(after, flagged), 1,
                                                          torch.tensor(0.69), torch.tensor(math.inf), False, before)
    assert (loss, stop, skipped, scale) == (pytest.approx(0.69), False, True, 2.0**16) and math.isinf(norm)
    # a good step, and one where the scale grew (after a run of good steps): not skipped
    for good in (2.0**16, 2.0**17):
        assert guards.step_values(_stand_in_accelerator(good, False), 1, torch.tensor(0.69), torch.tensor(1.0),
                                  False, before)[3] is False
    # no scaler (bf16, fp32): nothing to compare
    no_scaler = SimpleNamespace(scaler=None, optimizer_step_was_skipped=False)
    assert guards.step_values(no_scaler, 1, torch.tensor(0.69), 1.0, False)[3:] == (False, None)


def _stand_in_trainer(tmp_path, fp16: bool, flagged: bool) -> SimpleNamespace:
    args = SimpleNamespace(stop_on_divergence=True, world_size=1, fp16=fp16)
    control = SimpleNamespace(should_training_stop=False, should_save=False, should_evaluate=False)
    accelerator = SimpleNamespace(scaler=None, optimizer_step_was_skipped=flagged)
    return SimpleNamespace(args=args, control=control, accelerator=accelerator, state=SimpleNamespace(global_step=3))


@pytest.mark.parametrize("fp16", [True, False], ids=["fp16", "bf16-deepspeed"])
def test_only_an_fp16_skip_is_excused(tmp_path, fp16):
    """DeepSpeed's bf16 optimizer also skips a step with a non-finite gradient norm (accelerate's flag says so), with
    no loss scale to back off: there it is divergence. Under fp16 (DeepSpeed's loss scaler, no accelerate scaler) it is
    not; DeepSpeed stops by itself at its minimum scale."""
    trainer = _stand_in_trainer(tmp_path, fp16, flagged=True)
    run_state = SimpleNamespace(stop_request=None, divergence_guard=DivergenceGuard())
    problem = guards.check_step(trainer, run_state, torch.tensor(0.69), torch.tensor(math.inf), str(tmp_path))
    if fp16:
        assert problem is None and run_state.divergence_guard.skipped_steps == 1
    else:
        assert "gradient norm is inf" in problem and trainer.control.should_training_stop


# --- fp16 with a loss scaler: the real Trainer loop ------------------------------------------------------------------
class _StepRecorder(TrainerCallback):
    """Per optimizer step: accelerate's skip flag, the loss scale after the step, and whether the weights moved."""

    def __init__(self, trainer):
        self.trainer, self.flags, self.scales, self.moved = trainer, [], [], []
        self._before = None

    def on_step_begin(self, args, state, control, **kwargs):
        self._before = self.trainer.model.model.norm.weight.detach().clone()

    def on_step_end(self, args, state, control, **kwargs):
        self.flags.append(self.trainer.accelerator.optimizer_step_was_skipped)
        self.scales.append(self.trainer.accelerator.scaler.get_scale())
        self.moved.append(not torch.equal(self._before, self.trainer.model.model.norm.weight))


def fp16_scaled_trainer(tokenizer, tmp_path, overflow_steps, init_scale=2.0**4, **overrides):
    """The plugin's trainer under fp16 autocast with a real `torch.amp.GradScaler` on CPU (accelerate builds it only
    on a GPU); the scaled gradient overflows (times inf) at the optimizer steps in `overflow_steps`."""
    trainer = build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, Dataset.from_list(preference_rows(16)),
                            tmp_path, fp16=True, per_device_train_batch_size=2, max_steps=4, **{**PRUNE, **overrides})
    with_cpu_loss_scaler(trainer, init_scale, overflow_steps)
    recorder = _StepRecorder(trainer)
    trainer.add_callback(recorder)
    return trainer, recorder


@pytest.mark.parametrize("optim", ["adamw_torch_fused", "adamw_torch"])
def test_fp16_overflow_steps_are_skipped_and_training_goes_on(tokenizer, tmp_path, optim):
    """Failed before the fix: "training diverged at step 1: gradient norm is inf". With the fused optimizer
    (transformers' default) accelerate's `optimizer_step_was_skipped` stays False although the scaler skipped the step
    and halved its scale: the guard sees the halved scale (this pins GradScaler's private `_scale`)."""
    trainer, recorder = fp16_scaled_trainer(tokenizer, tmp_path, overflow_steps={0, 2}, optim=optim)
    trainer.train()
    assert trainer.state.global_step == 4
    assert recorder.moved == [False, True, False, True]
    assert recorder.scales == [8.0, 8.0, 4.0, 4.0]  # backed off at each overflow
    assert recorder.flags == ([False] * 4 if optim == "adamw_torch_fused" else [True, False, True, False])
    guard = trainer.run_state.divergence_guard
    assert guard.skipped_steps == 2 and guard.nonfinite_steps == 0 and math.isfinite(guard.worst_grad_norm[1])


def test_fp16_scale_collapse_stops_the_run(tokenizer, tmp_path):
    """Every step overflows: from a scale of 2 the scaler skips at 2, then at 1, where the run stops."""
    trainer, recorder = fp16_scaled_trainer(tokenizer, tmp_path, overflow_steps=range(10), init_scale=2.0)
    with pytest.raises(TrainingDiverged, match=r"diverged at step 2: the fp16 loss scaler skipped it at loss scale 1"):
        trainer.train()
    assert recorder.moved == [False, False]


# --- IterableDataset: the collator's host copy -----------------------------------------------------------------------
def iterable_trainer(tokenizer, tmp_path, **overrides):
    data = Dataset.from_list(preference_rows(16)).to_iterable_dataset()
    settings = dict(max_steps=2, per_device_train_batch_size=2, gradient_accumulation_steps=2, **PRUNE)
    return build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, data, tmp_path, **{**settings, **overrides})


def test_an_iterable_dataset_plans_without_device_reads(tokenizer, tmp_path):
    """Failed before the fix: `host_batch` copied the three layout tensors from the device, 3 reads per micro-step
    (benchmarks/passes.py's probe: `host copy (device) trl_pruned_dpo/reference.py`). In one process accelerate's
    dispatcher passes the collated batch, host copy included, through unchanged."""
    from benchmarks.passes import measure

    trainer = iterable_trainer(tokenizer, tmp_path)
    result = measure(trainer, capture_update=False)
    plugin_copies = [(phase, site, count) for phase, sites in result["sites"].items() for site, count in sites.items()
                     if "trl_pruned_dpo/reference.py" in site]
    assert plugin_copies == []
    assert trainer.state.global_step == 2


def test_an_iterable_dataset_trains_merged_as_unmerged(tokenizer, tmp_path):
    """With its host copy, an iterable dataset's step merges (merged_step.py needs the copy); it trains as unmerged."""
    merged, unmerged = (iterable_trainer(tokenizer, tmp_path / name, step_token_budget=budget, max_steps=3)
                        for name, budget in (("merged", 10**9), ("unmerged", 0)))
    passes = []
    original = merged.merged_forward
    merged.merged_forward = lambda model, batches: passes.append(len(batches)) or original(model, batches)
    merged.train()
    unmerged.train()
    assert passes and all(size == 2 for size in passes)
    for a, b in zip(merged.state.log_history, unmerged.state.log_history, strict=True):
        for key in ("loss", "grad_norm", "rewards/margins"):
            if key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), key


@pytest.mark.parametrize("world, dispatch, dispatched", [(1, None, False), (2, None, True), (2, True, True),
                                                          (2, False, False)])
def test_dispatched_iterable_batches_are_said_once(world, dispatch, dispatched):
    """Across processes accelerate dispatches an IterableDataset's batches from process 0 as device tensors (unless
    `dispatch_batches=False`): no host copy can travel, the collator attaches none and says so."""
    from trl_pruned_dpo.reference import HostCopyCollator, batches_dispatched, pruned_collator

    args = SimpleNamespace(world_size=world, accelerator_config=SimpleNamespace(dispatch_batches=dispatch),
                           precompute_ref_log_probs=False)
    data = Dataset.from_list(preference_rows(4)).to_iterable_dataset()
    assert batches_dispatched(args, data) is dispatched
    assert batches_dispatched(args, Dataset.from_list(preference_rows(4))) is False  # map-style: each its own
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        collator = pruned_collator(object(), args, data)
    assert isinstance(collator, HostCopyCollator) is not dispatched
    said = [str(w.message) for w in caught]
    assert (said == []) if not dispatched else (len(said) == 1 and "dispatch_batches': False" in said[0])


def test_the_fallback_host_copy_is_one_transfer():
    """Without the collator's copy (dispatched batches, precompute, custom loops): one device->host copy of the three
    layout tensors, each keeping its dtype."""
    from trl_pruned_dpo.reference import host_batch

    inputs = {"input_ids": torch.tensor([[5, 6, 0]]), "attention_mask": torch.tensor([[1, 1, 0]], dtype=torch.int32),
              "completion_mask": torch.tensor([[0, 1, 0]], dtype=torch.bool)}
    copies = []
    original = torch.Tensor.cpu

    def counted(tensor, *args, **kwargs):
        copies.append(tensor.shape)
        return original(tensor, *args, **kwargs)

    torch.Tensor.cpu = counted
    try:
        host = host_batch(inputs)
    finally:
        torch.Tensor.cpu = original
    assert copies == [torch.Size([3, 1, 3])]
    for key in inputs:
        assert torch.equal(getattr(host, key), inputs[key]) and getattr(host, key).dtype == inputs[key].dtype


# --- torch_compile ---------------------------------------------------------------------------------------------------
def compiled_trainer(tokenizer, tmp_path, **overrides):
    settings = dict(torch_compile=True, torch_compile_backend="eager", per_device_train_batch_size=2)
    return build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, Dataset.from_list(preference_rows(24)),
                         tmp_path, **{**settings, **overrides})


@pytest.mark.parametrize("pruning", [True, False], ids=["pruning-on", "savings-only"])
def test_torch_compile_runs_without_the_packed_forward_said_once(tokenizer, tmp_path, pruning):
    """Failed before the fix: the packed forward ran compiled, without a word, and recompiled TRL's fused forward
    (which inlines the packed attention's per-segment split: a guard on each layout's segment lengths) until torch's
    recompile limit within 8 steps, at 2.6x stock's CPU time (backend "eager" on CPU, 2-layer model). Now it runs
    padded rows with pruning on, TRL's own forward with only the exact savings on; one line says why and what to set.
    Measured, not run here (~40-90 s of CPU): padded pruned rows under the same compile recompile 31 times in 8 steps
    and the same 31 in 20 (sizes marked dynamic), no frame at the limit."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = compiled_trainer(tokenizer, tmp_path, **(PRUNE if pruning else {}))
    said = [str(w.message) for w in caught if "torch_compile" in str(w.message)]
    assert len(said) == 1 and "set torch_compile=False to keep them" in said[0]
    assert said[0].startswith("padding_free and share_prompt ignored")
    choice = trainer.forward_choice
    assert not choice.packed and choice.pruned is pruning
