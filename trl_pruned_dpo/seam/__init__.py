"""Every TRL and transformers internal the plugin relies on, in one place.

The imports fail at import time if TRL moves them. What an import cannot see is checked by behaviour: whether TRL's
fused LM head still honours the switch that makes it score only the labelled positions (`check_compact_lm_head` runs
a tiny forward once and counts the rows that actually reach the head's matrix product); the replay seam into TRL's
`_compute_loss` (`Replay`) and the Trainer's logging window (`logging_window`) are pinned by tests
(tests/test_dropin.py::test_replay_seam_assumptions, tests/test_failures.py resume tests).

Each private, and what pins it (a test that fails when the assumption breaks, not a `hasattr`):
- TRL's `_compute_loss` reads the reference sums from the batch when `precompute_ref_logps` is set (`trl_loss`):
  test_replay_seam_assumptions makes the reference model's forward fail;
- transformers' `_tr_loss` / `_globalstep_last_logged` and TRL's `_metrics` (`logging_window`, `train_metrics`), read
  directly: the resume tests require the logged figures after a resume to equal the uninterrupted run's, and
  tests/test_parity.py the logged keys;
- transformers' `_get_output_dir` (`run_output_dir`): the checkpoint and resume tests (tests/test_failures.py) find
  each checkpoint where it was saved;
- TRL's `_precompute_engine` (`deepspeed_reference_engine`), the DeepSpeed engine its precompute reuses:
  tests/test_dropin.py::test_seam_private_attributes_exist;
- `Trainer._maybe_log_save_evaluate(tr_loss, grad_norm, ...)` called positionally: checked at import, and
  tests/test_failures.py::test_guard_reads_the_step_gradient_norm (a NaN gradient norm must stop the run);
- TRL's `_use_triton` switch of the fused head (`compact_lm_head`): `check_compact_lm_head`, once per process;
- under DeepSpeed ZeRO-3, TRL's `maybe_gather_lm_head_ctx` gathering nothing for a parameter whose DeepSpeed `ds_status`
  is `AVAILABLE` (`mark_whole_under_zero3`, so the probe's local model runs there):
  tests/test_distributed.py::test_lm_head_probe_runs_under_zero3;
- the fused head calling `trl.trainer.utils._ChunkedLogProbFunction.apply`, and
  `trl.kernels.chunked_logprob._use_triton` telling where it folds in Triton (`compact_lm_head` slices the
  positions elsewhere): tests/test_memory.py counts the rows of every head tile (test_head_tiles_are_bounded,
  test_sliced_head_trains_exactly_as_stock).
The tokenizer comes from the public `processing_class` (a processor's `.tokenizer`), never TRL's `_tokenizer`.
"""

import contextlib
import dataclasses
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import torch
import trl
import trl.kernels.chunked_logprob as trl_head_kernel
import trl.trainer.utils as trl_utils
from packaging.version import Version
from torch.utils._python_dispatch import TorchDispatchMode

# The tested TRL versions, [low, high).
TESTED_TRL = ("1.16.0", "1.17.0")

if not (Version(TESTED_TRL[0]) <= Version(trl.__version__) < Version(TESTED_TRL[1])):
    raise ImportError(
        f"trl-pruned-dpo is tested with trl>={TESTED_TRL[0]},<{TESTED_TRL[1]} and found trl {trl.__version__}: "
        f"install a tested version (`pip install 'trl>={TESTED_TRL[0]},<{TESTED_TRL[1]}'`)."
    )

try:
    from trl import DPOConfig
    from trl.models.utils import disable_gradient_checkpointing
    from trl.trainer.dpo_trainer import DPOTrainer
    from trl.trainer.utils import add_fused_lm_head, get_config_model_id, use_adapter

    DPOTrainer._save_checkpoint  # noqa: B018 - completion marker and run state (safety/checkpoints.py)
    DPOTrainer._maybe_log_save_evaluate  # noqa: B018 - each step's divergence check, before it is logged or saved
except (ImportError, AttributeError) as error:  # pragma: no cover - only on an untested TRL
    raise ImportError(f"trl-pruned-dpo: a TRL internal it relies on has moved ({error}); pin trl to 1.16.x.") from error

