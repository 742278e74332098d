"""Which forward training runs: TRL's own, the plugin's padded rows, or its packed rows (prompts once per pair or not),
and why. One value, `ForwardChoice`, decided when the trainer is built and read-only after (`trainer.forward_choice`).

It is decided in two parts, because TRL's constructor needs the first and supplies what the second reads:
- `before_trl`: whether the plugin's forward runs at all (TRL's reference precompute, collator and signature columns
  follow it), from the config and the data (`check_prunable`);
- `after_trl`: the layout, from the models TRL loaded (`attention.packed_verdict`), the MoE router loss and a vision
  dataset (known only once TRL has read it).
One later change is possible, once: a model whose family no test proves exact runs packed only after the first packed
batch agrees with the padded one (`check_first_batch`); otherwise the choice is downgraded and says why.
"""

import dataclasses
import warnings
from typing import TYPE_CHECKING, Any

import torch
from accelerate.utils import is_peft_model

from .config import EXACT_SAVINGS, uses_pruned_forward
from .method.packing import HostBatch, plan_group, row_trees
from .method.plan import Layout
from .pruned_forward import ForwardContext, run_group
from .reference import NON_MODEL_KEYS
from .safety.data_checks import VISION_ERROR, check_prunable
from .seam import attention, check_compact_lm_head, compact_lm_head, no_grad_block

if TYPE_CHECKING:
    from .config import PrunedDPOConfig

# Batch keys the packed forward knows how to pack; any other per-token input makes it run padded.
SHAREABLE_KEYS = {"input_ids", "attention_mask"} | NON_MODEL_KEYS
# Why `torch_compile` runs without the packed forward. Measured on CPU (backend "eager", tiny Llama, 8 steps): TRL's
# fused forward, which inlines the packed attention's per-segment split (a guard on each layout's segment lengths),
# hit torch's recompile limit and the run took 2.6x stock's CPU time; padded rows recompiled 31 times in 8 steps and
# the same 31 in 20 (sizes marked dynamic), no frame at the limit. Inductor on a GPU: not measured.
COMPILED_PACKED = ("torch_compile recompiles the packed forward for every new packed layout (its segment lengths are "
                   "Python ints that change with every batch) until torch's recompile limit stops compiling it; set "
                   "torch_compile=False to keep them")


@dataclasses.dataclass(frozen=True)
class ForwardChoice:
    """The forward training runs, and why (docs/method.md, "Exact savings").

    `pruned`: the plugin's forward (False: TRL's own, a drop-in by construction). `packed`: its rows run packed
    (`padding_free`/`share_prompt` on a model the packed attention takes), `share_prompt`: with each pair's prompt run
    once. `why`: why the exact savings asked for do not run (None when they run, or none was asked). `models`: the
    models whose attention is switched to the packed one; `unproven`: those whose family no test proves exact, checked
    on the first packed batch; `causal_unproven`: models outside the tested table on which an estimator cuts rows
    short, whose causality is checked on the first batch (`check_causal`).
    """

    pruned: bool
    packed: bool = False
    share_prompt: bool = False
    why: str | None = None
    models: tuple = dataclasses.field(default=(), repr=False)
    unproven: tuple = dataclasses.field(default=(), repr=False)
    causal_unproven: tuple = dataclasses.field(default=(), repr=False)

    @property
    def pending(self) -> bool:
        """Whether a first-batch check is still to run (`first_batch_checks`)."""
        return bool(self.unproven or self.causal_unproven)

    @property
    def kernel(self) -> str | None:
        """The attention kernel the packed rows run, named at the first packed forward (`attention.kernel_of`):
        "torch varlen_attn", "flash_attn varlen" or "SDPA per segment" ("a + b" where a model's layers differ;
        "policy: a; reference: b" where the models differ). None before the first packed forward, or not packed."""
        names = [attention.kernel_of(model) for model in self.models] if self.packed else []
        if not any(names):
            return None
        if len(set(names)) == 1:
            return names[0]
        return "; ".join(f"{role}: {name}" for role, name in zip(("policy", "reference"), names) if name)

    def layout(self, inputs: dict) -> Layout:
        """How this batch runs: a batch with per-token inputs other than token ids runs padded."""
        packed = self.packed and not (set(inputs) - SHAREABLE_KEYS)
        return Layout(packed, packed and self.share_prompt)


