"""pytest plugin (`-p swap_plugin`) for TRL's tests/test_dpo_trainer.py: the offline stand-ins (standins.py) in place
of the hub datasets, and, with SWAP=off or SWAP=on, `PrunedDPOTrainer` / `PrunedDPOConfig` in place of TRL's classes
(on: branch, position and prefix pruning at 0.5 unless a test sets them; off and on with the exact savings
`share_prompt`/`padding_free`, on by default, off unless a test sets them: off is stock TRL's code). SWAP=default runs
`PrunedDPOConfig`'s own defaults (exact savings on). SWAP=stock runs TRL's own classes: the baseline that tells an
expected failure (a stand-in that does not exist offline) from one the plugin causes."""

import os

import pytest

import standins

SWAP = os.environ.get("SWAP", "stock")
PRUNING_ON = {"branch_keep_prob": 0.5, "position_keep_prob": 0.5, "prefix_prune_prob": 0.5}
SAVINGS_OFF = {"share_prompt": False, "padding_free": False}
MODES = {"off": SAVINGS_OFF, "on": {**SAVINGS_OFF, **PRUNING_ON}, "default": {}}


@pytest.fixture(autouse=True)
def _pruned_swap(request, monkeypatch):
    module = request.module
    monkeypatch.setattr(module, "load_dataset", standins.load_dataset, raising=False)
    if SWAP == "stock":
        return
    from trl_pruned_dpo import PrunedDPOConfig, PrunedDPOTrainer

    def config(*args, **kwargs):
        return PrunedDPOConfig(*args, **{**MODES[SWAP], **kwargs})

    monkeypatch.setattr(module, "DPOTrainer", PrunedDPOTrainer, raising=False)
    monkeypatch.setattr(module, "DPOConfig", config, raising=False)