# The trainer overrides `_maybe_log_save_evaluate(tr_loss, grad_norm, *rest)` and reads the step's gradient norm from
# its second positional argument (transformers calls it positionally). Pinned by behaviour in
# tests/test_failures.py::test_guard_reads_the_step_gradient_norm (an injected NaN gradient norm must stop the run).
_STEP_END_PARAMETERS = tuple(inspect.signature(DPOTrainer._maybe_log_save_evaluate).parameters)[1:3]
if _STEP_END_PARAMETERS != ("tr_loss", "grad_norm"):  # pragma: no cover - only on an untested transformers
    raise ImportError(f"trl-pruned-dpo: Trainer._maybe_log_save_evaluate takes {_STEP_END_PARAMETERS} first, not "
                      "(tr_loss, grad_norm); pin transformers to a tested version.")

__all__ = [
    "DPOConfig",
    "DPOTrainer",
    "Replay",
    "as_pruned_config",
    "check_compact_lm_head",
    "compact_lm_head",
    "deepspeed_reference_engine",
    "logging_window",
    "no_grad_block",
    "reference_context",
    "restore_logging_window",
    "run_output_dir",
    "train_metrics",
    "trl_loss",
    "without_tied_keys",
]


class Replay:
    """Stands in for the model in TRL's `_compute_loss`: returns per-token outputs computed beforehand, so every TRL
    loss, `ld_alpha`, `use_weighting` and every TRL metric run unchanged on the pruned estimates."""

    def __init__(self, aux_loss: torch.Tensor | None = None, **per_token: torch.Tensor):
        self.outputs = SimpleNamespace(aux_loss=aux_loss, **per_token)

    def __call__(self, *args: Any, **kwargs: Any) -> SimpleNamespace:
        return self.outputs


# What a plain `DPOConfig` promoted by `as_pruned_config` carries where `PrunedDPOConfig`'s default is not stock's:
# `share_prompt` (on by default) is off. `padding_free` is a `DPOConfig` field, so the user's own value is kept (stock's
# default, False). With every pruning off too, `uses_pruned_forward` is False: stock TRL's own code runs.
PROMOTED_OVERRIDES = {"share_prompt": False}


def as_pruned_config(model: str | torch.nn.Module, args: Any, config_class: type) -> Any:
    """The trainer's config: stock's default when `args` is None, a plain `DPOConfig` promoted with pruning off.

    A promoted config is the same settings object (its `__dict__` is shared, nothing re-validated or re-derived),
    carrying the pruning fields at their identity values (`PROMOTED_OVERRIDES` where the field default is not the
    identity: `share_prompt=False`) and the user's own `padding_free`, so swapping only the trainer class changes
    nothing a user passed and runs stock's code.
    """
    # Stock's default: DPOConfig(f"{model_name}-DPO").
    if args is None:
        model_name = model if isinstance(model, str) else get_config_model_id(model.config)
        return config_class(f"{model_name.split('/')[-1]}-DPO")
    if isinstance(args, config_class) or not isinstance(args, DPOConfig):
        # Anything else is TRL's to accept or reject.
        return args
    promoted = config_class.__new__(config_class)
    promoted.__dict__ = args.__dict__
    for f in dataclasses.fields(config_class):
        if f.name not in promoted.__dict__:
            setattr(promoted, f.name, PROMOTED_OVERRIDES.get(f.name, f.default))
    promoted.prune_seed = args.seed
    return promoted


def trl_loss(trainer: DPOTrainer, model: Any, batch: dict) -> torch.Tensor:
    """TRL's private `_compute_loss` with the reference read from the batch: TRL gates its reference forward on
    `trainer.precompute_ref_logps` (reading `ref_chosen_logps`/`ref_rejected_logps` from the batch when set), so the
    flag is set for this call only. Pinned by tests/test_dropin.py::test_replay_seam_assumptions (the reference model
    must never be called inside it)."""
    precompute = trainer.precompute_ref_logps
    trainer.precompute_ref_logps = True
    try:
        return trainer._compute_loss(model, batch, return_outputs=False)
    finally:
        trainer.precompute_ref_logps = precompute


def train_metrics(trainer: DPOTrainer) -> dict:
    """TRL's training metric lists (`_metrics["train"]`: key -> the values since the last log, averaged by `log`)."""
    return trainer._metrics["train"]


def run_output_dir(trainer: DPOTrainer, trial: Any = None) -> str:
    """The run's output folder, as transformers' `_get_output_dir` names it (a hyperparameter trial's own)."""
    return trainer._get_output_dir(trial=trial)


def deepspeed_reference_engine(trainer: DPOTrainer) -> Any:
    """The policy prepared once for DeepSpeed inference, cached where TRL's own precompute caches it
    (`_precompute_engine`), so both precomputes share one engine."""
    if trainer._precompute_engine is None:
        from trl.models import prepare_deepspeed

        trainer._precompute_engine = prepare_deepspeed(trainer.model, trainer.accelerator)
    return trainer._precompute_engine


