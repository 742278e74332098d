"""The merged step: the micro-batches of one optimizer step run in as few packed passes (one policy forward and one
reference forward each) as `step_token_budget` allows, instead of one pass per micro-batch (docs/method.md, "Merged
steps"). On a GPU a DPO step is bound by the host's kernel launches, which scale with forwards, not tokens.

transformers prefetches an optimizer step's micro-batches (`Trainer.get_batch_samples`), then calls `training_step`
once per micro-batch, in order, under `no_sync` but for the last. The trainer groups the step's micro-batches into
passes here (`step_passes`, from their token ids alone, before any mask is drawn). A micro-batch that does not end its
pass returns a zero loss (no forward, no backward); the one that ends it runs the whole pass: each micro-batch planned
as unmerged (its masks keyed by its own micro-step), one policy and one reference forward (pruned_forward.run_pass),
TRL's loss per micro-batch over its own batch, one backward of their sum. So DDP reduces once, on the last pass, and
transformers' step counting, logging, evaluation and checkpoints see what they see unmerged.

Every process runs the same passes: on several processes the step's per-micro-batch token counts and budgets are
agreed first (`agreed_across_ranks`: one small all-gather per step), so each rank groups from the same numbers and
no collective inside a pass (DDP's buffer broadcast, TRL's metric gathers) can meet another rank's in another order.

Where merging is not exact or not supported, each micro-batch runs alone, said once (`why_unmerged`).
"""

import dataclasses
import itertools
import warnings
from typing import Any

import torch

from .forward_choice import ForwardChoice
from .method.plan import group_passes, unpruned_tokens
from .reference import HOST_KEY


@dataclasses.dataclass(frozen=True)
class StepPasses:
    """One optimizer step's micro-batches as passes, in order: each pass the collated batches it merges."""

    passes: tuple[tuple[dict, ...], ...]

    def ending_with(self, inputs: dict) -> tuple[dict, ...] | None:
        """The pass `inputs` ends (its micro-batches in order, `inputs` last); () where a later micro-batch's pass runs
        `inputs`; None where `inputs` is not one of this step's (it runs alone)."""
        for members in self.passes:
            for position, batch in enumerate(members):
                if batch is inputs:
                    return members if position == len(members) - 1 else ()
        return None


def default_budget(batches: list[dict]) -> int:
    """Stock's padded tokens of the step's widest micro-batch (rows x width of its collated token ids): stock's peak
    in this step. The plugin's activation memory per executed token is about stock's, so a pass of at most that many
    executed tokens keeps the peak at or below stock's."""
    return max(batch[HOST_KEY].input_ids.numel() for batch in batches)


def step_tokens(batches: list[dict], share: bool) -> list[int]:
    """Each micro-batch's policy tokens at its packed forward with nothing pruned (method/plan.unpruned_tokens):
    pruning only removes tokens, so this bounds its forward under any masks, before they are drawn."""
    return [unpruned_tokens(batch[HOST_KEY], share) for batch in batches]


def step_passes(batches: list[dict], sizes: list[int]) -> StepPasses:
    """The step's micro-batches as consecutive passes of `sizes` micro-batches each (`group_passes`)."""
    starts = itertools.accumulate(sizes, initial=0)
    return StepPasses(tuple(tuple(batches[start:start + size]) for start, size in zip(starts, sizes)))


def agreed_across_ranks(accelerator: Any, mergeable: bool, tokens: list[int], budget: int,
                        length: int) -> tuple[bool, list[int], int]:
    """What every rank groups from (issue 51, "ranks agree on the passes"): merge only if every rank can, each
    micro-batch counted at its largest on any rank, the smallest rank's budget. Grouping these numbers gives every rank
    the same pass sizes, and each rank's passes stay within its own budget (its tokens are at most the largest). One
    all-gather of `length` + 2 integers per step (padded to `length`, the accumulation steps: the same shape on every
    rank: transformers prefetches at most that many), and one read of it on the host."""
    numbers = torch.tensor([int(not mergeable), budget, *tokens, *[0] * (length - len(tokens))], dtype=torch.int64)
    every = accelerator.gather(numbers.to(accelerator.device)).view(accelerator.num_processes, -1).cpu()
    return not bool(every[:, 0].any()), every[:, 2:2 + len(tokens)].amax(0).tolist(), int(every[:, 1].min())


