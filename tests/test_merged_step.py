"""The merged step (merged_step.py, docs/method.md "Merged steps"): the micro-batches of one optimizer step run in as
few packed passes as `step_token_budget` allows, TRL's loss still per micro-batch.

Checked on the tiny model, one optimizer step of 4 micro-batches of 2 pairs, plain SGD at learning rate 1 without
clipping (so the update is minus the accumulated gradient):
- the update equals the unmerged one and stock TRL's accumulation to fp32 round-off, for `sigmoid` and a loss with
  batch statistics (`bco_pair`'s running mean over the micro-batch), and with pruning on (the same masks);
- the logged metrics are the unmerged run's, key for key;
- decoder-layer calls (policy and reference) per optimizer step: at the default budget at most half the unmerged
  ones, with the budget raised to the whole step one policy pass and one reference pass, and gradient checkpointing
  switched off once per pass;
- each fallback says one line, once, and trains exactly as `step_token_budget=0` (unmerged): among them NEFTune and a
  subclass overriding what a merged pass calls once per pass (`compute_loss`: an L2 term per call, TRL's own loss);
- ranks group from the same numbers (`agreed_across_ranks`, two ranks simulated by threads; the real two-process runs
  are tests/test_distributed.py's), and the LoRA reference (no `ref_model`) runs outside the wrapper training hands
  `compute_loss` (DDP's), merged or not;
- a run resumed from a mid-run checkpoint logs and ends as the uninterrupted one.
"""

import shutil
import warnings
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from tiny import SAVINGS_OFF, build_trainer, lora_trainer, preference_rows, ragged_rows
from trl import DPOConfig, DPOTrainer

from trl_pruned_dpo import PrunedDPOConfig, PrunedDPOTrainer
from trl_pruned_dpo.merged_step import StepPasses, agreed_across_ranks, bypassed_overrides, why_unmerged
from trl_pruned_dpo.method.packing import concat_groups, split_grid
from trl_pruned_dpo.method.plan import group_passes
from trl_pruned_dpo.pruned_forward import reference_log_probs

STEP = dict(max_steps=1, per_device_train_batch_size=2, gradient_accumulation_steps=4, optim="sgd", learning_rate=1.0,
            max_grad_norm=0.0, lr_scheduler_type="constant")
WHOLE_STEP = 10**9
NOTICE = "Merged step off (`step_token_budget`)"


def one_step(tokenizer, tmp_path, trainer_cls=PrunedDPOTrainer, config_cls=PrunedDPOConfig, rows=None, patch=None,
             **config):
    """Train `config` for one optimizer step (`patch`: called with the trainer first): (update, {"policy",
    "reference": passes over the model}, logged entry, the warnings said, the times gradient checkpointing was
    switched off for a no-grad block)."""
    dataset = Dataset.from_list(rows or ragged_rows())
    trainer = build_trainer(trainer_cls, config_cls, tokenizer, dataset, tmp_path, **{**STEP, **config})
    if patch is not None:
        patch(trainer)
    calls = {"policy": 0, "reference": 0}
    models = {"policy": trainer.model, "reference": trainer.ref_model}
    for name, model in models.items():
        for layer in model.model.layers if model is not None else ():
            layer.register_forward_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
    toggles = []
    disable = trainer.model.gradient_checkpointing_disable
    trainer.model.gradient_checkpointing_disable = lambda: (toggles.append(1), disable())[1]
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        trainer.train()
    update = torch.cat([(p.detach() - before[name]).flatten() for name, p in trainer.model.named_parameters()])
    layers = len(trainer.model.model.layers)
    passes = {name: count // layers for name, count in calls.items()}
    entry = next(e for e in trainer.state.log_history if "loss" in e)
    return update, passes, entry, [str(w.message) for w in said if NOTICE in str(w.message)], len(toggles)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_passes_are_consecutive_runs_within_the_budget():
    assert group_passes([3, 3, 3, 3], 6) == [2, 2]
    assert group_passes([3, 3, 3, 3], 100) == [4]
    assert group_passes([5, 2, 9, 1], 7) == [2, 1, 1]  # 9 over the budget: alone
    assert group_passes([4, 4, 4], 3) == [1, 1, 1]
    a, b, c = ({"i": i} for i in range(3))
    step = StepPasses(((a, b), (c,)))
    assert step.ending_with(a) == () and step.ending_with(b) == (a, b) and step.ending_with(c) == (c,)
    assert step.ending_with({"i": 0}) is None  # identity, not equality: a batch of another step runs alone


@pytest.mark.parametrize("budget", [-1, True, 2.5, "1000"])
def test_a_budget_that_is_not_a_token_count_is_refused(tmp_path, budget):
    with pytest.raises(ValueError, match="step_token_budget"):
        PrunedDPOConfig(output_dir=str(tmp_path), bf16=False, step_token_budget=budget)


def test_concatenated_groups_give_each_group_its_own_log_probs(tokenizer, tmp_path):
    """Two micro-batches' packed reference groups end to end in one forward (`concat_groups`), each grid cut back out
    (`split_grid`): each micro-batch's per-token log-probs are its own forward's."""
    trainer = build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, Dataset.from_list(ragged_rows()), tmp_path,
                            per_device_train_batch_size=2)
    batches = [trainer._prepare_inputs(batch) for batch, _ in zip(trainer.get_train_dataloader(), range(3))]
    plans = [trainer.plan(batch) for batch in batches]
    context = trainer.forward_context()
    alone = [reference_log_probs(context, trainer.ref_model, plan.reference, batch) for plan, batch in
             zip(plans, batches)]
    merged = concat_groups([plan.reference for plan in plans])
    assert merged.tokens == sum(plan.reference.tokens for plan in plans)
    assert merged.bounds[0][-1] == merged.tokens and merged.bounds[1][-1] == int(merged.cu_seq_k[-1])
    together = reference_log_probs(context, trainer.ref_model, merged, batches[-1])
    pieces = split_grid(together, [tuple(plan.reference.source.shape) for plan in plans])
    for own, piece in zip(alone, pieces):
        assert piece.shape == own.shape
        torch.testing.assert_close(piece, own, rtol=0, atol=2e-6)


