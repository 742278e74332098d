"""The class swap that the `trl dpo` hook's .pth line (trl_hook.py) runs at interpreter start-up when
``TRL_PRUNED_DPO=1``.

A module of its own so that start-up never imports `trl_pruned_dpo.trl_hook`: `python -m trl_pruned_dpo.trl_hook`
would then find its module already imported and print runpy's RuntimeWarning about sys.modules.
"""


def install() -> None:
    """Point `trl.DPOConfig` and `trl.DPOTrainer` at the pruned classes in this process."""
    import trl

    from . import PrunedDPOConfig, PrunedDPOTrainer

    trl.DPOConfig = PrunedDPOConfig
    trl.DPOTrainer = PrunedDPOTrainer
