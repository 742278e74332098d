"""Fault injection: a run that crashes, is killed, is stopped or runs out of disk loses nothing and says so (issue 13).

- a save interrupted at a chosen file (in process, and a real kill -9 in a subprocess) leaves a checkpoint that resume
  skips, naming it; resuming from the previous complete one ends bitwise equal to the uninterrupted run, with the
  same logged figures (the logging window is restored);
- `--resume_from_checkpoint true` with nothing to resume, an incomplete checkpoint given by path, and other pruning
  settings on resume each fail in one line; the override flag lets the last through;
- a full disk (patched write, and a real small tmpfs where user namespaces allow one) says so in one line, removes
  the partial checkpoint and leaves the last complete one resumable; a read-only output_dir fails before any work;
- a second run on a locked output_dir fails in one line; a lock left by a killed run is taken over;
- SIGTERM mid-training exits 143 with "stopped at step X of Y by SIGTERM; checkpoint ... saved; resume with ...";
- alarming settings warn before training; a NaN loss stops the run without checkpointing it; the summary shows the
  worst values; a dataset whose every prompt exceeds max_length says so.

Subprocesses pay ~8 s of imports each (three here); the rest trains the 2-layer test model in process.
"""

import errno
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from conftest import SAVINGS_OFF, build_trainer, preference_rows
from datasets import Dataset

from trl_pruned_dpo import PrunedDPOConfig, PrunedDPOTrainer, cli
from trl_pruned_dpo.safety import checkpoints, disk_writes
from trl_pruned_dpo.errors import DiskFullError, EmptyTrainingSet, OutputDirError, ResumeError, TrainingDiverged
from trl_pruned_dpo.safety.checkpoints import MARKER
from trl_pruned_dpo.safety.guards import (
    MAX_INVERSE_WEIGHT, DivergenceGuard, largest_inverse_weight, pretraining_warnings,
)
from trl_pruned_dpo.safety.output_dir import LOCK_NAME, OutputLock, check_writable

REPO = Path(__file__).resolve().parents[1]
SAVE = dict(max_steps=6, save_strategy="steps", save_steps=2, logging_steps=3, branch_keep_prob=0.5,
            branch_sampling="independent", prefix_prune_prob=0.5)


