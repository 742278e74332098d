"""pytest plugin (`-p swap_plugin`) for TRL's tests/test_dpo_trainer.py: the offline stand-ins (standins.py) in place
of the hub datasets, and, with SWAP=off or SWAP=on, `PrunedDPOTrainer` / `PrunedDPOConfig` in place of TRL's classes
(on: branch, position and prefix pruning at 0.5 unless a test sets them). SWAP=stock runs TRL's own classes: the
baseline that tells an expected failure (a stand-in that does not exist offline) from one the plugin causes."""

import os

import pytest

import standins

SWAP = os.environ.get("SWAP", "stock")
PRUNING_ON = {"branch_keep_prob": 0.5, "position_keep_prob": 0.5, "prefix_prune_prob": 0.5}


@pytest.fixture(autouse=True)
def _pruned_swap(request, monkeypatch):
    module = request.module
    monkeypatch.setattr(module, "load_dataset", standins.load_dataset, raising=False)
    if SWAP == "stock":
        return
    from trl_pruned_dpo import PrunedDPOConfig, PrunedDPOTrainer

    def config(*args, **kwargs):
        return PrunedDPOConfig(*args, **{**(PRUNING_ON if SWAP == "on" else {}), **kwargs})

    monkeypatch.setattr(module, "DPOTrainer", PrunedDPOTrainer, raising=False)
    monkeypatch.setattr(module, "DPOConfig", config, raising=False)
