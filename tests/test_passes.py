"""Issue 44's CPU proxies of a GPU step's host cost, per optimizer step, plugin against stock (benchmarks/passes.py).

One `train()` of 2 optimizer steps of 2 pairs x gradient accumulation 4 on the tiny 2-layer model (checkpointing on,
TRL's default), per row: stock `DPOTrainer`, the plugin's defaults (padding_free, share_prompt) and its exact preset
(+ prune_common_prefix), with `sigmoid`, and the defaults with `aot_unpaired` (a TRL 1.16 loss with a batch statistic:
it pairs the micro-batch's sorted chosen and rejected log-ratios by rank). Counted by `benchmarks.passes.StepProbe` on the second step: decoder-layer calls (policy, reference,
checkpointing replays) and device->host reads (`raw`: every scalar read and `tolist`/`numpy`; `reads`: without the host
planner's; `device`: of tensors derived from the device batch or the weights), and the first step's update (SGD at
learning rate 1: the accumulated gradient) against stock's.

What the code meets today is asserted; the issue's targets it does not meet yet are `xfail(strict=True)`, so the day a
change meets one, its test fails until the marker is removed.
"""

import os
import sys

import pytest
from datasets import Dataset
from transformers.trainer_callback import PrinterCallback

from tiny import build_trainer, preference_rows
from trl import DPOConfig, DPOTrainer
from trl_pruned_dpo import PrunedDPOConfig, PrunedDPOTrainer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.passes import HOST_PLANNER, agreement, measure  # noqa: E402

LAYERS, ACCUMULATION, PAIRS, STEPS = 2, 4, 2, 2
BATCH_LOSS = "aot_unpaired"
CELLS = [("sigmoid", "stock"), ("sigmoid", "defaults"), ("sigmoid", "exact"), (BATCH_LOSS, "stock"),
         (BATCH_LOSS, "defaults")]
PLUGIN_CELLS = [cell for cell in CELLS if cell[1] != "stock"]
# Measured (here and on the bench model): TRL's 15 metric reads of `_compute_loss`, as stock's, + transformers'
# packed-sequence check (masking_utils.find_packed_sequence_indices) in each packed forward, policy and reference.
DEVICE_READS_PER_MICRO_STEP = 17


@pytest.fixture(scope="module")
def measured(tokenizer, tmp_path_factory):
    """(loss, row) -> benchmarks.passes.measure's result; one tiny `train()` each (~1-2 s)."""
    data = Dataset.from_list(preference_rows(PAIRS * ACCUMULATION * STEPS))
    training = dict(gradient_accumulation_steps=ACCUMULATION, per_device_train_batch_size=PAIRS, max_steps=STEPS,
                    optim="sgd", learning_rate=1.0, lr_scheduler_type="constant", weight_decay=0.0)
    results = {}
    for loss, row in CELLS:
        classes = (DPOTrainer, DPOConfig) if row == "stock" else (PrunedDPOTrainer, PrunedDPOConfig)
        extra = {"prune_common_prefix": True} if row == "exact" else {}
        trainer = build_trainer(*classes, tokenizer, data, tmp_path_factory.mktemp(f"{loss}_{row}"),
                                loss_type=[loss], **training, **extra)
        trainer.remove_callback(PrinterCallback)
        results[(loss, row)] = measure(trainer)
    return results


def last(result) -> dict:
    return result["steps"][STEPS]


def test_every_row_trains_the_same_batches(measured):
    assert len({str(r["batches"]) for r in measured.values()}) == 1
    assert all(len(r["batches"][step]) == ACCUMULATION for r in measured.values() for step in (1, 2))


def test_the_batch_statistic_is_live(measured):
    """The batch-statistic loss pairs rows by rank, not as sigmoid does: its update is not sigmoid's (else its
    agreement checks would repeat sigmoid's)."""
    assert agreement(measured[(BATCH_LOSS, "stock")]["gradient"], measured[("sigmoid", "stock")]["gradient"]) > 1e-3


@pytest.mark.parametrize("loss", ["sigmoid", BATCH_LOSS])
def test_stock_runs_each_layer_once_per_micro_step_for_policy_reference_and_replay(measured, loss):
    """The counter itself: stock's policy forward, reference forward and checkpointing replay, per layer per micro-step
    (a pass the probe misses or counts twice fails here)."""
    s = last(measured[(loss, "stock")])
    assert (s["policy"], s["reference"], s["recompute"], s["policy_no_grad"]) == (LAYERS * ACCUMULATION,) * 3 + (0,)


