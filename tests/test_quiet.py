"""Quiet output through the Python API, as through the CLI: the README's two-line swap, run in a fresh interpreter
(import-time notices count), prints none of the library notices the plugin causes or can avoid (notices.py), and
the narrow filters leave the user's own warnings alone.

What stays is listed in docs/cli.md ("Messages from the libraries"), with why it is harmless.
"""

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOTICES = ("gemm_4bit", "quantization-bitsandbytes", "is deprecated", "pin_memory", "num_processes")

API_RUN = """
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_pruned_dpo import PrunedDPOConfig, PrunedDPOTrainer
from trl_pruned_dpo.demo import load_builtin, resolve_model

path = resolve_model("builtin:tiny-demo")
model, tok = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
ds = load_builtin("builtin:sort-short")
args = PrunedDPOConfig(output_dir="out", beta=0.1, max_steps=2, prefix_prune_prob=0.5, prune_common_prefix=True,
                       gradient_checkpointing=True, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=64,
                       report_to="none", disable_tqdm=True)
trainer = PrunedDPOTrainer(model=model, args=args, train_dataset=ds["train"], eval_dataset=ds["test"].select(range(64)),
                           processing_class=tok)
trainer.train()
trainer.evaluate()
print("trained", trainer.state.global_step)
"""


def test_python_api_prints_no_library_notices(tmp_path):
    env = {**os.environ, "TRL_PRUNED_DPO_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run([sys.executable, "-c", API_RUN], env=env, cwd=tmp_path, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and "trained 2" in result.stdout, result.stderr[-3000:]
    noise = [line for line in result.stderr.splitlines() if any(text in line for text in NOTICES)]
    assert not noise, noise


def test_the_filters_are_narrow():
    """Outside the plugin's own calls, transformers' deprecation warnings and other loggers' messages still show."""
    import logging

    import trl_pruned_dpo  # noqa: F401 - installs the import-time filter
    from trl_pruned_dpo.notices import checkpointing_names_quiet

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with checkpointing_names_quiet():
            warnings.warn("`gradient_checkpointing_enable` is deprecated and will be removed", FutureWarning)
        warnings.warn("`gradient_checkpointing_enable` is deprecated and will be removed", FutureWarning)
        warnings.warn("'pin_memory' argument is set as true but no accelerator is found", UserWarning)
    assert [str(w.message).split()[0] for w in caught] == ["`gradient_checkpointing_enable`", "'pin_memory'"]
    for name, hidden in (("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward from x"),
                         ("kernels._internals.hf_hub", "Skipping publisher trust check for "
                          "'kernels-community/quantization-bitsandbytes' because Hugging Face Hub is in offline mode.")):
        logger = logging.getLogger(name)
        assert not logger.filter(logging.makeLogRecord({"msg": hidden}))
        assert logger.filter(logging.makeLogRecord({"msg": "any other message"}))
    assert logging.getLogger("kernels._internals.hf_hub").filter(logging.makeLogRecord(
        {"msg": "Skipping publisher trust check for 'someone/another-kernel' because Hugging Face Hub is offline."}))


def test_trl_padding_free_notice_hidden_only_where_the_plugin_honours_it(tmp_path, caplog):
    """TRL 1.16 says `padding_free` falls back to padding; with the plugin it does not, so that line must not show —
    and it still shows for stock `DPOTrainer`, whose own behaviour it describes."""
    import logging

    from datasets import Dataset
    from tiny import build_trainer, char_tokenizer, preference_rows
    from trl import DPOConfig, DPOTrainer

    from trl_pruned_dpo import PrunedDPOConfig, PrunedDPOTrainer

    data = Dataset.from_list(preference_rows(n=4))
    notice = "`padding_free=True` is temporarily unavailable"
    with caplog.at_level(logging.WARNING, logger="trl.trainer.dpo_trainer"):
        build_trainer(PrunedDPOTrainer, PrunedDPOConfig, char_tokenizer(), data, tmp_path / "p", padding_free=True)
    assert notice not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trl.trainer.dpo_trainer"):
        build_trainer(DPOTrainer, DPOConfig, char_tokenizer(), data, tmp_path / "s", padding_free=True)
    assert notice in caplog.text


_ENVIRONMENT_BEFORE_QUIET = {}


def test_a_script_made_quiet_inside_a_test():
    """First of two (they run in this order, in one process): a research script's `quiet()`, as the benchmarks'
    smoke tests run it in-process, raises the plugin's loggers to ERROR and sets environment variables."""
    from benchmarks.workload import quiet

    _ENVIRONMENT_BEFORE_QUIET.update(os.environ)
    _ENVIRONMENT_BEFORE_QUIET.pop("PYTEST_CURRENT_TEST")
    quiet()
    assert not logging.getLogger("trl_pruned_dpo.trainer").isEnabledFor(logging.WARNING)
    assert os.environ["TRANSFORMERS_VERBOSITY"] == "error"


def test_the_next_test_still_sees_the_plugins_warnings(caplog):
    """Second of two: tests/conftest.py put the loggers and the environment back, so a test of a warning does not pass
    or fail by which file ran before it in the same process."""
    if not _ENVIRONMENT_BEFORE_QUIET:
        pytest.skip("checks what test_a_script_made_quiet_inside_a_test left: run the two together")
    with caplog.at_level("WARNING"):
        logging.getLogger("trl_pruned_dpo.trainer").warning("resuming from checkpoint-2")
    assert [r.getMessage() for r in caplog.records] == ["resuming from checkpoint-2"]
    assert {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"} == _ENVIRONMENT_BEFORE_QUIET