def _without_savings(args: "PrunedDPOConfig", why: ValueError | str) -> ForwardChoice:
    """The exact savings cannot run. A refusal (ValueError) is raised where an estimator is on; otherwise one line
    says why and what runs instead: with only the savings on, TRL's own forward, else the plugin's padded rows."""
    if isinstance(why, ValueError) and args.pruning_enabled:
        raise why
    stock = not args.pruning_enabled
    wanted = " and ".join(name for name in EXACT_SAVINGS if getattr(args, name, False))
    then = "TRL's own forward runs (exact; pruning is off)" if stock else "Training runs padded rows (exact, slower)"
    warnings.warn(f"{wanted} ignored: {str(why).rstrip('.')}. {then}.", stacklevel=5)
    return ForwardChoice(pruned=not stock, why=str(why))


def before_trl(args: "PrunedDPOConfig", train_dataset: Any, processing_class: Any,
               always_pruned: bool = False) -> ForwardChoice:
    """Whether the plugin's forward runs, before TRL's constructor (its precompute follows it): refuse what the
    pruned forward cannot do. `always_pruned`: the plugin's forward even with everything off (benchmarks)."""
    if not uses_pruned_forward(args):
        return ForwardChoice(pruned=always_pruned)
    try:
        check_prunable(args, train_dataset, processing_class)
        choice = ForwardChoice(pruned=True)
    except ValueError as refusal:
        choice = _without_savings(args, refusal)
    check_compact_lm_head()
    return choice


def after_trl(choice: ForwardChoice, args: "PrunedDPOConfig", models: list[torch.nn.Module], aux_loss_enabled: bool,
              is_vision: bool) -> ForwardChoice:
    """The layout, once TRL has loaded the models: packed (`padding_free`/`share_prompt` on models
    `attention.packed_verdict` allows; a family outside the tested table only after `check_first_batch` agrees) or
    padded (said once), or TRL's own forward for a vision dataset with only the savings on. Where an estimator cuts
    rows short on a family outside the table, its causality is checked on the first batch (`check_causal`)."""
    if not choice.pruned or not uses_pruned_forward(args):
        return choice
    models = [m.get_base_model() if is_peft_model(m) else m for m in models]
    chosen = _layout_choice(choice, args, models, aux_loss_enabled, is_vision)
    outside = tuple(m for m in models if m.config.model_type not in attention.EXACT_FAMILIES)
    if chosen.pruned and cut_rows(args) and outside:
        return dataclasses.replace(chosen, causal_unproven=outside)
    return chosen


def cut_rows(args: Any) -> list[str]:
    """The estimators asked for that run fewer tokens of a row than it holds (exact only under causal attention)."""
    return [name for name, on in (("position_keep_prob", args.position_keep_prob != 1.0),
                                  ("prefix_prune_prob", args.prefix_prune_prob > 0.0),
                                  ("prune_common_prefix", args.prune_common_prefix)) if on]


def _not_causal(cut: list[str], why: str) -> ValueError:
    return ValueError(f"{', '.join(cut)} run fewer tokens of a row than it holds, which is exact only where attention "
                      f"is causal, and {why}: load the model as a decoder (is_decoder=True where it has the switch) or "
                      "set them to their defaults.")