@pytest.fixture(scope="module")
def runs(tokenizer, tmp_path_factory) -> dict:
    """One optimizer step per (loss type, trainer): stock TRL, unmerged, merged at the default budget and whole."""
    out = {}
    for loss in ("sigmoid", "bco_pair"):
        for name, trainer_cls, config_cls, config in (
            ("stock", DPOTrainer, DPOConfig, {}),
            ("unmerged", PrunedDPOTrainer, PrunedDPOConfig, dict(step_token_budget=0)),
            ("default", PrunedDPOTrainer, PrunedDPOConfig, {}),
            ("whole", PrunedDPOTrainer, PrunedDPOConfig, dict(step_token_budget=WHOLE_STEP)),
        ):
            out[loss, name] = one_step(tokenizer, tmp_path_factory.mktemp(name), trainer_cls, config_cls,
                                       loss_type=[loss], **config)
    return out


@pytest.mark.parametrize("loss", ["sigmoid", "bco_pair"])
def test_update_equals_unmerged_and_stock_accumulation(runs, loss):
    stock, unmerged = runs[loss, "stock"][0], runs[loss, "unmerged"][0]
    assert relative(unmerged, stock) < 1e-5
    for name in ("default", "whole"):
        assert relative(runs[loss, name][0], unmerged) < 1e-5, name
        assert relative(runs[loss, name][0], stock) < 1e-5, name