def no_grad_block(model: torch.nn.Module, gradient_checkpointing_kwargs: dict | None) -> contextlib.ExitStack:
    """No grad and no gradient checkpointing (nothing to recompute); nested blocks do not toggle it again."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.no_grad())
    stack.enter_context(disable_gradient_checkpointing(model, gradient_checkpointing_kwargs))
    return stack


def reference_context(model: torch.nn.Module, unwrapped: torch.nn.Module, ref_model: torch.nn.Module | None,
                      gradient_checkpointing_kwargs: dict | None) -> contextlib.ExitStack:
    """A no-grad block, with the policy's adapter disabled when the reference is the PEFT policy without it (or
    TRL's frozen "ref" adapter copy)."""
    from accelerate.utils import is_peft_model

    stack = no_grad_block(model, gradient_checkpointing_kwargs)
    if ref_model is None and is_peft_model(model):
        stack.enter_context(use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None))
    return stack


def logging_window(trainer: DPOTrainer, in_training: bool = True) -> dict:
    """What the Trainer and TRL have accumulated since the last log (transformers' `_tr_loss` and
    `_globalstep_last_logged`, TRL's `_metrics` and `_total_train_tokens`): restored on resume, so that a resumed run
    logs (and summarises) the same numbers as an uninterrupted one. `in_training`: whether `train()` is running (else
    no window is open). Read directly, no `hasattr`: a renamed attribute fails loudly, and the resume tests
    (tests/test_failures.py, the logged figures after a resume equal the uninterrupted run's) pin the meaning."""
    if not in_training:
        return {}
    return {
        "tr_loss": float(trainer._tr_loss),
        "last_logged": trainer._globalstep_last_logged,
        "metrics": {key: list(values) for key, values in trainer._metrics["train"].items()},
        # TRL's `num_tokens` counter, which TRL itself does not restore on resume
        "total_train_tokens": getattr(trainer, "_total_train_tokens", 0),
    }


def restore_logging_window(trainer: DPOTrainer, window: dict) -> bool:
    """Reopen the window `logging_window` saved (called inside `train()`); whether it was restored."""
    if not window:
        return False
    trainer._tr_loss += torch.tensor(window["tr_loss"], dtype=trainer._tr_loss.dtype, device=trainer._tr_loss.device)
    trainer._globalstep_last_logged = window["last_logged"]
    for key, values in window["metrics"].items():
        trainer._metrics["train"][key][:0] = values
    trainer._total_train_tokens = window.get("total_train_tokens", 0)
    return True


# Tokens x vocabulary columns of one call of TRL's head where it folds its tiles in torch (CPU): each of the ~11
# temporaries its backward builds per tile (logits, probabilities, the gradient, ...) is then 8 MiB in fp32.
HEAD_TILE_ELEMENTS = 2**21