def _layout_choice(choice: ForwardChoice, args: "PrunedDPOConfig", models: list[torch.nn.Module],
                   aux_loss_enabled: bool, is_vision: bool) -> ForwardChoice:
    if is_vision:
        return _without_savings(args, ValueError(VISION_ERROR))
    if aux_loss_enabled and args.prune_common_prefix:
        raise ValueError("prune_common_prefix cannot be exact with the MoE router auxiliary loss "
                         "(output_router_logits=True): stock's router loss counts every token of every row, and "
                         "the common prefix's rows and positions do not run; turn one of them off.")
    both_ways = next(filter(None, map(attention.bidirectional, models)), None)
    if both_ways and (cut := cut_rows(args)):
        raise _not_causal(cut, both_ways)
    if not any(getattr(args, name, False) for name in EXACT_SAVINGS):
        return choice
    if args.torch_compile:
        return _without_savings(args, COMPILED_PACKED)
    verdicts = [attention.packed_verdict(model) for model in models]
    reason = next((v for v in verdicts if v not in (None, attention.CHECK)), None)
    # Stock's router loss counts every padded row's tokens; a packed row counts a shared prompt once.
    if aux_loss_enabled and not reason:
        reason = "the MoE router auxiliary loss needs the padded batch"
        if args.pruning_enabled:
            reason += " (with pruning on, the router loss is the backpropagated rows' own, over their tokens run)"
    if reason:
        return _without_savings(args, reason)
    unproven = tuple(m for m, v in zip(models, verdicts) if v == attention.CHECK)
    return ForwardChoice(pruned=True, packed=True, share_prompt=bool(args.share_prompt), models=tuple(models),
                         unproven=unproven)


