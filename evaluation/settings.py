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
    # Joint law of the position masks and prefix cuts: "trainer" (masks.draw_masks as it is now), "pair" (one draw per
    # pair) or "row" (one per row: the trainer's law before 6e59660/e6821e9), the last two fixed in prototypes.py.
    mask_law: str = "trainer"
    balanced: bool = False  # prototype: half the pairs backpropagate chosen, half rejected (prototypes.py)
    anneal: float = 0.0  # prototype: fraction of training over which keep probabilities ramp to 1 (prototypes.py)
    accumulation: int = 1  # micro-batches per step (the batch size per step is unchanged): `auto`'s engine path

    @property
    def prototype(self) -> bool:
        return self.mask_law != "trainer" or self.balanced or self.anneal > 0


CP = {"prune_common_prefix": True}
BRANCH = {"branch_keep_prob": 0.5}
POSITION = {"position_keep_prob": 0.5}
PREFIX = {"prefix_prune_prob": 0.5, "prefix_min_ratio": 0.5}

ROW = "row"  # the trainer's original law: every row draws its own position mask and prefix cut
PAIR = "pair"  # one draw per pair (the trainer's position law since e6821e9)

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
    # Position pruning: the trainer's masks are one draw per pair since e6821e9 (identical, draw for draw, to the
    # "pair" prototype for position-only settings); "row" keeps the original law.
    Setting("position_rows", "position 0.5, mask per row (original)", POSITION, mask_law=ROW),
    Setting("position_cp_rows", "position 0.5 + common prefix, mask per row (original)", {**POSITION, **CP},
            mask_law=ROW),
    Setting("position", "position 0.5, mask per pair (trainer)", POSITION),
    Setting("position_cp", "position 0.5 + common prefix, mask per pair (trainer)", {**POSITION, **CP}),
    Setting("position_cp_shared", "position 0.5 + common prefix, mask per pair", {**POSITION, **CP}, mask_law=PAIR),
    # Prefix pruning: the trainer draws one cut per micro-batch since 6e59660; "pair" is one cut per pair.
    Setting("prefix_rows", "prefix 0.5, cut per row (original)", PREFIX, mask_law=ROW),
    Setting("prefix", "prefix 0.5, cut per micro-batch (trainer)", PREFIX),
    Setting("prefix_cp", "prefix 0.5 + common prefix, cut per micro-batch (trainer)", {**PREFIX, **CP}),
    Setting("prefix_cp_shared", "prefix 0.5 + common prefix, cut per pair", {**PREFIX, **CP}, mask_law=PAIR),
    Setting("prefix_cp_rows", "prefix 0.5 + common prefix, cut per row (original)", {**PREFIX, **CP}, mask_law=ROW),
    Setting("combined_cp_shared", "branch + position + prefix 0.5 + common prefix, masks per pair",
            {**BRANCH, **POSITION, **PREFIX, **CP}, mask_law=PAIR),
    Setting("posprefix_cp_shared", "position + prefix 0.5 + common prefix, masks per pair",
            {**POSITION, **PREFIX, **CP}, mask_law=PAIR),
    # The regimes study (evaluation/regimes.py): `auto` chooses the branch and position probabilities itself.
    # auto.py chooses the branch and position probabilities; prefix pruning is the user's own choice, left off. With
    # the exact savings of the common prefix, and (auto_share_cp) of each pair's prompt executed once, packed.
    Setting("auto_cp", "auto branch + position + common prefix",
            {"branch_keep_prob": "auto", "position_keep_prob": "auto", **CP}),
    Setting("auto_share_cp", "auto branch + position + common prefix + shared prompt (packed)",
            {"branch_keep_prob": "auto", "position_keep_prob": "auto", **CP, "share_prompt": True}),
    Setting("auto_cp_acc2", "auto branch + position + common prefix, 2 micro-batches per step",
            {"branch_keep_prob": "auto", "position_keep_prob": "auto", **CP}, accumulation=2),
    # Diagnostics-only grid.
    Setting("branch_ind", "branch 0.5 independent", {**BRANCH, "branch_sampling": "independent"}),
    Setting("branch_bal", "branch 0.5, balanced", BRANCH, balanced=True),
    Setting("branch75", "branch 0.75", {"branch_keep_prob": 0.75}),
    Setting("branch75_ind_cp", "branch 0.75 independent + common prefix",
            {"branch_keep_prob": 0.75, **CP, "branch_sampling": "independent"}),
    Setting("branch75_cp_bal", "branch 0.75 + common prefix, balanced", {"branch_keep_prob": 0.75, **CP},
            balanced=True),
    Setting("position25_cp_rows", "position 0.25 + common prefix, mask per row (original)",
            {"position_keep_prob": 0.25, **CP}, mask_law=ROW),
    Setting("position25_cp", "position 0.25 + common prefix, mask per pair (trainer)",
            {"position_keep_prob": 0.25, **CP}),
    Setting("position75_cp", "position 0.75 + common prefix, mask per pair (trainer)",
            {"position_keep_prob": 0.75, **CP}),
    Setting("prefix90_cp", "prefix 0.9 + common prefix, cut per micro-batch (trainer)",
            {"prefix_prune_prob": 0.9, "prefix_min_ratio": 0.5, **CP}),
    Setting("prefix90_cp_shared", "prefix 0.9 + common prefix, cut per pair",
            {"prefix_prune_prob": 0.9, "prefix_min_ratio": 0.5, **CP}, mask_law=PAIR),
    Setting("combined_cp_rows", "branch + position + prefix 0.5 + common prefix, masks per row (original)",
            {**BRANCH, **POSITION, **PREFIX, **CP}, mask_law=ROW),
    Setting("combined_cp", "branch + position + prefix 0.5 + common prefix (trainer)",
            {**BRANCH, **POSITION, **PREFIX, **CP}),
    Setting("combined_cp_shared_bal", "branch + position + prefix 0.5 + common prefix, masks per pair, balanced",
            {**BRANCH, **POSITION, **PREFIX, **CP}, mask_law=PAIR, balanced=True),
    Setting("posprefix_cp", "position + prefix 0.5 + common prefix (trainer)", {**POSITION, **PREFIX, **CP}),
]
SETTINGS = {s.name: s for s in _ALL}