@pytest.mark.parametrize("cell", PLUGIN_CELLS, ids="-".join)
def test_plugin_never_runs_the_model_more_often_than_stock(measured, cell):
    s, stock = last(measured[cell]), last(measured[(cell[0], "stock")])
    assert s["policy"] + s["reference"] <= stock["policy"] + stock["reference"]
    assert s["recompute"] <= stock["recompute"] and s["policy_no_grad"] == 0


@pytest.mark.xfail(strict=True, reason="issue 44: passes over the model <= 0.5x stock's at the default budget: the "
                   "merged step's default (stock's padded tokens of the widest micro-batch) merges nothing on these "
                   "near-uniform tiny rows (1.0x); on the bench's ragged workloads it gives 0.25-0.5x, and the "
                   "whole-step budget one pass (benchmarks/merged_step.py, tests/test_merged_step.py)")
@pytest.mark.parametrize("cell", PLUGIN_CELLS, ids="-".join)
def test_plugin_passes_at_most_half_of_stocks(measured, cell):
    s, stock = last(measured[cell]), last(measured[(cell[0], "stock")])
    assert s["policy"] + s["reference"] <= 0.5 * (stock["policy"] + stock["reference"])


@pytest.mark.parametrize("cell", PLUGIN_CELLS, ids="-".join)
def test_plugin_reads_from_the_device_no_more_than_stock(measured, cell):
    """Per optimizer step outside the logging step, and per micro-step; of device provenance and without the host
    planner's (today: TRL's own metric reads, as stock's, + transformers' packed-sequence check per packed forward
    instead of stock's two SDPA mask checks, + the guard's one fused read at the step's end)."""
    s, stock = last(measured[cell]), last(measured[(cell[0], "stock")])
    assert s["device"] <= stock["device"] and s["reads"] <= stock["reads"]
    micro, stock_micro = s["by_phase"]["micro-step"], stock["by_phase"]["micro-step"]
    assert micro["device"] <= stock_micro["device"] and micro["device"] <= DEVICE_READS_PER_MICRO_STEP * ACCUMULATION
    assert s["by_phase"]["step end"] == {"raw": 1, "reads": 1, "device": 1}  # guards.step_values
    assert s["log_device"] <= stock["log_device"] + 1  # + the plugin's metrics, one read (metrics.PendingMetrics.flush)


@pytest.mark.parametrize("cell", PLUGIN_CELLS, ids="-".join)
def test_host_planner_reads_only_host_tensors(measured, cell):
    """The exclusion of method/{masks,plan,tree}.py from `reads` is sound only while none of their reads is of a
    device tensor: none is, and they are most of `raw`'s excess over stock's."""
    result = measured[cell]
    planner_sites = [site for sites in result["sites"].values() for site in sites
                     if site.split(" ")[-1].split(":")[0] in HOST_PLANNER]
    assert planner_sites and not any("(device)" in site for site in planner_sites)
    s = last(result)
    assert s["planner"] > 0 and s["raw"] == s["reads"] + s["planner"]


@pytest.mark.xfail(strict=True, reason="issue 44: reads <= stock's counted raw (every scalar read and tolist, host "
                   "tensors included: the issue's 144 against 88); the excess is the host planner's int()/tolist() "
                   "of host copies (~18 per micro-step), no device sync on a GPU, but host-side dispatch each")
@pytest.mark.parametrize("cell", PLUGIN_CELLS, ids="-".join)
def test_plugin_raw_reads_at_most_stocks(measured, cell):
    assert last(measured[cell])["raw"] <= last(measured[(cell[0], "stock")])["raw"]


@pytest.mark.parametrize("cell", PLUGIN_CELLS, ids="-".join)
def test_plugin_update_equals_stocks(measured, cell):
    """The first optimizer step's update (SGD at lr 1: the gradient accumulated over its 4 micro-steps, read before
    clipping, which would hide a wrong scale) equals stock's to fp32 round-off (measured ~3e-6 of its norm here and on
    the bench model, benchmarks/results/passes_cpu/), and so does the clipped update SGD applied."""
    result, stock = measured[cell], measured[(cell[0], "stock")]
    assert stock["gradient"].norm() > 0 and agreement(result["gradient"], stock["gradient"]) < 3e-5
    assert agreement(result["update"], stock["update"]) < 3e-5
