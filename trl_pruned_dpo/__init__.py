"""trl-pruned-dpo: stochastic pruning of the DPO computation graph, as a drop-in `DPOTrainer` for TRL 1.x.

The public names load lazily, so that the command line can reject bad input before importing torch and TRL.
"""

from .notices import hide_import_notices

__all__ = ["PrunedDPOConfig", "PrunedDPOTrainer"]
__version__ = "0.1.0"

# Hidden before TRL imports bitsandbytes (notices.py: one message of one logger).
hide_import_notices()


def __getattr__(name: str) -> type:
    if name == "PrunedDPOConfig":
        from .config import PrunedDPOConfig

        return PrunedDPOConfig
    if name == "PrunedDPOTrainer":
        from .trainer import PrunedDPOTrainer

        return PrunedDPOTrainer
    raise AttributeError(f"module 'trl_pruned_dpo' has no attribute {name!r}")