# Trained over seeds (the costly part). The order is the order of the tables.
TRAINED = [
    "stock", "branch", "branch_cp", "branch_ind_cp", "branch75_cp", "branch75_ind_cp", "branch_cp_anneal",
    "position_rows", "position_cp_rows", "position_cp_shared", "prefix_rows", "prefix", "prefix_cp_shared",
    "posprefix_cp_shared", "combined_cp_shared",
]
QUICK_TRAINED = ["stock", "branch_cp", "position_cp", "prefix"]
# Exact settings: their training curve is stock's up to float round-off (tests/test_off_means_stock.py and the
# common-prefix cancellation), so they are timed, not trained; at equal wall-clock they read stock's curve.
EXACT_BASELINES = ["pruned_off", "common_prefix"]
DIAGNOSED = [  # by family, the way a user picks: exact, branch, position, prefix, combined
    "common_prefix",
    "branch", "branch_ind", "branch_bal", "branch_cp", "branch_ind_cp", "branch_cp_bal", "branch75", "branch75_cp",
    "branch75_ind_cp", "branch75_cp_bal",
    "position_rows", "position_cp_rows", "position", "position_cp", "position_cp_shared", "position25_cp_rows",
    "position25_cp", "position75_cp",
    "prefix_rows", "prefix_cp_rows", "prefix", "prefix_cp", "prefix_cp_shared", "prefix90_cp", "prefix90_cp_shared",
    "combined_cp_rows", "combined_cp", "combined_cp_shared", "combined_cp_shared_bal", "posprefix_cp",
    "posprefix_cp_shared",
]
assert set(DIAGNOSED) == {s.name for s in _ALL if s.name not in ("stock", "pruned_off")
                          and not s.name.startswith("auto")
                          and not s.anneal}
# Diagnosed on far pairs too (tasks.far_pairs), to show where the near-copy noise comes from.
FAR_DIAGNOSED = ["branch", "branch_ind", "branch_cp", "branch_ind_cp", "position_rows", "position_cp_rows",
                 "position_cp", "prefix_rows", "prefix", "prefix_cp_shared", "combined_cp", "posprefix_cp_shared"]
QUICK_DIAGNOSED = ["common_prefix", "branch", "branch_cp", "branch_cp_bal", "position_cp_rows", "position_cp",
                   "prefix", "prefix_cp_shared"]
