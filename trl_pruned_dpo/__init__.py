"""trl-pruned-dpo: stochastic pruning of the DPO computation graph, as a drop-in `DPOTrainer` for TRL 1.x."""

from .config import PrunedDPOConfig
from .trainer import PrunedDPOTrainer

__all__ = ["PrunedDPOConfig", "PrunedDPOTrainer"]
__version__ = "0.1.0"