def _first_pairs(host: HostBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of the batch's first two pairs (chosen and rejected) and their scored positions: what the first-batch
    checks run."""
    rows = host.input_ids.size(0)
    run = (torch.arange(rows) % (rows // 2)) < min(2, rows // 2)
    return run, host.completion_mask[:, 1:].bool() & run[:, None]


def _log_probs(model: torch.nn.Module, host: HostBatch, inputs: dict, scored: torch.Tensor, run: torch.Tensor,
               share: bool, packed: bool, no_grad: Any) -> torch.Tensor:
    """`model`'s per-token log-probs of the `scored` positions of rows `run`, in float32, inside `no_grad()`."""
    group = plan_group(host, scored, run, row_trees(host, share), packed)
    with no_grad():
        return run_group(model, group, ("log_probs",), inputs)[0]["log_probs"].float()


def _checking(context: ForwardContext) -> Any:
    """The checks' block: no grad, no checkpointing, TRL's head on the labelled positions only."""

    def no_grad() -> Any:
        stack = no_grad_block(context.policy, context.checkpointing_kwargs)
        stack.enter_context(compact_lm_head())
        return stack

    return no_grad


def _tolerance(model: torch.nn.Module) -> float:
    """Round-off between two layouts' log-probs: 1e-4 in float32, 5e-2 in half precision (absolute)."""
    return 1e-4 if next(model.parameters()).dtype in (torch.float32, torch.float64) else 5e-2


def first_batch_checks(choice: ForwardChoice, context: ForwardContext, args: Any, host: HostBatch,
                       inputs: dict) -> ForwardChoice:
    """The forward choice's one change, on the first batch (also the reference precompute's): causality where an
    estimator cuts rows (`check_causal`), then, on the first packed batch, packed against padded
    (`check_first_batch`)."""
    if choice.causal_unproven:
        choice = check_causal(choice, context, args, host, inputs)
    if choice.unproven and choice.layout(inputs).packed:
        choice = check_first_batch(choice, context, args, host, inputs)
    return choice


def packed_against_padded(model: torch.nn.Module, packed_models: tuple, host: HostBatch, inputs: dict,
                          share: bool, no_grad: Any) -> torch.Tensor:
    """The largest |packed - padded| per-token log-prob of `model` over the batch's first two pairs (NaN reads as
    inf), each forward inside `no_grad()` (the caller's no-grad, compact-head block); `packed_models` are switched to
    each layout in turn. Raises what the packed forward raises."""
    run, scored = _first_pairs(host)
    outputs = []
    for packed in (False, True):
        attention.use_packed(packed_models, packed)
        outputs.append(_log_probs(model, host, inputs, scored, run, share, packed, no_grad))
    return (outputs[1] - outputs[0]).abs().max().nan_to_num(nan=float("inf"))


def check_first_batch(choice: ForwardChoice, context: ForwardContext, args: Any, host: HostBatch,
                      inputs: dict) -> ForwardChoice:
    """Once, on the first packed batch, for a family outside the tested table: the packed and the padded per-token
    log-probs of a few pairs, no grad; packed from then on only if they agree to round-off (1e-4 in float32, 5e-2 in
    half precision, absolute), else one line naming the largest difference and padded (or stock's) forwards. Every
    process runs it and takes the worst (the same layout everywhere). `context` supplies the policy (whose
    checkpointing is paused) and the accelerator."""
    worst = torch.zeros((), device=inputs["input_ids"].device)
    where, failure = "", None
    for model in choice.unproven:
        try:
            difference = packed_against_padded(model, choice.models, host, inputs, choice.share_prompt,
                                               _checking(context))
        except Exception as error:  # noqa: BLE001 - a model the packed forward cannot run: padded, said why
            message = str(error).splitlines()[0] if str(error) else ""
            failure, where = f"{type(error).__name__}: {message}", model.config.model_type
            worst = torch.full_like(worst, float("inf"))
            break
        if difference > worst:
            worst, where = difference, model.config.model_type
    worst = context.accelerator.reduce(worst, reduction="max")
    tolerance = _tolerance(choice.unproven[0])
    if float(worst) <= tolerance:
        return dataclasses.replace(choice, unproven=())
    attention.use_packed(choice.models, packed=False)
    found = (f"the packed forward failed ({failure})" if failure else
             f"the packed per-token log-probs differ from the padded ones by {float(worst):.2g} (> {tolerance:g})")
    return _without_savings(args, f"its family ({where or 'on another process'}) is not one a test proves "
                                  f"exact, and on the first batch {found}")


def check_causal(choice: ForwardChoice, context: ForwardContext, args: Any, host: HostBatch,
                 inputs: dict) -> ForwardChoice:
    """Once, on the first batch, where an estimator cuts rows short on a family outside the tested table: the padded
    per-token log-probs of a few pairs' rows whole and cut after half their response tokens, no grad; they must agree
    on the kept half (the tolerances of `check_first_batch`: a causal model's kept tokens see nothing of the cut), else
    the run stops with a ValueError naming the estimators (XLM with `causal=False` and CPM-Ant see later tokens
    without `is_decoder`'s switch). Every process runs it and takes the worst."""
    run, scored = _first_pairs(host)
    kept = scored & (scored.cumsum(1) <= (scored.sum(1, keepdim=True) + 1) // 2)
    worst, where = torch.zeros((), device=inputs["input_ids"].device), ""
    attention.use_packed(choice.models, packed=False)
    for model in choice.causal_unproven:
        whole, cut = (_log_probs(model, host, inputs, positions, run, False, False, _checking(context))
                      for positions in (scored, kept))
        difference = (cut - whole)[kept.to(whole.device)].abs().max().nan_to_num(nan=float("inf"))
        if difference > worst:
            worst, where = difference, model.config.model_type
    worst = context.accelerator.reduce(worst, reduction="max")
    tolerance = _tolerance(choice.causal_unproven[0])
    if float(worst) > tolerance:
        raise _not_causal(cut_rows(args), f"on the first batch the log-probs of {where or 'a model on another process'} "
                                          f"changed by {float(worst):.2g} (> {tolerance:g}) when its rows were cut after "
                                          "half their response: its attention sees later tokens")
    return dataclasses.replace(choice, causal_unproven=())