class OfflineCli:
    """The command line in this process on the offline demo (configs/demo.yaml), output captured."""

    def __init__(self, capfd, cache, dataset):
        self.capfd = capfd
        self.dataset = dataset
        self.env = {**os.environ, "TRL_PRUNED_DPO_CACHE": str(cache), "HF_HUB_OFFLINE": "1",
                    "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}

    def args(self, out, *extra) -> list[str]:
        return ["--config", str(REPO / "configs" / "demo.yaml"), "--dataset_name", str(self.dataset),
                "--output_dir", str(out), "--max_steps", "4",
                "--save_strategy", "steps", "--save_steps", "2", "--logging_steps", "3", "--eval_strategy", "no",
                "--disable_tqdm", "true", *extra]

    def main(self, *args) -> tuple[int, str]:
        self.capfd.readouterr()
        code = cli.main([str(a) for a in args])
        captured = self.capfd.readouterr()
        return code, captured.out + captured.err

    @staticmethod
    def load(out) -> dict:
        from safetensors.torch import load_file

        return load_file(str(Path(out) / "model.safetensors"))


@pytest.fixture()
def offline_cli(monkeypatch, capfd, tmp_path_factory):
    import datasets.config
    from huggingface_hub import constants

    cache = tmp_path_factory.getbasetemp() / "demo-cache"
    dataset = tmp_path_factory.getbasetemp() / "small-mix"
    if not dataset.is_dir():  # the demo task, 64 pairs instead of 4096: tokenizing those would dominate each run
        from trl_pruned_dpo.demo.tasks import make_splits

        dataset.mkdir()
        for split, rows in make_splits("mix", 64, 16).items():
            rows.to_json(str(dataset / f"{split}.jsonl"))
    monkeypatch.setenv("TRL_PRUNED_DPO_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    return OfflineCli(capfd, cache, dataset)


@pytest.fixture()
def data():
    return Dataset.from_list(preference_rows(16))


def trainer_for(tokenizer, data, out, **overrides):
    return build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, data, out, **{**SAVE, **overrides})


def weights(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def logged(trainer):
    """The training log entries, without timings."""
    return [{k: v for k, v in e.items() if "runtime" not in k and "per_second" not in k and k != "train_loss"}
            for e in trainer.state.log_history]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tokenizer):
    data = Dataset.from_list(preference_rows(16))
    trainer = trainer_for(tokenizer, data, tmp_path_factory.mktemp("whole"))
    trainer.train()
    return weights(trainer.model), logged(trainer)


class Killed(BaseException):
    """Stands for a kill at a chosen point: nothing after it runs, nothing cleans up."""


def kill_at(monkeypatch, stage: str, step: int):
    """Interrupt the save of checkpoint-`step` while (or just before) `stage` is written."""
    import transformers.modeling_utils as modeling_utils
    from transformers.trainer_callback import TrainerState

    def at_step(path):
        return f"checkpoint-{step}" in str(path)

    if stage == "model.safetensors":
        original = modeling_utils.safe_save_file

        def save_file(tensors, filename, *args, **kwargs):
            if at_step(filename):
                Path(filename).write_bytes(b"\0" * 100)  # a torn write
                raise Killed
            return original(tensors, filename, *args, **kwargs)

        monkeypatch.setattr(modeling_utils, "safe_save_file", save_file)
    elif stage == "optimizer.pt":
        original_save = torch.save

        def save(obj, f, *args, **kwargs):
            original_save(obj, f, *args, **kwargs)
            if at_step(f) and str(f).endswith("optimizer.pt"):
                os.truncate(f, os.path.getsize(f) // 2)
                raise Killed

        monkeypatch.setattr(torch, "save", save)
    elif stage == "trainer_state.json":
        original_json = TrainerState.save_to_json

        def save_to_json(self, path):
            if at_step(path):
                raise Killed
            return original_json(self, path)

        monkeypatch.setattr(TrainerState, "save_to_json", save_to_json)
    else:  # every file written, the marker not yet
        original_mark = checkpoints.mark_complete

        def mark_complete(folder, *args, **kwargs):
            if at_step(folder):
                raise Killed
            return original_mark(folder, *args, **kwargs)

        monkeypatch.setattr(checkpoints, "mark_complete", mark_complete)


# --- item 1 and 9: interrupted saves, resume from the newest complete checkpoint ----------------------------------


@pytest.mark.parametrize("stage", ["model.safetensors", "optimizer.pt", "trainer_state.json", "marker"])
def test_interrupted_save_is_skipped_and_resume_matches_uninterrupted(stage, tokenizer, data, tmp_path, monkeypatch,
                                                                      uninterrupted, caplog):
    with monkeypatch.context() as patch:
        kill_at(patch, stage, step=4)
        with pytest.raises(Killed):
            trainer_for(tokenizer, data, tmp_path).train()
    assert (tmp_path / "checkpoint-4").is_dir()  # what a kill leaves behind
    chosen, skipped = checkpoints.scan(tmp_path)
    assert chosen.name == "checkpoint-2" and [p.name for p, _ in skipped] == ["checkpoint-4"]
    # stock transformers would pick the half-written one
    from transformers.trainer_utils import get_last_checkpoint
    assert Path(get_last_checkpoint(str(tmp_path))).name == "checkpoint-4"

    pruning = {k: v for k, v in SAVE.items() if k in checkpoints.PRUNING_FIELDS}
    path, note = checkpoints.resolve_resume(True, PrunedDPOConfig(output_dir=str(tmp_path), bf16=False, **pruning))
    assert Path(path).name == "checkpoint-2" and "skipped incomplete checkpoint-4" in note
    if stage != "optimizer.pt":
        return  # resuming from checkpoint-2 is the same in every case: trained once below
    resumed = trainer_for(tokenizer, data, tmp_path)
    with caplog.at_level("WARNING"):
        resumed.train(resume_from_checkpoint=True)
    assert "checkpoint-2" in caplog.text and "skipped incomplete checkpoint-4" in caplog.text
    final, log = uninterrupted
    assert all(torch.equal(final[k], v) for k, v in weights(resumed.model).items())
    assert resumed.run_state.restored_logging_window
    # item 9: the entries logged after the resume (steps 3 and 6) equal the uninterrupted run's
    assert logged(resumed)[-3:] == log[-3:]
    assert checkpoints.incomplete_reason(tmp_path / "checkpoint-4") is None  # rewritten whole


def test_truncated_file_in_a_marked_checkpoint_is_not_trusted(tokenizer, data, tmp_path):
    trainer_for(tokenizer, data, tmp_path, max_steps=2).train()
    optimizer = tmp_path / "checkpoint-2" / "optimizer.pt"
    os.truncate(optimizer, optimizer.stat().st_size - 1)
    reason = checkpoints.incomplete_reason(tmp_path / "checkpoint-2")
    assert "optimizer.pt" in reason and "truncated" in reason
    with pytest.raises(ResumeError, match=r"checkpoint .*checkpoint-2 is incomplete \(optimizer.pt is"):
        trainer_for(tokenizer, data, tmp_path, max_steps=2).train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))


