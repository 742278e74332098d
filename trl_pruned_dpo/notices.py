"""Library notices the plugin causes or can avoid, hidden narrowly: each filter names one message of one library, and
the warnings ones apply only around the plugin's own calls, never to the user's code.

- bitsandbytes logs "Failed to load CPU gemm_4bit_forward from kernels-community: ..." (no `kernels` module, or, with
  `kernels` installed, a hub repository it may not load offline) when TRL imports it, QLoRA or not; the CPU 4-bit path
  falls back to its own kernel. With `HF_HUB_OFFLINE=1`, `kernels` itself first logs "Skipping publisher trust check
  for 'kernels-community/quantization-bitsandbytes' ...". A filter on each of those two loggers, for that one message,
  installed when the package is imported (before TRL).
- transformers 5 deprecates the `gradient_checkpointing*` names in favour of `activation_checkpointing*`. DPOConfig's
  own default sets `gradient_checkpointing`, and TRL's `disable_gradient_checkpointing` (entered around every no-grad
  forward, the plugin's and TRL's reference and evaluation passes) calls the deprecated methods, the first time
  printing four FutureWarnings the user can do nothing about. `checkpointing_names_quiet()` hides that one message
  inside `PrunedDPOConfig.__post_init__` and `PrunedDPOTrainer.train/evaluate/predict` only.
- TRL 1.16 logs that `padding_free=True` "is temporarily unavailable ... falling back to standard padding" when its
  `DPOTrainer.__init__` sees the field; the plugin's packed forward honours it (or says in its own line why a model
  falls back), so `trl_padding_free_notice_hidden` hides that one message while the constructor runs.
- Building a built-in model or exporting a built-in dataset (demo/) would draw transformers' "Writing model shards"
  and datasets' "Creating json from Arrow format" bars, which stock `trl dpo` never shows; `progress_bars_hidden()`
  turns both libraries' bars off inside that block only (the build prints its own one line instead).

What stays is listed in docs/cli.md ("Messages from the libraries").
"""

import contextlib
import logging
import warnings

# logger -> the text of the one message hidden on it: bitsandbytes' optional CPU 4-bit kernels, at its import
IMPORT_NOTICES = {"bitsandbytes.backends.cpu.ops": "gemm_4bit_forward",
                  "kernels._internals.hf_hub": "'kernels-community/quantization-bitsandbytes'"}
_DEPRECATED_CHECKPOINTING = r"`(is_)?gradient_checkpointing(_kwargs|_enable|_disable)?` is deprecated"


class _HideOne(logging.Filter):
    """Drops a logger's records whose message contains `text`; every other record passes."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def hide_import_notices() -> None:
    """Install the import-time filters (idempotent); they must run before bitsandbytes is imported."""
    for name, text in IMPORT_NOTICES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _HideOne) and f.text == text for f in logger.filters):
            logger.addFilter(_HideOne(text))


@contextlib.contextmanager
def checkpointing_names_quiet():
    """Hide transformers' FutureWarning about the deprecated `gradient_checkpointing*` names inside this block only."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_DEPRECATED_CHECKPOINTING, category=FutureWarning)
        yield


_TRL_DPO_LOGGER = "trl.trainer.dpo_trainer"


def _not_the_padding_free_notice(record: logging.LogRecord) -> bool:
    return "`padding_free=True` is temporarily unavailable" not in record.getMessage()


@contextlib.contextmanager
def trl_padding_free_notice_hidden(active: bool):
    """Hide TRL's "padding_free ... falling back" notice inside this block, when the plugin honours the field."""
    logger = logging.getLogger(_TRL_DPO_LOGGER)
    if active:
        logger.addFilter(_not_the_padding_free_notice)
    try:
        yield
    finally:
        logger.removeFilter(_not_the_padding_free_notice)


@contextlib.contextmanager
def progress_bars_hidden():
    """Turn transformers' and datasets' progress bars off inside this block, as they were after it."""
    import datasets
    from transformers.utils import logging as transformers_logging

    transformers_on = transformers_logging.is_progress_bar_enabled()
    datasets_on = not datasets.are_progress_bars_disabled()
    transformers_logging.disable_progress_bar()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if transformers_on:
            transformers_logging.enable_progress_bar()
        if datasets_on:
            datasets.enable_progress_bars()
