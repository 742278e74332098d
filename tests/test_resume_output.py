"""A resumed run says the same things as an uninterrupted one: the same summary lines (plus the `resumed from` note,
`auto chose` included) and no alarming notice about the tied head (`lm_head.weight` "missing" from the checkpoint:
it is stored once, as the embedding; seam.without_tied_keys)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The demo's recipe (auto included) on the random-init model, long enough for auto to decide before step 8.
RUN = ["--config", "configs/demo.yaml", "--model_name_or_path", "builtin:tiny-demo", "--max_steps", "16",
       "--logging_steps", "4", "--eval_strategy", "no", "--save_strategy", "steps", "--save_steps", "8",
       "--disable_tqdm", "true"]


def cli(cache, *argv):
    env = {**os.environ, "TRL_PRUNED_DPO_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run([sys.executable, "-m", "trl_pruned_dpo", *RUN, *argv], env=env, cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def labels(stdout: str) -> list[str]:
    summary = stdout[stdout.index("trl-pruned-dpo summary"):].splitlines()[1:]
    return [line[2:26].strip() for line in summary if line.startswith("  ")]


@pytest.mark.slow
def test_resumed_summary_matches_the_uninterrupted_one(tmp_path):
    whole = cli(tmp_path / "cache", "--output_dir", str(tmp_path / "whole"))
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(tmp_path / "whole" / "checkpoint-8", resumed_dir / "checkpoint-8")  # as if stopped after step 8
    resumed = cli(tmp_path / "cache", "--output_dir", str(resumed_dir), "--resume_from_checkpoint", "true")
    assert "auto chose" in labels(whole.stdout)
    assert labels(resumed.stdout) == [*labels(whole.stdout)[:-1], "resumed from", labels(whole.stdout)[-1]]
    assert "missing keys" not in resumed.stderr + resumed.stdout


def test_a_tied_head_is_not_reported_missing():
    """seam.without_tied_keys, and the transformers private it feeds (`Trainer._issue_warnings_after_load`)."""
    from torch.nn.modules.module import _IncompatibleKeys
    from transformers import Trainer

    from trl_pruned_dpo.demo import build_model
    from trl_pruned_dpo.seam import without_tied_keys

    assert callable(Trainer._issue_warnings_after_load)
    result = _IncompatibleKeys(missing_keys=["lm_head.weight", "model.norm.weight"], unexpected_keys=[])
    assert without_tied_keys(build_model("tiny-demo"), result).missing_keys == ["model.norm.weight"]
    peft_style = _IncompatibleKeys(missing_keys=["base_model.model.lm_head.weight"], unexpected_keys=[])
    assert without_tied_keys(build_model("tiny-demo"), peft_style).missing_keys == []