def merging_asked(args: Any, choice: ForwardChoice) -> bool:
    """Whether the run asks to merge: gradient accumulation, a budget not 0, and the plugin's forward (or a budget
    set on purpose with TRL's own, which is then said to be ignored)."""
    budget = args.step_token_budget
    return args.gradient_accumulation_steps > 1 and budget != 0 and (choice.pruned or budget is not None)


def _is_lomo(args: Any) -> bool:
    """Whether the optimizer is LOMO or AdaLomo (transformers passes them the learning rate at each backward)."""
    from transformers.training_args import OptimizerNames

    return args.optim in (OptimizerNames.LOMO, OptimizerNames.ADALOMO)


def _context_parallel(accelerator: Any) -> bool:
    """Whether accelerate splits sequences across ranks (its parallelism config's context parallelism)."""
    config = getattr(accelerator, "parallelism_config", None)
    return config is not None and bool(config.cp_enabled)


# accelerate 1.8.0 (huggingface/accelerate#3630) tells DeepSpeed where an optimizer step ends: before each backward,
# `engine.set_gradient_accumulation_boundary(sync_gradients)`, which transformers sets per micro-batch, and
# `engine.step()` only at the boundary. A merged pass's backward runs in its last micro-batch's `training_step`, so
# the step's last pass carries the boundary, as unmerged. Earlier accelerate calls `engine.step()` after every
# backward and DeepSpeed finds the boundary by counting them (`micro_steps % gradient_accumulation_steps`).
DEEPSPEED_EXPLICIT_BOUNDARY = "1.8.0"


def _deepspeed_why_unmerged() -> str | None:
    """Why DeepSpeed cannot merge this run's micro-batches, or None. (ZeRO-2/3 reduce the gradients at every backward
    and ZeRO-3 gathers each layer's weights in every forward: the ranks run the same passes, `agreed_across_ranks`.)"""
    import accelerate
    from packaging.version import Version

    if Version(accelerate.__version__) < Version(DEEPSPEED_EXPLICIT_BOUNDARY):
        return (f"accelerate {accelerate.__version__} lets DeepSpeed find an optimizer step's end by counting "
                "`engine.step()` calls, one per backward (`micro_steps % gradient_accumulation_steps`), and a merged "
                f"step runs fewer backwards; accelerate >= {DEEPSPEED_EXPLICIT_BOUNDARY} sets the boundary at each "
                "backward (`set_gradient_accumulation_boundary`)")
    return None


# The trainer's methods that run once per micro-batch unmerged, and not so in a merged pass: `compute_loss` runs once
# per pass (with its last micro-batch), `concatenated_forward` not at all (`merged_forward` instead), `training_step`
# returns a zero loss without a forward or a backward for the micro-batches a pass defers. A subclass's override of
# one (transformers documents `compute_loss` as the extension point) would miss the others' micro-batches.
PER_MICRO_BATCH = ("compute_loss", "concatenated_forward", "training_step")


def bypassed_overrides(trainer: Any, base: type) -> tuple[str, ...]:
    """The methods of `PER_MICRO_BATCH` that `trainer` (an instance, or a class) overrides from `base`
    (PrunedDPOTrainer): in its class, or patched onto the instance (as a wrapper or a library may). None where it
    declares them right once per pass with `merge_safe_overrides = True` (a class or an instance attribute): one that
    leaves it unset trains unmerged."""
    if getattr(trainer, "merge_safe_overrides", False):
        return ()
    cls, patched = (trainer, {}) if isinstance(trainer, type) else (type(trainer), vars(trainer))
    return tuple(name for name in PER_MICRO_BATCH if getattr(cls, name) is not getattr(base, name) or name in patched)


