"""Every TRL internal the plugin relies on, in one place.

The imports fail at import time if TRL moves them. What an import cannot see, whether TRL's fused LM head still honours
the switch that makes it score only the labelled positions, is checked by behaviour: `check_compact_lm_head` runs a
tiny forward once and counts the rows that actually reach the head's matrix product. The replay seam into TRL's
`_compute_loss` is pinned by tests (tests/test_dropin.py::test_replay_seam_assumptions), not here.
"""

from contextlib import contextmanager

import torch
import trl
import trl.trainer.utils as trl_utils
from packaging.version import Version
from torch.utils._python_dispatch import TorchDispatchMode

TESTED_TRL = ("1.16.0", "1.17.0")  # [low, high)

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

    DPOTrainer._save_checkpoint  # noqa: B018 - completion marker and run state (checkpoints.py)
    DPOTrainer._maybe_log_save_evaluate  # noqa: B018 - each step's divergence check, before it is logged or saved
except (ImportError, AttributeError) as error:  # pragma: no cover - only on an untested TRL
    raise ImportError(f"trl-pruned-dpo: a TRL internal it relies on has moved ({error}); pin trl to 1.16.x.") from error

__all__ = [
    "DPOConfig",
    "DPOTrainer",
    "check_compact_lm_head",
    "compact_lm_head",
    "disable_gradient_checkpointing",
    "get_config_model_id",
    "use_adapter",
]


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


class _HeadRows(TorchDispatchMode):
    """Counts the rows of every matrix product whose output is `vocab` wide: the positions the LM head scores."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm) and out.shape[-1] == self.vocab:
            self.rows += out.shape[0]
        return out


def head_rows_scored(labels_kept: int = 2, length: int = 8, vocab: int = 37) -> int:
    """Rows that reach the fused LM head of a tiny Llama under `compact_lm_head` when `labels_kept` labels are set."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=length)
    with torch.random.fork_rng(devices=[]):  # the init must not move the caller's global RNG
        model = LlamaForCausalLM(config)
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
