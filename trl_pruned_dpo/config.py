"""`PrunedDPOConfig`: TRL's `DPOConfig` plus the sampling probabilities of the three prunings.

Data only, like `DPOConfig`: the field help is the documentation, and `__post_init__` rejects values that cannot work
before any model is loaded. The semantics of every field are in docs/method.md.
"""

from dataclasses import dataclass, field

from trl import DPOConfig

from .notices import checkpointing_names_quiet

BRANCH_SAMPLINGS = ("paired", "independent")

# Every TRL 1.16 loss is a function of per-branch sums of per-token log-probs (or, for `sft`, of their mean), so each
# has an unbiased pruned estimate of its inputs. Checked here because TRL only rejects an unknown name mid-training.
TRL_LOSS_TYPES = (
    "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot", "aot_unpaired",
    "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm",
)

# Losses that depend on the two branches only through D_w - D_l (with reverse-KL scores): a token in the common
# response prefix cancels exactly there, so `prune_common_prefix` changes nothing but the cost (docs/method.md).
PAIR_DIFFERENCE_LOSSES = frozenset({"sigmoid", "hinge", "robust", "exo_pair", "discopop"})

# The keep probabilities the trainer may choose itself (trl_pruned_dpo/auto.py), and the values it chooses among.
AUTO = "auto"
AUTO_FIELDS = ("position_keep_prob", "branch_keep_prob")
# `prune_log_level`: which of the plugin's metrics are logged (docs/metrics.md).
PRUNE_LOG_LEVELS = ("info", "debug")
BRANCH_GRID = (0.5, 0.625, 0.75, 0.875, 1.0)
POSITION_GRID = (0.5, 0.625, 0.75, 0.875, 1.0)


def keep_prob_or_auto(value: float | str) -> float | str:
    """A keep probability as written in Python, YAML or on the command line: a number, or the string "auto".

    Used as the fields' type so that TRL's argument parser converts "0.5" to 0.5 and keeps "auto" (a `float | str`
    annotation would be reduced to `float` by the parser, rejecting "auto")."""
    if isinstance(value, str):
        text = value.strip()
        if text.lower() == AUTO:
            return AUTO
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"a keep probability must be a number in (0, 1] or 'auto', got {value!r}") from None
    return value


