"""The settings the study compares. Stock is TRL's own `DPOTrainer`; every other one is a `PrunedDPOTrainer`.

A setting is data: which trainer, which `PrunedDPOConfig` pruning fields, and which prototype estimator options
(prototypes.py) it adds. `TRAINED` are trained over seeds; `DIAGNOSED` get gradient diagnostics only (they are cheap,
so they cover a grid of probabilities that users can pick from). Names are short and stable: they key the cached
results, the plots and the tables.
"""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Setting:
    name: str
    label: str
    pruning: dict = field(default_factory=dict)  # PrunedDPOConfig fields; empty + stock=True: TRL's DPOTrainer
    stock: bool = False
    shared_masks: bool = False  # prototype: one position mask / prefix cut per pair (prototypes.py)
    balanced: bool = False  # prototype: half the pairs backpropagate chosen, half rejected (prototypes.py)
    anneal: float = 0.0  # prototype: fraction of training over which keep probabilities ramp to 1 (prototypes.py)

    @property
    def prototype(self) -> bool:
        return self.shared_masks or self.balanced or self.anneal > 0


CP = {"prune_common_prefix": True}
BRANCH = {"branch_keep_prob": 0.5}
POSITION = {"position_keep_prob": 0.5}
PREFIX = {"prefix_prune_prob": 0.5, "prefix_min_ratio": 0.5}

_ALL = [
    Setting("stock", "stock TRL DPOTrainer", stock=True),
    Setting("pruned_off", "PrunedDPOTrainer, pruning off (exact)", {}),
    Setting("common_prefix", "common prefix only (exact)", CP),
    Setting("branch", "branch 0.5 (paired)", BRANCH),
    Setting("branch_cp", "branch 0.5 + common prefix", {**BRANCH, **CP}),
    Setting("branch_ind_cp", "branch 0.5 independent + common prefix",
            {**BRANCH, **CP, "branch_sampling": "independent"}),
    Setting("branch75_cp", "branch 0.75 + common prefix", {"branch_keep_prob": 0.75, **CP}),
    Setting("branch_cp_bal", "branch 0.5 + common prefix, balanced", {**BRANCH, **CP}, balanced=True),
    Setting("branch_cp_anneal", "branch 0.5 + common prefix, annealed to 1 (last 30%)", {**BRANCH, **CP}, anneal=0.3),
    Setting("position", "position 0.5", POSITION),
    Setting("position_cp", "position 0.5 + common prefix", {**POSITION, **CP}),
    Setting("position_cp_shared", "position 0.5 + common prefix + pair-shared mask", {**POSITION, **CP},
            shared_masks=True),
    Setting("prefix", "prefix 0.5 (min ratio 0.5)", PREFIX),
    Setting("prefix_cp", "prefix 0.5 + common prefix", {**PREFIX, **CP}),
    Setting("combined", "branch + position + prefix 0.5", {**BRANCH, **POSITION, **PREFIX}),
    Setting("combined_cp_shared", "branch + position + prefix 0.5 + common prefix + shared masks",
            {**BRANCH, **POSITION, **PREFIX, **CP}, shared_masks=True),
    # Diagnostics-only grid.
    Setting("branch_ind", "branch 0.5 independent", {**BRANCH, "branch_sampling": "independent"}),
    Setting("branch_bal", "branch 0.5, balanced", BRANCH, balanced=True),
    Setting("branch75_cp_bal", "branch 0.75 + common prefix, balanced", {"branch_keep_prob": 0.75, **CP},
            balanced=True),
    Setting("combined_cp_shared_bal", "branch + position + prefix 0.5 + common prefix + shared masks + balanced",
            {**BRANCH, **POSITION, **PREFIX, **CP}, shared_masks=True, balanced=True),
    Setting("branch75", "branch 0.75", {"branch_keep_prob": 0.75}),
    Setting("branch75_ind_cp", "branch 0.75 independent + common prefix",
            {"branch_keep_prob": 0.75, **CP, "branch_sampling": "independent"}),
    Setting("position25_cp", "position 0.25 + common prefix", {"position_keep_prob": 0.25, **CP}),
    Setting("position25_cp_shared", "position 0.25 + common prefix + shared mask", {"position_keep_prob": 0.25, **CP},
            shared_masks=True),
    Setting("position75_cp", "position 0.75 + common prefix", {"position_keep_prob": 0.75, **CP}),
    Setting("position_shared", "position 0.5 + pair-shared mask", POSITION, shared_masks=True),
    Setting("prefix_cp_shared", "prefix 0.5 + common prefix + shared cut", {**PREFIX, **CP}, shared_masks=True),
    Setting("prefix90_cp", "prefix 0.9 (min ratio 0.5) + common prefix", {"prefix_prune_prob": 0.9,
            "prefix_min_ratio": 0.5, **CP}),
    Setting("combined_cp", "branch + position + prefix 0.5 + common prefix", {**BRANCH, **POSITION, **PREFIX, **CP}),
]
SETTINGS = {s.name: s for s in _ALL}

# Trained over seeds (the costly part). The order is the order of the tables.
TRAINED = [
    "stock", "branch", "branch_cp", "branch75_cp", "branch_cp_anneal", "position", "position_cp",
    "position_cp_shared", "prefix", "combined_cp_shared",
]
QUICK_TRAINED = ["stock", "branch_cp", "position_cp_shared", "prefix"]
# Exact settings: their training curve is stock's up to float round-off (tests/test_off_means_stock.py and the
# common-prefix cancellation), so they are timed, not trained; at equal wall-clock they read stock's curve.
EXACT_BASELINES = ["pruned_off", "common_prefix"]
DIAGNOSED = [s.name for s in _ALL if s.name not in ("stock", "pruned_off") and not s.anneal]
# Diagnosed on far pairs too (tasks.far_pairs), to show where the near-copy noise comes from.
FAR_DIAGNOSED = ["branch", "branch_ind", "branch_cp", "branch_ind_cp", "position", "position_cp", "position_cp_shared",
                 "prefix", "combined_cp"]
QUICK_DIAGNOSED = ["common_prefix", "branch", "branch_cp", "branch_cp_bal", "position_cp", "position_cp_shared",
                   "prefix"]