def why_unmerged(args: Any, choice: ForwardChoice, accelerator: Any, aux_loss_enabled: bool, fsdp: bool,
                 overrides: tuple[str, ...] = ()) -> str | None:
    """Why this run's micro-batches cannot be merged (each then runs alone, as unmerged), or None. `overrides`: the
    trainer's `bypassed_overrides`."""
    from accelerate.utils import DistributedType

    deepspeed = _deepspeed_why_unmerged() if accelerator.distributed_type == DistributedType.DEEPSPEED else None
    reasons = [
        (not choice.pruned, "TRL's own forward trains (pruning and the exact savings are off)"),
        (deepspeed is not None, deepspeed),
        (fsdp and not getattr(accelerator, "is_fsdp2", False),
         "FSDP1 (`fsdp_version: 1`) is not tested with merged passes (FSDP2 is: every rank runs the same passes)"),
        (_context_parallel(accelerator), "context parallelism splits each micro-batch's sequences across ranks"),
        (args.n_gpu > 1, "DataParallel (several GPUs in one process) splits each micro-batch's rows"),
        (_is_lomo(args), "LOMO optimizers update the weights inside each micro-batch's backward"),
        (aux_loss_enabled, "the MoE router loss is counted over each micro-batch's padded rows"),
        (not choice.packed, "the padded layout runs each micro-batch's own rows"),
        (args.auto_keep_probs, '"auto" measures each micro-batch\'s gradient'),
        (bool(overrides), f"the trainer overrides {', '.join(f'`{name}`' for name in overrides)} (in its class or "
                          "on the instance), which a merged pass does not call once per micro-batch (a trainer whose "
                          "overrides are right once per pass sets `merge_safe_overrides = True`)"),
        (args.neftune_noise_alpha is not None, "NEFTune (`neftune_noise_alpha`) scales its noise by 1/sqrt(row "
                                               "length x hidden size), and a merged pass is one longer row: less "
                                               "noise than each micro-batch's own"),
    ]
    return next((why for applies, why in reasons if applies), None)


def merges_this_step(choice: ForwardChoice, batches: list[dict]) -> bool:
    """Whether this step's batches can merge: all laid out packed, the layout settled (a family no test proves exact
    is checked on the first packed batch, alone), more than one micro-batch."""
    packed = all(HOST_KEY in batch and choice.layout(batch).packed for batch in batches)
    return len(batches) > 1 and packed and not choice.unproven


class StepMerger:
    """The trainer's merged-step state: why merging is off for this run (None: on), whether that was said, and this
    optimizer step's passes (None: each micro-batch runs alone)."""

    def __init__(self, why: str | None):
        self.why = why
        self.said = False
        self.passes: StepPasses | None = None

    def group(self, args: Any, choice: ForwardChoice, batches: list[dict], accelerator: Any) -> None:
        """An optimizer step's prefetched micro-batches grouped into passes (the same on every rank), or why not said
        once."""
        self.passes = None
        if not merging_asked(args, choice):
            return
        if self.why is not None:
            if not self.said:
                self.said = True
                warnings.warn(f"Merged step off (`step_token_budget`): each micro-batch runs its own forwards, as "
                              f"unmerged: {self.why}.", stacklevel=3)
            return
        # A rank that cannot merge this step (a batch laid out padded, the first batch of an unproven family) still
        # takes part in the agreement: then no rank merges.
        mergeable = merges_this_step(choice, batches)
        tokens = step_tokens(batches, choice.share_prompt) if mergeable else [0] * len(batches)
        budget = args.step_token_budget
        if budget is None:
            budget = default_budget(batches) if mergeable else 0
        if accelerator.num_processes > 1:
            mergeable, tokens, budget = agreed_across_ranks(accelerator, mergeable, tokens, budget,
                                                            args.gradient_accumulation_steps)
        if mergeable:
            self.passes = step_passes(batches, group_passes(tokens, budget))

    def pass_of(self, inputs: dict) -> tuple[dict, ...] | None:
        """`StepPasses.ending_with` of this step's passes (None without passes)."""
        return self.passes.ending_with(inputs) if self.passes is not None else None