@dataclass
class PrunedDPOConfig(DPOConfig):
    r"""
    Configuration of [`PrunedDPOTrainer`]: every [`~trl.DPOConfig`] field, plus the pruning fields below. With the
    defaults (keep probabilities 1, no prefix pruning) training is the stock DPO computation, run with the two exact
    savings on (`share_prompt`, `padding_free`: the same per-token log-probs, fewer tokens executed). With those two
    off as well (`share_prompt=False, padding_free=False`), it is stock TRL's own code.

    One departure from `DPOConfig`'s defaults: `bf16` left unset becomes `False` on a machine without bf16 support
    (no bf16 GPU, no XLA: e.g. a CPU-only one), where `DPOConfig`'s unset-means-`True` makes transformers refuse to
    start. Everywhere stock TRL runs, the value is stock's; an explicit `bf16=True` is never changed.

    Parameters:
        position_keep_prob (`float`, *optional*, defaults to `1.0`):
            Probability that a response position is scored by the LM head (position pruning). Kept positions are
            reweighted by `1 / position_keep_prob`. In (0, 1], or `"auto"` (see `branch_keep_prob`).
        prefix_prune_prob (`float`, *optional*, defaults to `0.0`):
            Probability that a response is cut to a random prefix (prefix pruning). In [0, 1].
        prefix_min_ratio (`float`, *optional*, defaults to `0.5`):
            Shortest prefix kept, as a fraction of the response length: the cut K is uniform on
            [ceil(prefix_min_ratio * L), L]. In (0, 1].
        branch_keep_prob (`float`, *optional*, defaults to `1.0`):
            Probability that a branch (chosen or rejected) is backpropagated (branch pruning). The others run under
            `torch.no_grad()`. In (0, 1], or `"auto"`: the trainer measures the gradient noise scale and each
            family's extra noise from the gradient norms of the training steps themselves (running estimates over
            steps, with probe steps at 1/2; first decision by step 8), and picks the probabilities that minimise the
            expected time to a given loss among those predicted to cost at most 5% more steps at 90% upper bounds
            of the measured noise (trl_pruned_dpo/auto.py); where none saves 5%, it keeps everything. Near-copy pairs
            always keep both branches. On adapter (PEFT, e.g. LoRA) training "auto" keeps every branch and never
            probes them, saying so once: there a dropped branch saves little (the frozen base computes no weight
            gradients) and on both real models studied branch pruning lost accuracy at equal time (docs/quality.md);
            set a number to prune branches there. What it chose is in the run's summary; each step's value is logged as
            `prune/branch_keep_prob` and `prune/position_keep_prob` with `prune_log_level="debug"`.
        branch_sampling (`str`, *optional*, defaults to `"paired"`):
            `"paired"`: the two branches of a pair are drawn together (at 0.5, exactly one per pair; fixed cost).
            `"independent"`: each branch is drawn on its own (the cost varies per step). On near-copy pairs
            (chosen and rejected nearly identical) independent measured half the gradient noise of paired
            (docs/quality.md); branch pruning loses accuracy on such data either way.
        prune_reference (`bool`, *optional*, defaults to `True`):
            Score the reference model with the same masks as the policy (lower variance, cheaper). If `False`, the
            reference log-probs are summed exactly over every response token.
        prune_common_prefix (`bool`, *optional*, defaults to `False`):
            Skip the response tokens that chosen and rejected share at their start: they cancel exactly in losses
            that depend only on D_w - D_l (`sigmoid`, `hinge`, `robust`, `exo_pair`, `discopop`), so this changes
            no loss value, removes their cost, and removes the aligned part of the two branch gradients that makes
            single-branch estimates noisy. With it on, the logged per-branch rewards and log-probs exclude the
            common prefix (their difference, the margin, is unchanged).
        share_prompt (`bool`, *optional*, defaults to `True`):
            Run each pair's prompt and the response start its chosen and rejected share once, as one packed
            sequence [shared | rest of chosen | rest of rejected] with a mask in which each branch sees the shared
            part and itself only (docs/method.md, "Packed layout"). Exact: the same per-token log-probs as the
            unshared forward, for every loss type, for the policy and the reference. On models the packed layout does
            not support, one warning names why and training runs TRL's own forward (with every pruning off) or the
            plugin's padded rows (with one on). Off:
            `share_prompt=False, padding_free=False`, which with every pruning off restores stock TRL's own code.
        padding_free (`bool`, *optional*, defaults to `True`):
            [`~trl.DPOConfig`]'s own field, which stock TRL 1.16 ignores (it pads); honoured here: several pairs per
            row, no padding tokens executed. Exact, like `share_prompt`, and falls back like it (the same one warning)
            on models the packed layout does not support. A plain `DPOConfig` passed to the trainer
            keeps its own value (`False` by default) and `share_prompt=False`: stock behaviour.
        group_by_prompt (`bool`, *optional*, defaults to `False`):
            Keep the pairs of one prompt in the same micro-batch (a group larger than a batch is split), the groups
            shuffled, the same order on every rank and on a resume. With `share_prompt`, a prompt group's prompt
            then runs once and each distinct response once (docs/prompt_groups.md): on data with several pairs per
            prompt (k sampled responses, rankings binarised into pairs) most of a step's tokens. It changes which
            pairs share a batch (not which pairs an epoch sees). Off, pairs that happen to share a prompt within a
            batch still share it.
        step_token_budget (`int`, *optional*):
            The merged step: with gradient accumulation, the micro-batches of one optimizer step run in as few packed
            passes (one policy forward, one reference forward each) as this many policy tokens per pass allow, instead
            of one pass per micro-batch; TRL's loss and metrics are still computed per micro-batch, so the update
            equals the unmerged one (to round-off). On a GPU a step is bound by kernel launches, which scale with
            forwards, not tokens. Unset (the default): stock's padded tokens of the step's widest micro-batch (rows x
            width of its collated `input_ids`): the plugin's activation memory per executed token is about stock's, so
            a pass of at most that many tokens keeps the peak at or below stock's. A micro-batch counts the tokens its
            packed forward runs with nothing pruned (pruning only removes tokens). Raise it to merge more (a large
            value: the whole step in one pass); `0`: off (one pass per micro-batch). Falls back, saying why once, where
            merging is not exact or not supported (the padded layout, "auto", NEFTune, a subclass overriding
            `compute_loss`, FSDP1, DeepSpeed with accelerate < 1.8: docs/method.md, "Merged steps").
        prune_seed (`int`, *optional*):
            Seed of the mask generator (an integer). Defaults to `seed`. Masks are a function of (prune_seed, global step,
            micro-step, process rank) only; they never draw from the global RNG.
        allow_pruning_change_on_resume (`bool`, *optional*, defaults to `False`):
            Checkpoints store the pruning fields above; resuming with other values is refused unless this is set.
        stop_on_divergence (`bool`, *optional*):
            Stop training when a step's loss or gradient norm is non-finite, without checkpointing that step, naming
            the last complete checkpoint (trl_pruned_dpo/safety/guards.py). Unset: on when the plugin's forward is used
            (the default, `share_prompt`/`padding_free` on), off with every pruning and exact saving off (stock trains
            on).
        divergence_factor (`float`, *optional*):
            Also stop when a step's |loss| or gradient norm is this many times the median of the steps before it. Off
            by default: a saturating DPO loss (median |loss| ~1e-4) meets one ordinary hard batch (loss ~0.7) as a
            7000x "explosion", so any finite threshold can stop a healthy run. Needs the guard on.
        prune_log_level (`str`, *optional*, defaults to `"info"`):
            Which of the plugin's own metrics are logged: `"info"`, stock's metrics (under stock's names where the
            value is stock's or unbiased for it) and the `prune/` keys that say what the run did; `"debug"`, also
            the diagnostics (`auto`'s noise scale, the cost model's choice, fractions that are 1 under the run's
            settings). Every key: docs/metrics.md.
    """

    position_keep_prob: keep_prob_or_auto = field(
        default=1.0,
        metadata={"help": "Probability that a response position is scored by the LM head (position pruning), in (0, 1], "
                  "or 'auto' (chosen during training, trl_pruned_dpo/auto.py)."},
    )
    prefix_prune_prob: float = field(
        default=0.0,
        metadata={"help": "Probability that a response is cut to a random prefix (prefix pruning), in [0, 1]."},
    )
    prefix_min_ratio: float = field(
        default=0.5,
        metadata={"help": "Shortest kept prefix as a fraction of the response length, in (0, 1]."},
    )
    branch_keep_prob: keep_prob_or_auto = field(
        default=1.0,
        metadata={"help": "Probability that a branch (chosen/rejected) is backpropagated (branch pruning), in (0, 1], "
                  "or 'auto' (chosen per pair during training, trl_pruned_dpo/auto.py)."},
    )
    branch_sampling: str = field(
        default="paired",
        metadata={
            "help": "How branches are drawn: 'paired' (both branches of a pair together; fixed cost per step) or "
            "'independent' (each branch on its own).",
            "choices": list(BRANCH_SAMPLINGS),
        },
    )
    prune_reference: bool = field(
        default=True,
        metadata={"help": "Score the reference with the same masks as the policy (else: exact reference sums)."},
    )
    prune_common_prefix: bool = field(
        default=False,
        metadata={
            "help": "Skip response tokens shared at the start of chosen and rejected (exact for losses of D_w - D_l: "
            "sigmoid, hinge, robust, exo_pair, discopop). Logged per-branch rewards then exclude that prefix."
        },
    )
    share_prompt: bool = field(
        default=True,
        metadata={
            "help": "Run each pair's prompt and common response start once, chosen and rejected packed behind it "
            "(exact; on by default; falls back, with one warning, on models the packed layout does not support; "
            "docs/method.md, 'Packed layout'). Off: `--share_prompt false --padding_free false`."
        },
    )
    # `padding_free` is DPOConfig's field, default False there and ignored by stock TRL 1.16.
    padding_free: bool = field(
        default=True,
        metadata={
            "help": "Pack several pairs per row, no padding (exact; on by default; falls back, with one warning, on "
            "models the packed layout does not support). Stock TRL ignores this field; `--padding_free false` "
            "turns it off."
        },
    )
    group_by_prompt: bool = field(
        default=False,
        metadata={"help": "Keep the pairs of one prompt in the same micro-batch (groups shuffled, split only when "
                  "larger than a batch), so that a prompt runs once per batch and each distinct response once "
                  "(docs/prompt_groups.md). Changes which pairs share a batch."},
    )
    step_token_budget: int | None = field(
        default=None,
        metadata={"help": "Policy tokens per packed pass when the micro-batches of an optimizer step are merged (one "
                  "policy and one reference forward per pass; losses still per micro-batch). Unset: stock's padded "
                  "tokens of the step's widest micro-batch (peak at or below stock's); larger merges more; 0: off "
                  "(docs/method.md, 'Merged steps')."},
    )
    prune_seed: int | None = field(
        default=None,
        metadata={"help": "Seed of the mask generator (defaults to `seed`)."},
    )

    # Failures and resume (docs/cli.md, "Failures and resume"; safety/)
    allow_pruning_change_on_resume: bool = field(
        default=False,
        metadata={"help": "Resume even if the checkpoint was trained with other pruning settings (prune_seed, keep "
                  "probabilities, sampling); the resumed run then draws other masks than the interrupted one."},
    )
    stop_on_divergence: bool | None = field(
        default=None,
        metadata={"help": "Stop training, without checkpointing the bad step, when a step's loss or gradient norm is "
                  "non-finite. Unset: on when pruning is on, off when it is off (as stock)."},
    )
    divergence_factor: float | None = field(
        default=None,
        metadata={"help": "Also stop when a step's |loss| or grad norm is this many times the median of the steps "
                  "before it (off by default: a saturating loss, median ~1e-4, meets an ordinary hard batch as a "
                  "false 'explosion')."},
    )

    # Logging (docs/metrics.md)
    prune_log_level: str = field(
        default="info",
        metadata={"help": "Which prune/* metrics are logged: 'info' (what the run did) or 'debug' (also auto's and the "
                  "cost model's diagnostics). Every key: docs/metrics.md.", "choices": list(PRUNE_LOG_LEVELS)},
    )

    @property
    def pruning_enabled(self) -> bool:
        """Whether any estimator differs from the exact computation."""
        return (
            self.auto_keep_probs
            or self.position_keep_prob < 1.0
            or self.prefix_prune_prob > 0.0
            or self.branch_keep_prob < 1.0
            or self.prune_common_prefix
        )

    @property
    def auto_keep_probs(self) -> bool:
        """Whether the trainer chooses a keep probability itself (`"auto"`)."""
        return AUTO in (self.position_keep_prob, self.branch_keep_prob)

    def mask_options(self) -> dict:
        """The sampling fields as `method.masks.draw_masks` takes them (an "auto" one is chosen each step: auto.py)."""
        return dict(position_keep_prob=self.position_keep_prob, prefix_prune_prob=self.prefix_prune_prob,
                    prefix_min_ratio=self.prefix_min_ratio, branch_keep_prob=self.branch_keep_prob,
                    branch_sampling=self.branch_sampling, drop_common_prefix=self.prune_common_prefix)

    def __post_init__(self):
        self._default_bf16_to_hardware()
        # DPOConfig's own default sets the deprecated name (notices.py).
        with checkpointing_names_quiet():
            super().__post_init__()
        self._validate_pruning()
        self._validate_prune_seed()
        self._validate_step_token_budget()
        if self.divergence_factor is not None and not self.divergence_factor > 1:
            raise ValueError(f"`divergence_factor` must be above 1 (or unset), got {self.divergence_factor}.")
        if self.prune_log_level not in PRUNE_LOG_LEVELS:
            raise ValueError(f"`prune_log_level` must be one of {list(PRUNE_LOG_LEVELS)}, got {self.prune_log_level!r}.")
        if self.prune_seed is None:
            self.prune_seed = self.seed

    def _default_bf16_to_hardware(self):
        """`bf16` left unset means "bf16 where this machine has it": DPOConfig turns an unset `bf16` into True,
        which transformers then refuses on a machine without bf16 (a CPU-only one). Only that case changes, to fp32;
        wherever stock TRL would run, the value is stock's, and an explicit `bf16=True` is passed through (and
        refused there, by transformers, naming the option)."""
        if self.bf16 is not None or self.fp16 or self.use_cpu:
            return
        from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available

        if not is_torch_bf16_gpu_available() and not is_torch_xla_available():
            self.bf16 = False

    def _validate_prune_seed(self):
        # The CLI's parser already insists on an int; a Python caller gets the same check (bool is an int: refuse it).
        if self.prune_seed is not None and (isinstance(self.prune_seed, bool) or not isinstance(self.prune_seed, int)):
            raise TypeError(f"`prune_seed` must be an integer or None, got {self.prune_seed!r}.")

    def _validate_step_token_budget(self):
        budget = self.step_token_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            raise ValueError(f"`step_token_budget` must be a number of tokens >= 0 (0: one pass per micro-batch) or "
                             f"unset (stock's padded tokens of a micro-batch), got {budget!r}.")

    def _validate_pruning(self):
        def in_range(name: str, low: float, high: float, low_open: bool) -> None:
            value = getattr(self, name)
            if name in AUTO_FIELDS:
                if isinstance(value, str):
                    try:
                        # A YAML string such as "0.5".
                        value = keep_prob_or_auto(value)
                    except ValueError:
                        raise TypeError(f"`{name}` must be a number in (0, 1] or 'auto', got {value!r}.") from None
                    setattr(self, name, value)
                if value == AUTO:
                    return
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"`{name}` must be a number, got {value!r}.")
            ok = (low < value if low_open else low <= value) and value <= high
            if not ok:
                interval = f"{'(' if low_open else '['}{low}, {high}]"
                raise ValueError(f"`{name}` must lie in {interval}, got {value}.")

        in_range("position_keep_prob", 0.0, 1.0, low_open=True)
        in_range("branch_keep_prob", 0.0, 1.0, low_open=True)
        in_range("prefix_prune_prob", 0.0, 1.0, low_open=False)
        in_range("prefix_min_ratio", 0.0, 1.0, low_open=True)
        unknown = [loss for loss in self.loss_type if loss not in TRL_LOSS_TYPES]
        # With pruning off: TRL's own (later) error, as stock.
        if unknown and self.pruning_enabled:
            raise ValueError(f"Unknown `loss_type` {unknown}: choose among {list(TRL_LOSS_TYPES)}.")
        for name in ("share_prompt", "padding_free", "group_by_prompt"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"`{name}` must be true or false, got {getattr(self, name)!r}.")
        if self.group_by_prompt and self.train_sampling_strategy != "random":
            raise ValueError(f"`group_by_prompt=True` chooses the training order itself; `train_sampling_strategy="
                             f"{self.train_sampling_strategy!r}` would too. Keep one of the two.")
        if self.branch_sampling not in BRANCH_SAMPLINGS:
            raise ValueError(
                f"`branch_sampling` must be one of {list(BRANCH_SAMPLINGS)}, got {self.branch_sampling!r}."
            )
        if self.prune_common_prefix:
            other = sorted(set(self.loss_type) - PAIR_DIFFERENCE_LOSSES)
            if other:
                raise ValueError(
                    f"`prune_common_prefix=True` is exact only for losses of D_w - D_l "
                    f"({sorted(PAIR_DIFFERENCE_LOSSES)}); `loss_type` also has {other}, whose per-branch terms do "
                    "not cancel on the common prefix. Remove those loss types or set `prune_common_prefix=False`."
                )
            if self.f_divergence_type != "reverse_kl":
                raise ValueError(
                    f"`prune_common_prefix=True` needs `f_divergence_type='reverse_kl'` (got "
                    f"{self.f_divergence_type!r}): other f-divergences transform each branch's log-ratio before the "
                    "difference, so the common prefix no longer cancels. Set one of the two back."
                )
            if self.use_weighting:
                raise ValueError(
                    "`prune_common_prefix=True` cannot be combined with `use_weighting=True`: the WPO weights are "
                    "per-branch length-normalised probabilities, which change when the common prefix is dropped. "
                    "Set one of the two to its default."
                )


# The exact savings: on by default, and exact (no estimator; docs/method.md).
EXACT_SAVINGS = ("padding_free", "share_prompt")


def uses_pruned_forward(args: object) -> bool:
    """THE switch between the plugin's forward and TRL's own: with it False, training, the reference precompute, the
    collator and the signature columns are stock's (exact parity by construction, docs/parity.md).

    True when any estimator is on (`pruning_enabled`, which includes `prune_common_prefix`) or when an exact plugin
    feature needs the plugin's forward (`share_prompt`, `padding_free`).
    """
    if not isinstance(args, PrunedDPOConfig):
        return False
    return args.pruning_enabled or any(getattr(args, name) for name in EXACT_SAVINGS)