@pytest.mark.slow
def test_kill_9_while_writing_optimizer_then_cli_resume(tmp_path, offline_cli, caplog):
    """A real SIGKILL in a subprocess while checkpoint-4/optimizer.pt is half written; the CLI resumes from
    checkpoint-2 and names the skipped one (bitwise equality with an uninterrupted run: the in-process test above)."""
    out = tmp_path / "run"
    args = offline_cli.args(out, "--max_steps", "6")
    script = textwrap.dedent(f"""
        import os, signal, sys, torch
        original = torch.save
        def save(obj, f, *a, **k):
            original(obj, f, *a, **k)
            if "checkpoint-4" in str(f) and str(f).endswith("optimizer.pt"):
                os.truncate(f, os.path.getsize(f) // 2)
                os.kill(os.getpid(), signal.SIGKILL)
        torch.save = save
        from trl_pruned_dpo.cli import main
        sys.exit(main({[str(a) for a in args]!r}))
    """)
    killed = subprocess.run([sys.executable, "-c", script], env=offline_cli.env, capture_output=True, text=True,
                            timeout=240, cwd=REPO)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert (out / "checkpoint-4" / "optimizer.pt").is_file() and not (out / "checkpoint-4" / MARKER).exists()
    assert (out / LOCK_NAME).exists()  # the killed run's lock file: stale, taken over by the resume

    with caplog.at_level("WARNING"):
        code, text = offline_cli.main(*args, "--resume_from_checkpoint", "true")
    assert code == 0, text
    assert "checkpoint-2 (skipped incomplete checkpoint-4: no completion marker" in caplog.text
    assert f"resumed from             {out}/checkpoint-2: the training time covers steps 3-6 only" in text
    assert checkpoints.last_complete(out).name == "checkpoint-6" and (out / "model.safetensors").is_file()


# --- items 2 and 3: resume requests --------------------------------------------------------------------------------


def test_cli_resume_true_with_nothing_to_resume_fails_in_one_line(tmp_path, offline_cli):
    out = tmp_path / "none"
    for value in ("true", "auto", "last"):
        code, text = offline_cli.main(*offline_cli.args(out), "--resume_from_checkpoint", value)
        assert code == 2, text
        errors = [line for line in text.splitlines() if "error:" in line]
        assert len(errors) == 1 and "nothing to resume" in errors[0] and "Traceback" not in text
    assert not out.exists()


def test_resume_with_other_pruning_settings_is_refused_unless_overridden(tokenizer, data, tmp_path):
    trainer_for(tokenizer, data, tmp_path, max_steps=2).train()
    changed = trainer_for(tokenizer, data, tmp_path, max_steps=3, prune_seed=7, branch_keep_prob=0.75)
    with pytest.raises(ResumeError, match=r"branch_keep_prob 0.5 -> 0.75, prune_seed 42 -> 7.*"
                                          r"--allow_pruning_change_on_resume true"):
        changed.train(resume_from_checkpoint=True)
    assert changed.state.global_step == 0
    regrouped = trainer_for(tokenizer, data, tmp_path, max_steps=3, group_by_prompt=True)  # another data order
    with pytest.raises(ResumeError, match=r"group_by_prompt False -> True"):
        regrouped.train(resume_from_checkpoint=True)
    allowed = trainer_for(tokenizer, data, tmp_path, max_steps=3, prune_seed=7, allow_pruning_change_on_resume=True)
    allowed.train(resume_from_checkpoint=True)
    assert allowed.state.global_step == 3