class _TokenSlicedHead:
    """TRL's `ChunkedLogProbFunction` called on consecutive slices of the scored positions (docs/benchmarks.md,
    "Where a step's memory goes").

    TRL tiles the head by 4,096 positions, and where it has no Triton kernel (CPU) its forward and backward build each
    (positions, vocab) tile and ~11 temporaries of that size in torch: with an 8k vocabulary ~1.45 GB once a step
    scores 4,096 positions, the largest allocation of the step. Slicing the positions so that a tile holds at
    most `HEAD_TILE_ELEMENTS` bounds it; each position's outputs are computed by the same kernel on the same row, so
    only the order the weight gradient's terms are summed in changes (round-off). Triton devices fold in registers:
    unchanged there."""

    def __init__(self, function: type[torch.autograd.Function]):
        self.function = function

    def apply(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
              temperature: float, chunk_size: int, *rest: Any) -> tuple:
        call = self.function.apply
        tokens = max(1, HEAD_TILE_ELEMENTS // min(weight.shape[0], chunk_size))
        if trl_head_kernel._use_triton(hidden.device) or hidden.shape[0] <= tokens:
            return call(hidden, weight, bias, targets, temperature, chunk_size, *rest)
        parts = [call(h, weight, bias, t, temperature, chunk_size, *rest)
                 for h, t in zip(hidden.split(tokens), targets.split(tokens))]
        return tuple(None if part[0] is None else torch.cat(part) for part in zip(*parts))


@contextmanager
def compact_lm_head() -> Iterator[None]:
    """Make TRL's fused LM head score only the labelled positions on every device, in slices of bounded memory.

    TRL gathers the labelled hidden states before the head only on Triton devices and scores every position
    elsewhere (CPU included), so position pruning would save nothing there. The head's kernel itself is untouched:
    the switch only selects `hidden_states[mask]` instead of all positions, and `_TokenSlicedHead` calls the kernel on
    slices of them.
    """
    original, function = trl_utils._use_triton, trl_utils._ChunkedLogProbFunction
    trl_utils._use_triton = lambda device: True
    # A nested block keeps the outer one's.
    if not isinstance(function, _TokenSlicedHead):
        trl_utils._ChunkedLogProbFunction = _TokenSlicedHead(function)
    try:
        yield
    finally:
        trl_utils._use_triton, trl_utils._ChunkedLogProbFunction = original, function


class _HeadRows(TorchDispatchMode):
    """Counts the rows of every matrix product whose output is `vocab` wide: the positions the LM head scores."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm) and out.shape[-1] == self.vocab:
            self.rows += out.shape[0]
        return out


def mark_whole_under_zero3(model: torch.nn.Module) -> None:
    """Under DeepSpeed ZeRO-3, mark a model built outside any engine as what it is: every parameter whole, here.

    TRL's fused head gathers its weight with `maybe_gather_lm_head_ctx` whenever ZeRO-3 is on (transformers'
    `is_deepspeed_zero3_enabled`, set by the config), and reads `ds_status` from every parameter it is handed: a
    plain parameter has none (`AttributeError: 'Parameter' object has no attribute 'ds_status'`). The probe's tiny
    model is a local one (never partitioned), so its parameters are marked `AVAILABLE`, for which TRL gathers nothing:
    the probe runs TRL's head code unchanged. Pinned by
    tests/test_distributed.py::test_lm_head_probe_runs_under_zero3 (the probe's count under a ZeRO-3 config)."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    if not is_deepspeed_zero3_enabled():
        return
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    for parameter in model.parameters():
        parameter.ds_status = ZeroParamStatus.AVAILABLE


def head_rows_scored(labels_kept: int = 2, length: int = 8, vocab: int = 37) -> int:
    """Rows that reach the fused LM head of a tiny Llama under `compact_lm_head` when `labels_kept` labels are set."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=length)
    # The init must not move the caller's global RNG.
    with torch.random.fork_rng(devices=[]):
        model = LlamaForCausalLM(config)
    mark_whole_under_zero3(model)
    add_fused_lm_head(model)
    input_ids = torch.arange(1, length + 1).view(1, length)
    labels = torch.full_like(input_ids, -100)
    labels[0, -labels_kept:] = input_ids[0, -labels_kept:]
    counter = _HeadRows(vocab)
    with torch.no_grad(), compact_lm_head(), counter:
        model(input_ids=input_ids, labels=labels, use_cache=False, fused_lm_head=True)
    return counter.rows


_COMPACT_HEAD_OK = False


def check_compact_lm_head() -> None:
    """Once per process: under `compact_lm_head`, only the labelled positions reach the LM head.

    If a TRL change stops honouring the switch, the estimates stay right but position pruning saves nothing on the
    head; fail loudly instead of training with the savings silently gone.
    """
    global _COMPACT_HEAD_OK
    if _COMPACT_HEAD_OK:
        return
    rows = head_rows_scored(labels_kept=2)
    if rows != 2:
        raise RuntimeError(
            f"trl-pruned-dpo: TRL's fused LM head scored {rows} positions of a tiny forward with 2 labels under "
            f"`compact_lm_head`; TRL {trl.__version__} no longer compacts through `_use_triton`, so pruning would "
            "save nothing on the head. Pin trl to a tested version."
        )
    _COMPACT_HEAD_OK = True


def without_tied_keys(model: torch.nn.Module, load_result: Any) -> Any:
    """`load_result` (torch's `_IncompatibleKeys`) without the missing keys that are tied to another weight.

    transformers' `Trainer._issue_warnings_after_load` (private; checked by tests/test_resume_output.py) warns on
    every resume of a tied-embedding model that `lm_head.weight` is missing: the checkpoint stores the tied weight
    once, as the embedding, and the head is the same tensor. Its own exemption reads `_keys_to_ignore_on_save`, which
    transformers 5 leaves empty for tied models; the tied keys are in `all_tied_weights_keys`."""
    tied = set(getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or {})
    if not tied or not hasattr(load_result, "_replace"):
        return load_result
    missing = [k for k in load_result.missing_keys if not any(k == t or k.endswith("." + t) for t in tied)]
    return load_result._replace(missing_keys=missing)