@pytest.mark.parametrize("loss", ["sigmoid", "bco_pair"])
def test_logged_metrics_equal_unmerged(runs, loss):
    unmerged = runs[loss, "unmerged"][2]
    stock = runs[loss, "stock"][2]
    assert runs[loss, "unmerged"][3] == runs[loss, "default"][3] == []  # merging said nothing
    for name in ("default", "whole"):
        entry = runs[loss, name][2]
        assert set(entry) == set(unmerged), name
        for key, value in unmerged.items():
            if isinstance(value, float) and "runtime" not in key and "per_second" not in key:
                assert entry[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (name, key)
        assert entry["loss"] == pytest.approx(stock["loss"], rel=1e-5)


def test_passes_over_the_model_per_step(runs):
    unmerged, default, whole = (runs["sigmoid", name][1] for name in ("unmerged", "default", "whole"))
    assert unmerged == {"policy": 4, "reference": 4} == runs["sigmoid", "stock"][1]
    assert default["policy"] + default["reference"] <= (unmerged["policy"] + unmerged["reference"]) / 2
    assert whole == {"policy": 1, "reference": 1}
    # Gradient checkpointing (on: DPOConfig's default) is switched off once per pass, for its no-grad block.
    assert runs["sigmoid", "unmerged"][4] == 4 and runs["sigmoid", "whole"][4] == 1


@pytest.mark.parametrize("config", [
    dict(position_keep_prob=0.5, prefix_prune_prob=0.5),  # the same masks, merged or not
    dict(precompute_ref_log_probs=True, prune_common_prefix=True),  # the stored per-token reference
    # branch pruning: one grad and one frozen forward per pass, the frozen rows reading their prompt's keys
    dict(branch_keep_prob=0.5, position_keep_prob=0.7, prune_common_prefix=True),
    dict(branch_keep_prob=0.5, branch_sampling="independent", precompute_ref_log_probs=True),
], ids=["pruned", "precomputed", "branch", "branch-independent-precomputed"])
def test_pruned_and_precomputed_steps_equal_unmerged(tokenizer, tmp_path, config):
    unmerged = one_step(tokenizer, tmp_path / "unmerged", step_token_budget=0, **config)
    merged = one_step(tokenizer, tmp_path / "merged", step_token_budget=WHOLE_STEP, **config)
    assert relative(merged[0], unmerged[0]) < 1e-5
    branches = "branch_keep_prob" in config
    # A precomputed reference runs no reference forward; branch pruning runs a grad and a frozen policy forward.
    assert merged[1] == {"policy": 2 if branches else 1,
                         "reference": 0 if "precompute_ref_log_probs" in config else 1}
    assert unmerged[1]["policy"] == (8 if branches else 4)
    assert merged[3] == []  # merging said nothing
    # The same masks, so the same work and every logged value (the prune/* counts included).
    for key, value in unmerged[2].items():
        if isinstance(value, float) and "runtime" not in key and "per_second" not in key:
            assert merged[2][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("config, why", [
    (dict(branch_keep_prob="auto"), '"auto"'),
    (dict(position_keep_prob=0.5, **SAVINGS_OFF), "the padded layout"),
    (dict(SAVINGS_OFF), "TRL's own forward"),
    (dict(neftune_noise_alpha=5.0), "NEFTune"),
], ids=["auto", "padded", "stock", "neftune"])
def test_each_fallback_says_one_line_once_and_trains_unmerged(tokenizer, tmp_path, config, why):
    two_steps = dict(max_steps=2, gradient_accumulation_steps=2, rows=ragged_rows(8))
    fallback = one_step(tokenizer, tmp_path / "asked", step_token_budget=WHOLE_STEP, **two_steps, **config)
    unmerged = one_step(tokenizer, tmp_path / "off", step_token_budget=0, **two_steps, **config)
    assert len(fallback[3]) == 1 and why in fallback[3][0]
    assert unmerged[3] == []
    assert torch.equal(fallback[0], unmerged[0]) and fallback[1] == unmerged[1]


def test_why_unmerged_names_each_engine():
    from accelerate.utils import DistributedType

    from trl_pruned_dpo.forward_choice import ForwardChoice

    packed = ForwardChoice(pruned=True, packed=True, share_prompt=True)
    args = SimpleNamespace(n_gpu=1, optim="adamw_torch", auto_keep_probs=False, branch_keep_prob=1.0,
                           neftune_noise_alpha=None)
    plain = SimpleNamespace(distributed_type=DistributedType.MULTI_GPU, parallelism_config=None)

    def why(choice=packed, accelerator=plain, fsdp=False, aux=False, overrides=(), **fields):
        return why_unmerged(SimpleNamespace(**{**vars(args), **fields}), choice, accelerator, aux, fsdp, overrides)

    assert why() is None
    # DeepSpeed merges (accelerate >= 1.8 sets its step boundary; test_distributed.py has the older accelerate's line)
    assert why(accelerator=SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, parallelism_config=None)) is None
    assert "FSDP1" in why(fsdp=True)
    assert why(fsdp=True, accelerator=SimpleNamespace(distributed_type=DistributedType.FSDP, is_fsdp2=True,
                                                      parallelism_config=None)) is None
    assert "context parallelism" in why(accelerator=SimpleNamespace(
        distributed_type=DistributedType.MULTI_GPU, parallelism_config=SimpleNamespace(cp_enabled=True)))
    assert "DataParallel" in why(n_gpu=2)
    assert "LOMO" in why(optim="lomo")
    assert "router" in why(aux=True)
    assert "padded" in why(choice=ForwardChoice(pruned=True))
    assert "NEFTune" in why(neftune_noise_alpha=5.0)
    said = why(overrides=("compute_loss", "training_step"))
    assert "`compute_loss`, `training_step`" in said and "merge_safe_overrides = True" in said


class L2PerCall(PrunedDPOTrainer):
    """A user's `compute_loss`: the plugin's loss plus an L2 term per call (so per micro-batch, unmerged)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return loss + 1e-2 * sum(p.pow(2).sum() for p in model.parameters() if p.requires_grad)


class TRLLoss(PrunedDPOTrainer):
    """A user's `compute_loss` calling TRL's own (stock's forward and loss), without the plugin's columns."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        from trl_pruned_dpo.reference import HOST_KEY, REF_TOKEN_KEY

        batch = {k: v for k, v in inputs.items() if k not in (HOST_KEY, REF_TOKEN_KEY)}
        return DPOTrainer.compute_loss(self, model, batch, return_outputs, num_items_in_batch)


class DeclaredSafe(PrunedDPOTrainer):
    """Overrides `training_step` with nothing a merged pass changes (it wraps the call), and says so."""

    merge_safe_overrides = True

    def training_step(self, model, inputs, num_items_in_batch=None):
        return super().training_step(model, inputs, num_items_in_batch)


def test_the_overrides_a_merged_pass_would_bypass_are_named():
    class OwnForward(PrunedDPOTrainer):
        def concatenated_forward(self, model, inputs):
            return super().concatenated_forward(model, inputs)

    assert bypassed_overrides(PrunedDPOTrainer, PrunedDPOTrainer) == ()
    assert bypassed_overrides(L2PerCall, PrunedDPOTrainer) == ("compute_loss",)
    assert bypassed_overrides(type("Both", (L2PerCall, OwnForward), {}), PrunedDPOTrainer) == (
        "compute_loss", "concatenated_forward")
    assert bypassed_overrides(DeclaredSafe, PrunedDPOTrainer) == ()


def _l2_patched_onto(trainer, declared_safe=False):
    """L2PerCall's term, as a wrapper patched onto the instance (as a library or a user's script may)."""
    compute_loss = trainer.compute_loss

    def with_l2(model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return loss + 1e-2 * sum(p.pow(2).sum() for p in model.parameters() if p.requires_grad)

    trainer.compute_loss = with_l2
    if declared_safe:
        trainer.merge_safe_overrides = True


def test_a_compute_loss_patched_onto_the_trainer_trains_as_unmerged(tokenizer, tmp_path):
    """Patched onto the instance after construction, the wrapper is seen when `train()` starts: merging off, said
    once, = unmerged. Failed before: the class alone was read, and the wrapper ran once per pass (update 0.4 off)."""
    merged = one_step(tokenizer, tmp_path / "asked", patch=_l2_patched_onto, step_token_budget=WHOLE_STEP)
    unmerged = one_step(tokenizer, tmp_path / "off", patch=_l2_patched_onto, step_token_budget=0)
    assert torch.equal(merged[0], unmerged[0]), f"update {relative(merged[0], unmerged[0]):.2f} off unmerged's"
    assert len(merged[3]) == 1 and "`compute_loss` (in its class or on the instance)" in merged[3][0]
    # Declared safe on the instance, it merges (and here, being per call, is then off unmerged's).
    declared = one_step(tokenizer, tmp_path / "declared", patch=lambda t: _l2_patched_onto(t, declared_safe=True),
                        step_token_budget=WHOLE_STEP)
    assert declared[3] == [] and declared[1]["policy"] < unmerged[1]["policy"]


@pytest.mark.parametrize("trainer_cls", [L2PerCall, TRLLoss], ids=["l2", "trl-loss"])
def test_a_subclass_overriding_compute_loss_trains_as_unmerged(tokenizer, tmp_path, trainer_cls):
    """A merged pass calls `compute_loss` once per pass: before, the L2 subclass's update was 49% off unmerged's and
    the TRL-loss one trained on 2 of 4 micro-batches. Now merging is off for it, said once, naming the override."""
    merged = one_step(tokenizer, tmp_path / "asked", trainer_cls, step_token_budget=WHOLE_STEP)
    unmerged = one_step(tokenizer, tmp_path / "off", trainer_cls, step_token_budget=0)
    assert torch.equal(merged[0], unmerged[0]), f"update {relative(merged[0], unmerged[0]):.2f} off unmerged's"
    assert merged[1] == unmerged[1] == {"policy": 4, "reference": 4}
    assert len(merged[3]) == 1 and "`compute_loss`" in merged[3][0] and unmerged[3] == []
    if trainer_cls is TRLLoss:  # every micro-batch through TRL's loss: stock's accumulation
        stock = one_step(tokenizer, tmp_path / "stock", DPOTrainer, DPOConfig)
        assert relative(merged[0], stock[0]) < 1e-5


def test_a_subclass_declaring_its_overrides_safe_still_merges(tokenizer, tmp_path):
    merged = one_step(tokenizer, tmp_path / "merged", DeclaredSafe, step_token_budget=WHOLE_STEP)
    unmerged = one_step(tokenizer, tmp_path / "unmerged", step_token_budget=0)
    assert merged[3] == [] and merged[1] == {"policy": 1, "reference": 1}
    assert relative(merged[0], unmerged[0]) < 1e-5


def test_ranks_group_from_the_same_numbers():
    """Two ranks (threads) whose own tokens group [3, 1] and [2, 2] under a budget of 40 agree on the largest count per
    micro-batch and the smallest budget, so both group [2, 1, 1]; one rank that cannot merge stops both."""
    import threading

    ranks = 2
    barrier, sent = threading.Barrier(ranks), {}

    class Rank:
        num_processes, device = ranks, torch.device("cpu")

        def __init__(self, index):
            self.index = index

        def gather(self, numbers):
            sent[self.index] = numbers
            barrier.wait()
            return torch.cat([sent[i] for i in range(ranks)])

    def agree(inputs):
        out = {}

        def run(index):
            out[index] = agreed_across_ranks(Rank(index), *inputs[index], length=4)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(ranks)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return out

    own = {0: (True, [10, 10, 10, 30], 40), 1: (True, [20, 20, 20, 20], 45)}
    assert [group_passes(tokens, budget) for _, tokens, budget in own.values()] == [[3, 1], [2, 2]]
    agreed = agree(own)
    assert agreed[0] == agreed[1] == (True, [20, 20, 20, 30], 40)
    assert group_passes(*agreed[0][1:]) == [2, 1, 1]
    # a shorter step (the epoch's last) is padded to the same shape; one rank laid out padded: nobody merges
    assert agree({0: (True, [10, 10], 40), 1: (False, [0, 0], 0)})[0][0] is False


def test_the_lora_reference_runs_outside_the_training_wrapper(tokenizer, tmp_path):
    """With LoRA and no `ref_model` the reference is the policy without its adapter. It runs through the trainer's
    model as TRL runs it, not through the wrapper training hands `compute_loss` (DDP's, whose forward broadcasts
    buffers: issue 48's hang): the wrapper sees the policy's grad forwards only, unmerged and in a merged pass."""
    trainer = lora_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, Dataset.from_list(ragged_rows()), tmp_path,
                           per_device_train_batch_size=2)
    assert trainer.ref_model is None and trainer.forward_choice.packed
    batches = [trainer._prepare_inputs(batch) for batch, _ in zip(trainer.get_train_dataloader(), range(3))]

    class Wrapper(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module, self.calls = module, 0

        def forward(self, *args, **kwargs):
            self.calls += 1
            return self.module(*args, **kwargs)

    wrapper, layer_calls = Wrapper(trainer.model), []
    trainer.model.base_model.model.model.layers[0].register_forward_hook(lambda *_: layer_calls.append(1))
    trainer.model.train()
    trainer.compute_loss(wrapper, batches[0]).backward()
    assert wrapper.calls == 1 and len(layer_calls) == 2  # the policy through the wrapper, the reference beside it
    trainer.merged_forward(wrapper, batches)
    assert wrapper.calls == 2 and len(layer_calls) == 4


def test_resume_mid_run_equals_the_uninterrupted_run(tokenizer, tmp_path):
    config = dict(max_steps=4, per_device_train_batch_size=2, gradient_accumulation_steps=2, logging_steps=1,
                  save_strategy="steps", save_steps=2, position_keep_prob=0.5, step_token_budget=WHOLE_STEP)
    dataset = Dataset.from_list(preference_rows(16))
    whole = build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, dataset, tmp_path / "whole", **config)
    whole.train()
    (tmp_path / "resumed").mkdir()
    shutil.copytree(tmp_path / "whole" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    resumed = build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, dataset, tmp_path / "resumed", **config)
    resumed.train(resume_from_checkpoint=True)

    def losses(trainer):
        return [(e["step"], e["loss"]) for e in trainer.state.log_history if "loss" in e]

    # The resumed log holds the checkpoint's entries (steps 1-2), then its own.
    assert losses(resumed) == losses(whole) and len(losses(whole)) == 4
    final = dict(whole.model.named_parameters())
    assert all(torch.equal(final[name], p) for name, p in resumed.model.named_parameters())