# --- item 4: disk full, read-only output -----------------------------------------------------------------------------


def test_disk_full_during_checkpoint_says_so_and_keeps_the_last_good_one(tokenizer, data, tmp_path, monkeypatch):
    original = torch.save

    def full_disk(obj, f, *args, **kwargs):  # what a full disk does to torch.save: a short file, then an error
        if "checkpoint-4" in str(f):
            Path(f).write_bytes(b"PK\3\4" + b"\0" * 64)
            raise RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing "
                               "file data/3: file write failed") from OSError(errno.ENOSPC, "No space left on device")
        return original(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(DiskFullError) as caught:
        trainer_for(tokenizer, data, tmp_path).train()
    message = str(caught.value)
    assert "disk full while writing checkpoint-4" in message and "checkpoint-2" in message and "\n" not in message
    assert not (tmp_path / "checkpoint-4").exists()  # no truncated file left for a later resume
    monkeypatch.setattr(torch, "save", original)
    assert checkpoints.last_complete(tmp_path).name == "checkpoint-2"
    resumed = trainer_for(tokenizer, data, tmp_path)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 6


def _unshare_works() -> bool:
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True)
    return probe.returncode == 0


NEEDS_UNSHARE = pytest.mark.skipif(not _unshare_works(), reason="needs unprivileged user+mount namespaces (tmpfs)")


@pytest.mark.slow
@NEEDS_UNSHARE
def test_real_full_tmpfs(tmp_path, offline_cli):
    """The CLI on a 2.5 MiB tmpfs: checkpoint-2 (1.4 MiB) fits, checkpoint-4 does not."""
    out = tmp_path / "tmpfs"
    out.mkdir()
    args = " ".join(offline_cli.args(out / "run", "--max_steps", "6"))
    shell = f"mount -t tmpfs -o size=2560k tmpfs {out} && exec {sys.executable} -m trl_pruned_dpo {args}"
    result = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", shell],
                            env=offline_cli.env, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "disk full while writing checkpoint-4" in errors[0], result.stderr[-3000:]
    assert "the last complete checkpoint is" in errors[0] and "checkpoint-2" in errors[0]
    assert "Traceback" not in result.stderr


def test_read_only_output_dir_fails_before_any_work(tmp_path, offline_cli, monkeypatch):
    if os.geteuid() != 0:
        locked = tmp_path / "ro"
        locked.mkdir()
        locked.chmod(0o555)
        with pytest.raises(OutputDirError, match="is not writable"):
            check_writable(locked / "out")
    elif _unshare_works():  # root ignores permission bits: a read-only mount
        ro = tmp_path / "ro"
        ro.mkdir()
        code = (f"import sys; sys.path.insert(0, {str(REPO)!r}); from trl_pruned_dpo.safety.output_dir import "
                f"check_writable; check_writable({str(ro / 'out')!r})")
        result = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                                 f"mount -t tmpfs -o ro tmpfs {ro} && exec {sys.executable} -c \"{code}\""],
                                capture_output=True, text=True, timeout=60)
        assert "OutputDirError" in result.stderr and "is not writable" in result.stderr, result.stderr
    # through the CLI: one line, exit 2, before the model is loaded
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    import trl_pruned_dpo.cli as cli_module
    monkeypatch.setattr(cli_module, "resolve_model", lambda *a: pytest.fail("the model was loaded"))
    code, text = offline_cli.main(*offline_cli.args(blocker / "out"))
    assert code == 2 and "cannot be created" in text and "Traceback" not in text


# --- item 5: one run per output folder -------------------------------------------------------------------------------


