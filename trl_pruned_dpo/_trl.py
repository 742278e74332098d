"""Every TRL internal the plugin relies on, in one place, checked at import.

TRL's DPO internals moved three times between 1.13 and 1.15; if one of these disappears the plugin fails here, at
import, with the name of what moved, instead of training with a silently different computation.
"""

from contextlib import contextmanager

import trl
import trl.trainer.utils as trl_utils
from packaging.version import Version

TESTED_TRL = ("1.16.0", "1.17.0")  # [low, high)

if not (Version(TESTED_TRL[0]) <= Version(trl.__version__) < Version(TESTED_TRL[1])):
    raise ImportError(
        f"trl-pruned-dpo is tested with trl>={TESTED_TRL[0]},<{TESTED_TRL[1]} and found trl {trl.__version__}: "
        f"install a tested version (`pip install 'trl>={TESTED_TRL[0]},<{TESTED_TRL[1]}'`)."
    )

try:
    from trl.models.utils import disable_gradient_checkpointing
    from trl.trainer.dpo_trainer import DPOTrainer
    from trl.trainer.utils import use_adapter

    trl_utils._use_triton  # noqa: B018 - read by add_fused_lm_head's forward to decide whether to compact
    DPOTrainer._compute_loss  # noqa: B018 - loss + metrics from per-token log-probs, called with a replay "model"
    DPOTrainer.compute_ref_log_probs  # noqa: B018 - reference sums (ld_alpha weighting) from per-token log-probs
    DPOTrainer._save_checkpoint  # noqa: B018 - completion marker and run state (checkpoints.py)
    DPOTrainer._maybe_log_save_evaluate  # noqa: B018 - each step's divergence check, before it is logged or saved
except (ImportError, AttributeError) as error:  # pragma: no cover - only on an untested TRL
    raise ImportError(f"trl-pruned-dpo: a TRL internal it relies on has moved ({error}); pin trl to 1.16.x.") from error

__all__ = ["DPOTrainer", "compact_lm_head", "disable_gradient_checkpointing", "use_adapter"]


@contextmanager
def compact_lm_head():
    """Make TRL's fused LM head score only the labelled positions on every device.

    TRL gathers the labelled hidden states before the head only on Triton devices and scores every position
    elsewhere (CPU included), so position pruning would save nothing there. The head's kernel itself is untouched:
    the switch only selects `hidden_states[mask]` instead of all positions.
    """
    original = trl_utils._use_triton
    trl_utils._use_triton = lambda device: True
    try:
        yield
    finally:
        trl_utils._use_triton = original