def test_second_run_on_a_locked_output_dir_fails_and_a_stale_lock_is_taken_over(tmp_path, offline_cli, monkeypatch):
    out = tmp_path / "shared"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from trl_pruned_dpo.safety.output_dir import OutputLock\n"
         f"with OutputLock({str(out)!r}):\n    print('locked', flush=True); time.sleep(120)"],
        cwd=REPO, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        import trl_pruned_dpo.cli as cli_module
        monkeypatch.setattr(cli_module, "resolve_model", lambda *a: pytest.fail("the model was loaded"))
        code, text = offline_cli.main(*offline_cli.args(out))
        assert code == 2, text
        assert f"in use by another trl-pruned-dpo run (pid {holder.pid} on" in text and "Traceback" not in text
        with pytest.raises(OutputDirError):
            OutputLock(out).__enter__()
    finally:
        holder.kill()
        holder.wait()
    assert (out / LOCK_NAME).exists()  # a killed run leaves its lock file behind...
    with OutputLock(out) as lock:  # ...which is stale: taken over, naming the dead owner
        assert f"pid {holder.pid}" in lock.took_over
    assert not (out / LOCK_NAME).exists()


# --- item 6: stopped runs say they stopped ---------------------------------------------------------------------------


@pytest.mark.slow
def test_sigterm_stops_with_checkpoint_and_non_zero_exit(tmp_path, offline_cli):
    out = tmp_path / "stopped"
    args = offline_cli.args(out, "--max_steps", "200", "--logging_steps", "1", "--save_strategy", "no",
                            "--enable_jit_checkpoint", "true")
    run = subprocess.Popen([sys.executable, "-m", "trl_pruned_dpo", *args], env=offline_cli.env, cwd=REPO,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in run.stdout:
        lines.append(line)
        if "'loss'" in line:  # training has started
            run.send_signal(signal.SIGTERM)
            break
    text = "".join(lines) + run.stdout.read()
    assert run.wait(timeout=120) == 128 + signal.SIGTERM, text[-3000:]
    stopped = [line for line in text.splitlines() if line.startswith("stopped at step")]
    assert len(stopped) == 1, text[-3000:]
    step = int(stopped[0].split()[3])
    assert 0 < step < 200
    assert f"of 200 by SIGTERM; checkpoint {out}/checkpoint-{step} saved; resume with `trl-pruned-dpo" in stopped[0]
    assert stopped[0].endswith("--resume_from_checkpoint true`")
    assert checkpoints.incomplete_reason(out / f"checkpoint-{step}") is None
    assert not (out / "model.safetensors").exists()  # no final model that looks finished


# --- item 7: numbers that should alarm -------------------------------------------------------------------------------


def test_pretraining_warnings():
    base = dict(output_dir="unused", bf16=False, report_to="none")
    assert pretraining_warnings(PrunedDPOConfig(**base, branch_keep_prob=0.5, prefix_prune_prob=0.5)) == []
    tiny = PrunedDPOConfig(**base, branch_keep_prob=0.1, position_keep_prob=0.1)
    assert largest_inverse_weight(tiny) == pytest.approx(100)
    assert any("up to 100 (above 20)" in w for w in pretraining_warnings(tiny))
    # q_t of the last token when every response is cut: 1 / (L - ceil(r L) + 1) with L = max_length
    cut_all = PrunedDPOConfig(**base, prefix_prune_prob=1.0, prefix_min_ratio=0.5, max_length=64)
    assert largest_inverse_weight(cut_all) == pytest.approx(33)
    assert largest_inverse_weight(PrunedDPOConfig(**base, position_keep_prob=0.25)) < MAX_INVERSE_WEIGHT
    assert any("beta is 0" in w for w in pretraining_warnings(PrunedDPOConfig(**base, beta=0.0)))


def test_divergence_guard_flags_nan_and_explosions_and_keeps_worst_values():
    # issue 22: a finite threshold is opt-in (`divergence_factor`); by default only non-finite values stop a run
    guard = DivergenceGuard(factor=1e3)
    assert guard.observe(1, 0.69, 1.0) is None
    assert guard.observe(2, 0.70, 0.0) is None
    assert guard.observe(3, 0.71, 2.0) is None
    assert guard.observe(4, 1e6, 6e12).startswith("loss 1e+06 is 1428571x the median of the steps before it (0.7)")
    fresh = DivergenceGuard()
    fresh.observe(1, 0.69, 1.0)
    assert "loss is nan" in fresh.observe(2, math.nan, 1.0)
    assert fresh.observe(3, 1e6, 1.0) is None  # finite: no threshold by default
    assert "gradient norm is inf" in fresh.observe(4, 0.5, math.inf)
    summary = guard.summary()
    assert "largest loss 1e+06 (step 4)" in summary and "largest grad norm 6e+12 (step 4)" in summary
    assert "1 of 4 steps with zero gradient" in summary
    copy = DivergenceGuard()
    copy.load_state_dict(json.loads(json.dumps(guard.state_dict())))
    assert copy.summary() == summary


def test_saturating_loss_with_one_hard_batch_is_not_a_divergence_by_default():
    """The false stop of a finite threshold (docs/cli.md): a DPO loss saturated near 1e-4 meets one ordinary hard
    batch (0.7, 7000x the median). The default guard trains on; `divergence_factor=1e3` stops there, as documented."""
    losses = [1e-4 * (1 + 0.1 * (i % 3)) for i in range(20)] + [0.7]
    default, opted_in = DivergenceGuard(), DivergenceGuard(factor=1e3)
    assert [default.observe(i, loss, 0.1) for i, loss in enumerate(losses)] == [None] * len(losses)
    flagged = [opted_in.observe(i, loss, 0.1) for i, loss in enumerate(losses)]
    assert flagged[:-1] == [None] * (len(losses) - 1) and "x the median of the steps before it" in flagged[-1]
    with pytest.raises(ValueError, match="divergence_factor"):
        PrunedDPOConfig(output_dir="unused", bf16=False, divergence_factor=0.5)


def test_guard_default_follows_pruning(tokenizer, data, tmp_path, monkeypatch):
    """Unset `stop_on_divergence`: on with the plugin's forward (the defaults run it: the exact savings are on), off
    with every pruning and exact saving off (stock trains on through a NaN loss:
    test_parity.py::test_nan_loss_trains_on_as_stock); explicit values win either way."""
    from trl_pruned_dpo.safety.guards import stops_on_divergence

    base = dict(output_dir="unused", bf16=False)
    assert stops_on_divergence(PrunedDPOConfig(**base, position_keep_prob=0.5))
    assert not stops_on_divergence(PrunedDPOConfig(**base, **SAVINGS_OFF))
    assert stops_on_divergence(PrunedDPOConfig(**base))  # the defaults: share_prompt and padding_free on
    assert stops_on_divergence(PrunedDPOConfig(**base, stop_on_divergence=True))
    assert not stops_on_divergence(PrunedDPOConfig(**base, position_keep_prob=0.5, stop_on_divergence=False))
    original = PrunedDPOTrainer.compute_loss

    def poisoned(self, *args, **kwargs):
        loss = original(self, *args, **kwargs)
        return loss * math.nan if self.state.global_step == 1 else loss

    monkeypatch.setattr(PrunedDPOTrainer, "compute_loss", poisoned)
    off = trainer_for(tokenizer, data, tmp_path / "off", max_steps=3, save_strategy="no", branch_keep_prob=1.0,
                      prefix_prune_prob=0.0, **SAVINGS_OFF)
    off.train()
    assert off.state.global_step == 3 and off.run_state.divergence_guard.steps == 0  # nothing read, nothing stopped
    asked = trainer_for(tokenizer, data, tmp_path / "asked", max_steps=3, save_strategy="no", branch_keep_prob=1.0,
                        prefix_prune_prob=0.0, stop_on_divergence=True, **SAVINGS_OFF)
    with pytest.raises(TrainingDiverged, match="diverged at step 2: loss is nan"):
        asked.train()


def test_guard_reads_the_step_gradient_norm(tokenizer, data, tmp_path):
    """Pins transformers' positional `_maybe_log_save_evaluate(tr_loss, grad_norm, ...)` (seam.py): a finite loss with
    a NaN gradient at step 2 must stop the run naming the gradient norm, which the trainer reads from that argument."""
    trainer = trainer_for(tokenizer, data, tmp_path, max_steps=4, save_strategy="no")
    weight = trainer.model.get_input_embeddings().weight
    weight.register_hook(lambda grad: grad * math.nan if trainer.state.global_step == 1 else grad)
    with pytest.raises(TrainingDiverged, match=r"diverged at step 2: gradient norm is nan"):
        trainer.train()


def test_nan_loss_stops_without_checkpointing_it(tokenizer, data, tmp_path, monkeypatch):
    trainer = trainer_for(tokenizer, data, tmp_path, save_steps=1)
    original = PrunedDPOTrainer.compute_loss

    def poisoned(self, *args, **kwargs):
        loss = original(self, *args, **kwargs)
        return loss * math.nan if self.state.global_step == 3 else loss

    monkeypatch.setattr(PrunedDPOTrainer, "compute_loss", poisoned)
    with pytest.raises(TrainingDiverged, match=r"diverged at step 4: loss is nan.*resume from the last "
                                               r"complete checkpoint, .*checkpoint-3;"):
        trainer.train()
    assert not (tmp_path / "checkpoint-4").exists()
    # opting out trains on, and reads nothing from the device for it (issue 22: no worst values without the guard)
    monkeypatch.setattr(PrunedDPOTrainer, "compute_loss", poisoned)
    optout = trainer_for(tokenizer, data, tmp_path / "optout", max_steps=4, stop_on_divergence=False)
    optout.train()
    assert optout.state.global_step == 4 and optout.run_state.divergence_guard.steps == 0


def test_warns_before_training_on_alarming_settings(tokenizer, data, tmp_path):
    trainer = trainer_for(tokenizer, data, tmp_path, max_steps=1, save_strategy="no", position_keep_prob=0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    bound = largest_inverse_weight(trainer.args)
    assert bound > 100
    assert sum(f"inverse-probability weights up to {bound:.0f}" in str(w.message) for w in caught) == 1


# --- item 8: every row truncated away --------------------------------------------------------------------------------


def test_every_row_dropped_by_truncation_is_said(tokenizer, data, tmp_path):
    # refused when the trainer is built, before any work (data_checks.py), as an input error the CLI prints in one line
    with pytest.raises(EmptyTrainingSet, match=r"Every one of the \d+ training pairs was dropped because its prompt "
                                               r"alone fills `max_length` \(5\) tokens"):
        trainer_for(tokenizer, data, tmp_path, max_length=5)


# --- issue 22: one writer per marker, unique temporary names; stock checkpoints -------------------------------------


def _write_markers(path, count):
    for i in range(count):
        disk_writes.write_json_atomic(Path(path), {"writer": os.getpid(), "i": i})


def test_marker_writers_on_a_shared_folder_never_collide(tmp_path):
    """Two processes (two nodes' writers with `save_on_each_node` on a shared filesystem) writing the same marker:
    each through its own temporary name, renamed atomically; the marker is always whole, nothing is left behind."""
    import multiprocessing

    target = tmp_path / MARKER
    context = multiprocessing.get_context("fork")
    writers = [context.Process(target=_write_markers, args=(str(target), 200)) for _ in range(2)]
    for w in writers:
        w.start()
    for w in writers:
        w.join(60)
    assert [w.exitcode for w in writers] == [0, 0]
    assert json.loads(target.read_text())["i"] == 199
    assert [p.name for p in tmp_path.iterdir()] == [MARKER]


def test_a_stock_checkpoint_is_complete_and_an_interrupted_plugin_save_is_not(tmp_path):
    stock = tmp_path / "checkpoint-1"
    stock.mkdir()
    (stock / "trainer_state.json").write_text("{}")
    (stock / "model.safetensors").write_bytes(b"0")
    assert checkpoints.is_foreign(stock) and checkpoints.incomplete_reason(stock) is None
    path, note = checkpoints.resolve_resume(True, PrunedDPOConfig(output_dir=str(tmp_path), bf16=False))
    assert Path(path) == stock and "no trl-pruned-dpo completion marker" in note and "\n" not in note
    plugin = tmp_path / "checkpoint-2"
    checkpoints.unmark(plugin)  # what a plugin save writes first
    (plugin / "trainer_state.json").write_text("{}")  # every stock file written, the marker not yet
    assert not checkpoints.is_foreign(plugin)
    assert checkpoints.incomplete_reason(plugin).startswith("no completion marker")
    assert checkpoints.last_complete(tmp_path) == stock
