"""The command line and the offline demo.

- the real console script trains on configs/demo.yaml for a few steps, saves a loadable model, prints the summary;
- relaunching through `accelerate launch` (any accelerate flag) and `trl dpo` with the opt-in hook both train;
- YAML keys and flags reach the dataclasses, accelerate keys become launch arguments;
- each bad input gives one error line naming the problem and the fix, exit code 2, and no output folder;
- the demo API: deterministic data whose `is_correct` separates chosen from rejected, a cached builtin model.

Subprocesses pay ~6 s of imports each; the file stays around a minute of CPU.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from trl_pruned_dpo import cli
from trl_pruned_dpo.demo import build_tokenizer, is_correct, make_dataset, resolve_model, solve
from trl_pruned_dpo.demo.tasks import TASKS, load_builtin
from trl_pruned_dpo.forward_choice import ForwardChoice
from trl_pruned_dpo.safety.run_state import RunState

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "configs" / "demo.yaml"
SCRIPT = Path(sys.executable).with_name("trl-pruned-dpo")
# The plumbing tests start from the random-init model: builtin:tiny-demo-sft (the demo's default) costs a one-time
# SFT, tested on its own below with a shortened recipe.
TINY = ["--model_name_or_path", "builtin:tiny-demo"]
QUICK = ["--max_steps", "3", "--logging_steps", "1", "--per_device_eval_batch_size", "64", *TINY]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("demo-cache")


@pytest.fixture()
def offline(monkeypatch, cache):
    """Offline, with the demo cache in a temp folder; undoes what the CLI sets process-wide (offline mode)."""
    import datasets.config
    from huggingface_hub import constants

    monkeypatch.setenv("TRL_PRUNED_DPO_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


def env(cache, **extra):
    # One intra-op thread: a 0.1 M-parameter model gains nothing from more, and loses a lot on a busy machine.
    return {**os.environ, "TRL_PRUNED_DPO_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1",
            **extra}


def run(command, cache, timeout=240, **extra):
    return subprocess.run(command, env=env(cache, **extra), capture_output=True, text=True, timeout=timeout,
                          cwd=REPO)


def error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if "error:" in line]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def assert_saved_model(folder: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (folder / name).is_file(), sorted(p.name for p in folder.iterdir())
    AutoModelForCausalLM.from_pretrained(folder)
    assert AutoTokenizer.from_pretrained(folder)("sort: 2 1 =")["input_ids"][0] == build_tokenizer().bos_token_id


# --- end to end ---------------------------------------------------------------------------------------------------


def test_console_script_trains_the_demo(tmp_path, cache):
    assert SCRIPT.is_file(), f"console script missing at {SCRIPT}: run `pip install -e . --no-deps`"
    out = tmp_path / "demo-out"
    # Behind a shell that sleeps 3 s first, then execs the program in the same process: the summary's time is the
    # program's own, not the shell's (it once said 21.8 s for a 7 s run).
    command = " ".join(["sleep 3 && exec", str(SCRIPT), "--config", str(DEMO), *QUICK, "--output_dir", str(out)])
    started = time.perf_counter()
    result = run(["bash", "-c", command], cache)
    elapsed = time.perf_counter() - started
    assert result.returncode == 0, result.stderr[-3000:]
    assert_saved_model(out)
    summary = result.stdout[result.stdout.index("trl-pruned-dpo summary"):]
    timing = next(line for line in summary.splitlines() if "s in all" in line)
    training, total = (float(x) for x in re.findall(r"([0-9.]+) s", timing)[:2])
    assert training <= total <= elapsed - 3.0, (timing, elapsed)
    noise = [line for line in result.stderr.splitlines() if any(
        text in line for text in ("gemm_4bit", "quantization-bitsandbytes", "is deprecated", "pin_memory"))]
    assert not noise, noise  # other libraries' notices that are not the user's business
    assert "Writing model shards" not in result.stderr.split("Tokenizing train dataset")[0]  # the builtin build's
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir() if p.is_file()}
    assert modes["model.safetensors"] == modes["config.json"], modes  # safetensors writes 0600; given the umask's
    assert "steps                    3 (" in summary
    assert "held-out reward acc." in summary
    for label in ("tokens executed", "positions scored", "branches backpropagated"):
        line = next(line for line in summary.splitlines() if label in line)
        assert "%" in line or "n/a" in line, line
    assert "'prune/branches_backpropagated'" in result.stdout or "prune/branches_backpropagated" in result.stderr


def test_accelerate_flag_relaunches_through_accelerate(tmp_path, cache):
    out = tmp_path / "launched"
    result = run([sys.executable, "-m", "trl_pruned_dpo", "--config", str(DEMO), "--max_steps", "1", *TINY,
                  "--eval_strategy", "no", "--output_dir", str(out), "--num_processes", "1", "--cpu"], cache)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (out / "model.safetensors").is_file()
    assert "trl-pruned-dpo summary" in result.stdout


def test_trl_dpo_uses_pruned_trainer_with_the_opt_in_hook(tmp_path, cache):
    from trl_pruned_dpo import trl_hook

    site_dir, startup = tmp_path / "site", tmp_path / "startup"
    assert trl_hook.main(["install", "--site-dir", str(site_dir)]) == 0
    # Stand-in for site-packages: every Python started by the test (the `trl` CLI and its accelerate child) adds
    # `site_dir` as a site directory, so the installed .pth line runs exactly as it would from site-packages.
    startup.mkdir()
    (startup / "sitecustomize.py").write_text(f"import site\nsite.addsitedir({str(site_dir)!r})\n")
    startup = os.pathsep.join(filter(None, [str(startup), os.environ.get("PYTHONPATH")]))  # the package under test
    probe = "import sys, trl; print(trl.DPOTrainer.__name__, 'trl_pruned_dpo' in sys.modules)"
    inert = run([sys.executable, "-c", probe], cache, PYTHONPATH=startup)
    assert inert.stdout.split() == ["DPOTrainer", "False"], inert.stderr[-2000:]
    status = run([sys.executable, "-m", "trl_pruned_dpo.trl_hook", "status", "--site-dir", str(site_dir)], cache,
                 PYTHONPATH=startup, TRL_PRUNED_DPO="1")
    assert "trl dpo uses PrunedDPOTrainer" in status.stdout, status.stderr[-2000:]
    assert "Warning" not in status.stderr, status.stderr[-2000:]  # no runpy warning about sys.modules

    # The demo's `builtin:` names, as in configs/demo.yaml: the hook resolves them to local folders.
    config = yaml.safe_load(DEMO.read_text())
    config.update(model_name_or_path="builtin:tiny-demo", dataset_name="builtin:mix", max_steps=2,
                  logging_steps=1, eval_strategy="no", disable_tqdm=True, output_dir=str(tmp_path / "trl-out"))
    (tmp_path / "trl.yaml").write_text(yaml.safe_dump(config))
    trl = Path(sys.executable).with_name("trl")
    result = run([str(trl), "dpo", "--config", str(tmp_path / "trl.yaml")], cache, timeout=600, PYTHONPATH=startup,
                 TRL_PRUNED_DPO="1")  # two processes (trl, then its accelerate child): minutes on a busy machine
    assert result.returncode == 0, result.stderr[-3000:]
    assert "prune/branches_backpropagated" in result.stdout  # only PrunedDPOTrainer logs it
    assert (tmp_path / "trl-out" / "model.safetensors").is_file()
    noise = [line for line in result.stderr.splitlines() if any(  # as quiet as the CLI (trl_pruned_dpo/notices.py)
        text in line for text in ("gemm_4bit", "quantization-bitsandbytes", "is deprecated", "pin_memory"))]
    assert not noise, noise


def test_the_hook_resolves_builtin_names_or_stops_in_one_line(capsys, offline):
    """What `trl dpo` parses under the hook: a `builtin:` dataset becomes a cached folder of JSON-lines splits that
    `datasets` loads offline; an unknown name ends the process with one line and exit code 2."""
    import trl
    from datasets import load_dataset

    from trl_pruned_dpo.demo.export import export_builtin
    from trl_pruned_dpo.trl_hook_startup import _resolving_builtin

    arguments = _resolving_builtin(trl.ScriptArguments, "dataset_name", export_builtin)
    assert arguments.__name__ == "ScriptArguments" and issubclass(arguments, trl.ScriptArguments)
    folder = arguments(dataset_name="builtin:sort-short").dataset_name
    assert arguments(dataset_name="builtin:sort-short").dataset_name == folder  # cached, not rewritten
    loaded = load_dataset(folder)
    assert loaded["test"].num_rows == 969 and loaded["train"][0] == load_builtin("builtin:sort-short")["train"][0]
    assert arguments(dataset_name="trl-lib/ultrafeedback_binarized").dataset_name == "trl-lib/ultrafeedback_binarized"
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        arguments(dataset_name="builtin:nope")
    err = capsys.readouterr().err.strip()
    assert stopped.value.code == 2 and len(err.splitlines()) == 1 and "builtin:sort-short" in err, err


def test_building_a_builtin_model_draws_no_library_bars(capfd, monkeypatch, tmp_path):
    """Stock `trl dpo` shows TRL's bars (tokenizing, loading, training); the plugin adds none of its own."""
    from trl_pruned_dpo.cli.data import resolve_model as cli_resolve_model

    monkeypatch.setenv("TRL_PRUNED_DPO_CACHE", str(tmp_path))
    capfd.readouterr()
    folder = Path(cli_resolve_model("builtin:tiny-demo"))
    err = capfd.readouterr().err
    assert (folder / "model.safetensors").is_file() and "it/s" not in err and "Writing" not in err, err


def test_saved_files_get_the_mode_of_their_siblings(tmp_path):
    """safetensors >= 0.8 writes weights 0600 through a temporary file; a checkpoint's files, its marker and the
    final model (cli) get what the umask gives every other file."""
    from transformers import AutoModelForCausalLM

    from trl_pruned_dpo.safety.disk_writes import default_mode, give_default_modes, write_json_atomic

    AutoModelForCausalLM.from_pretrained(resolve_model("builtin:tiny-demo")).save_pretrained(tmp_path / "m")
    kept = tmp_path / "m" / "private.txt"
    kept.write_text("")
    kept.chmod(0o640)  # a mode set on purpose is kept
    give_default_modes(tmp_path / "m")
    assert (tmp_path / "m" / "model.safetensors").stat().st_mode & 0o777 == default_mode()
    assert kept.stat().st_mode & 0o777 == 0o640
    write_json_atomic(tmp_path / "marker.json", {"a": 1})
    assert (tmp_path / "marker.json").stat().st_mode & 0o777 == default_mode()


# --- parsing --------------------------------------------------------------------------------------------------------


def test_yaml_keys_and_flags_reach_the_config(tmp_path):
    config = {
        "model_name_or_path": "builtin:tiny-demo", "dataset_name": "builtin:sort", "output_dir": str(tmp_path / "o"),
        "bf16": False, "beta": 0.25, "loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5],
        "branch_keep_prob": 0.5, "branch_sampling": "independent", "prefix_prune_prob": 0.3,
        "prefix_min_ratio": 0.6, "position_keep_prob": 0.8, "prune_reference": False, "prune_seed": 7,
        "lora_r": 4, "dataset_train_split": "train", "num_processes": 2,
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    script, training, model, _, launch_args, _ = cli.parse(
        ["--config", str(tmp_path / "c.yaml"), "--beta", "0.5", "--mixed_precision", "no"])
    assert (training.beta, training.loss_type, training.loss_weights) == (0.5, ["sigmoid", "sft"], [1.0, 0.5])
    assert (training.branch_keep_prob, training.branch_sampling, training.prefix_prune_prob) == (0.5, "independent",
                                                                                                  0.3)
    assert (training.prefix_min_ratio, training.position_keep_prob, training.prune_reference) == (0.6, 0.8, False)
    assert training.prune_seed == 7 and training.bf16 is False
    assert (model.model_name_or_path, model.lora_r, script.dataset_name) == ("builtin:tiny-demo", 4, "builtin:sort")
    assert launch_args == ["--num_processes", "2", "--mixed_precision", "no"]

    # Valid only under a launcher (gloo wants a process group): left to the launched processes to check.
    *parsed, launch_args, _ = cli.parse(["--config", str(DEMO), "--ddp_backend", "gloo", "--num_processes", "2"])
    assert parsed == [None] * 4 and launch_args == ["--num_processes", "2"]

    *_, launch_args, _ = cli.parse(["--config", str(DEMO), "--accelerate_config",
                                    str(REPO / "configs" / "accelerate" / "zero2.yaml")])
    assert launch_args == ["--config_file", str(REPO / "configs" / "accelerate" / "zero2.yaml")]


@pytest.mark.parametrize("recipe", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_recipe_parses(recipe):
    _, training, model, *_ = cli.parse(["--config", str(recipe), "--bf16", "false"])  # bf16 needs a GPU
    assert model.model_name_or_path and training.output_dir


@pytest.mark.parametrize("recipe", sorted((REPO / "configs" / "accelerate").glob("*.yaml")), ids=lambda p: p.name)
def test_accelerate_configs_load(recipe):
    from accelerate.commands.config.config_args import load_config_from_file

    assert load_config_from_file(str(recipe)).num_processes >= 1


def test_summary_one_short_line_per_fact_and_no_unexplained_na():
    from types import SimpleNamespace

    args = SimpleNamespace(per_device_train_batch_size=8, gradient_accumulation_steps=2, world_size=1,
                           position_keep_prob=1.0, prefix_prune_prob=0.5, prefix_min_ratio=0.5, branch_keep_prob=0.5,
                           branch_sampling="paired", prune_common_prefix=False, share_prompt=False, output_dir="out")
    logs = [{"loss": 0.7, "rewards/accuracies": 0.5, "prune/tokens_executed": 0.8, "step": 5},
            {"loss": 0.6, "rewards/accuracies": 0.75, "prune/tokens_executed": 0.6, "step": 10},
            {"eval_rewards/accuracies": 0.625, "step": 10}, {"train_runtime": 3.0, "train_loss": 0.65, "step": 10}]
    trainer = SimpleNamespace(args=args, state=SimpleNamespace(global_step=10, log_history=logs), run_state=RunState(),
                              forward_choice=ForwardChoice(pruned=True), auto_keep_probs=None)
    text = cli.summarize(trainer, "builtin:tiny-demo", "/cache/x", 9.0)
    assert "pruning                  prefix_prune_prob 0.5 (min ratio 0.5), branch_keep_prob 0.5 (paired)" in text
    assert "steps                    10 (160 pairs), 3.0 s of training, 9.0 s in all" in text
    assert "last training loss       0.600 (step 10)" in text and "training reward acc.     0.750" in text
    assert "held-out reward acc.     0.625" in text
    assert "tokens executed          70.0% of stock's padded batch" in text and "branches backpropagated" not in text
    assert "n/a" not in text and all(len(line) <= 120 for line in text.splitlines() if "->" not in line)
    stock = [{k: v for k, v in e.items() if not k.startswith("prune/")} for e in logs]
    trainer.state.log_history = stock[-1:]  # fewer steps than logging_steps: only the closing entry
    text = cli.summarize(trainer, "builtin:tiny-demo", "/cache/x", 9.0)
    assert "last training loss       0.650" in text and "n/a" not in text and "tokens executed" not in text
    assert "auto chose" not in text
    # With "auto": the verdict of its last choice in the summary, the whole reason on the line above it.
    reason = "keep everything (none saves 5% within +5% steps): B_simple <= 95.8 vs 8 pairs per step; " + "x" * 300
    trainer.auto_keep_probs = SimpleNamespace(history=[{"step": 180, "branch_keep_prob": 1.0, "position_keep_prob": 1.0,
                                                    "reason": reason}])
    text = cli.summarize(trainer, "builtin:tiny-demo", "/cache/x", 9.0)
    assert text.splitlines()[0] == f"auto at step 180: {reason}"
    assert ("  auto chose               branch 1, position 1 at step 180: keep everything (none saves 5% within +5% "
            "steps)") in text.splitlines()
    args.branch_keep_prob = args.position_keep_prob = 1.0
    args.prefix_prune_prob = 0.0
    text = cli.summarize(trainer, "builtin:tiny-demo", "/cache/x", 9.0)
    assert "pruning                  none" in text
    assert "exact savings            off (share_prompt and padding_free false): padded rows, as stock" in text
    # the exact savings (on by default): said, with how to turn them off; or that the model ran padded rows instead
    args.share_prompt = args.padding_free = True
    trainer.forward_choice = ForwardChoice(pruned=True, packed=True, share_prompt=True)
    text = cli.summarize(trainer, "builtin:tiny-demo", "/cache/x", 9.0)
    assert ("  exact savings            share_prompt, padding_free (exact; off: --share_prompt false --padding_free "
            "false)") in text.splitlines()
    assert all(len(line) <= 120 for line in text.splitlines() if "->" not in line and "auto at" not in line)
    trainer.forward_choice = ForwardChoice(pruned=True, why="its attention cannot run packed")
    text = cli.summarize(trainer, "builtin:tiny-demo", "/cache/x", 9.0)
    assert "exact savings            share_prompt, padding_free ignored for this model: padded rows ran" in text


def test_help_shows_the_plugin_options_first():
    text = cli.parse.__globals__["make_parser"]().format_help()
    assert "--compare" in text.split("\n\n")[0]  # the usage line names it
    assert text.index("--branch_keep_prob") < text.index("--share_prompt") < text.index("--dataset_name")
    assert text.index("--dataset_name") > len(text) // 20  # TRL's ~800 lines follow the plugin's


def test_demo_prepare_defaults_to_the_demo_and_every_flag_has_help():
    from trl_pruned_dpo.demo.__main__ import make_parser

    parser = make_parser()
    defaults = parser.parse_args(["prepare"])
    demo = yaml.safe_load(DEMO.read_text())
    assert (defaults.model, defaults.dataset) == (demo["model_name_or_path"], demo["dataset_name"])
    assert all(action.help for action in parser._actions)


# --- bad input: one line, exit 2, no output folder -----------------------------------------------------------------


def bad_run(capsys, tmp_path, *argv, config=None):
    out = tmp_path / "out"
    if config is not None:
        base = yaml.safe_load(DEMO.read_text())
        base.update(output_dir=str(out), model_name_or_path="builtin:tiny-demo", **config)
        (tmp_path / "bad.yaml").write_text(yaml.safe_dump(base))
        argv = ("--config", str(tmp_path / "bad.yaml"), *argv)
    code = cli.main(list(argv))
    line = error_line(capsys.readouterr().err)
    assert code == 2 and not out.exists(), line
    return line


def test_save_steps_on_the_command_line_turns_saving_on(capsys, tmp_path, offline):
    """configs/demo.yaml says `save_strategy: "no"`; `--save_steps 20` on top of it saves every 20 steps, and says so
    in one line before training (a kill would otherwise lose every step: TRL ignores save_steps under "no")."""
    config = yaml.safe_load(DEMO.read_text())
    assert config["save_strategy"] == "no"
    *parsed, _, _ = cli.parse(["--config", str(DEMO), "--save_steps", "20", "--output_dir", str(tmp_path / "o")])
    notes = capsys.readouterr().err.strip().splitlines()
    assert parsed[1].save_strategy == "steps" and parsed[1].save_steps == 20
    assert len(notes) == 1 and "save_strategy set to \"steps\"" in notes[0], notes
    *parsed, _, _ = cli.parse(["--config", str(DEMO), "--output_dir", str(tmp_path / "o")])
    assert parsed[1].save_strategy == "no" and capsys.readouterr().err == ""  # no save_steps: nothing changes


def test_save_steps_that_save_strategy_no_would_ignore(capsys, tmp_path, offline):
    line = bad_run(capsys, tmp_path, "--save_strategy", "no", "--save_steps", "20", config={})
    assert "save_steps 20 has no effect with --save_strategy no" in line
    line = bad_run(capsys, tmp_path, config={"save_strategy": "no", "save_steps": 20})
    assert "save_steps 20 has no effect with the config file's save_strategy" in line


def test_missing_config_file(capsys, tmp_path):
    line = bad_run(capsys, tmp_path, "--config", str(tmp_path / "nope.yaml"))
    assert "nope.yaml" in line and "not found" in line


def test_unknown_yaml_key(capsys, tmp_path, offline):
    line = bad_run(capsys, tmp_path, config={"brnch_keep_prob": 0.5})
    assert "`brnch_keep_prob`" in line and "did you mean `branch_keep_prob`" in line


def test_unknown_flag(capsys, tmp_path, offline):
    line = bad_run(capsys, tmp_path, "--no_such_flag", "1", config={})
    assert "`--no_such_flag`" in line


@pytest.mark.parametrize("key, value", [("branch_keep_prob", 1.5), ("position_keep_prob", 0.0),
                                        ("prefix_prune_prob", -0.1)])
def test_invalid_probability(capsys, tmp_path, offline, key, value):
    line = bad_run(capsys, tmp_path, config={key: value})
    assert f"`{key}` must lie in" in line


def test_bf16_on_cpu_names_the_default(capsys, tmp_path, offline):
    from transformers.utils import is_torch_bf16_gpu_available

    if is_torch_bf16_gpu_available():
        pytest.skip("bf16 is available here")
    line = bad_run(capsys, tmp_path, config={"bf16": True})
    assert "--bf16 false" in line


def test_missing_dataset_column(capsys, tmp_path, offline):
    data = tmp_path / "data"
    data.mkdir()
    rows = [{"prompt": "sort: 2 1 =", "chosen": " 1 2"}] * 4
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    line = bad_run(capsys, tmp_path, config={"dataset_name": str(data), "eval_strategy": "no"})
    assert "['rejected']" in line and "rename" in line


def test_missing_split(capsys, tmp_path, offline):
    line = bad_run(capsys, tmp_path, "--dataset_test_split", "validation", config={})
    assert "'validation'" in line and "dataset_test_split" in line


def test_unreachable_model_without_network(tmp_path, cache):
    """No HF_HUB_OFFLINE here: the CLI finds the Hub unreachable itself (or, with network, that the id is wrong)."""
    out = tmp_path / "out"
    environment = {k: v for k, v in env(cache).items() if k != "HF_HUB_OFFLINE"}
    result = subprocess.run(
        [sys.executable, "-m", "trl_pruned_dpo", "--config", str(DEMO), "--output_dir", str(out),
         "--model_name_or_path", "no-such-org/no-such-model"],
        env=environment, capture_output=True, text=True, timeout=120, cwd=REPO)
    line = error_line(result.stderr)
    assert result.returncode == 2 and "'no-such-org/no-such-model'" in line and not out.exists(), line


def test_wrong_yaml_value_type_is_one_line(capsys, tmp_path, offline):
    line = bad_run(capsys, tmp_path, config={"per_device_train_batch_size": 2.5})
    assert "`per_device_train_batch_size` must be an integer, got 2.5" in line
    line = bad_run(capsys, tmp_path, config={"learning_rate": "abc"})  # argparse's own error, without the usage
    assert "--learning_rate" in line and "'abc'" in line


@pytest.mark.parametrize("where", ["under_a_file", "proc"])
def test_output_dir_that_cannot_be_written(capsys, tmp_path, offline, where):
    (tmp_path / "a_file").write_text("")
    out = tmp_path / "a_file" / "out" if where == "under_a_file" else Path("/proc/trl-pruned-dpo-test/out")
    line = bad_run(capsys, tmp_path, "--output_dir", str(out), config={})
    assert "output_dir" in line and "cannot be" in line


def test_local_data_file_loads_offline(capsys, tmp_path, offline):
    """A .jsonl file is read as the train split (no Hub lookup); here its missing test split is the error."""
    rows = make_dataset("sort", 4, seed=0).to_list()
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    line = bad_run(capsys, tmp_path, config={"dataset_name": str(tmp_path / "pairs.jsonl")})
    assert "has no split 'test' (it has ['train'])" in line and "Hub" not in line


def test_failed_run_removes_only_the_folder_it_created(tmp_path):
    created, existing, checkpointed = tmp_path / "new", tmp_path / "old", tmp_path / "ckpt"
    existing.mkdir()
    for folder in (created, existing, checkpointed):
        with pytest.raises(RuntimeError), cli._OutputGuard(str(folder)):
            folder.mkdir(exist_ok=True)
            (folder / "config.json").write_text("{}")
            if folder is checkpointed:
                (folder / "checkpoint-5").mkdir()
            raise RuntimeError
    assert not created.exists() and existing.exists() and checkpointed.exists()


# --- the demo API ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("task", TASKS + ("mix",))
def test_tasks_have_a_ground_truth(task):
    data = make_dataset(task, 60, seed=3)
    assert data.column_names == ["prompt", "chosen", "rejected"]
    assert data.to_list() == make_dataset(task, 60, seed=3).to_list() != make_dataset(task, 60, seed=4).to_list()
    for row in data:
        assert is_correct(task, row["prompt"], row["chosen"] + "<eos>")
        assert not is_correct(None, row["prompt"], row["rejected"])
        assert solve(row["prompt"]) == row["chosen"] and row["chosen"] != row["rejected"]
    lengths = [len(r) for r in data["chosen"]]
    assert min(lengths) < 20 and max(lengths) > 40


def test_builtin_splits_do_not_overlap():
    splits = load_builtin("builtin:mix")
    assert len(splits["train"]) == 4096 and 200 < len(splits["test"]) <= 256
    assert not set(splits["train"]["prompt"]) & set(splits["test"]["prompt"])


def test_tokenizer_is_character_level():
    tokenizer = build_tokenizer()
    text = "add: 48+97 = 8+7+0=15 => 145"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and len(ids) == len(text) + 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer(text + tokenizer.eos_token)["input_ids"][-1] == tokenizer.eos_token_id


def test_builtin_model_is_a_cached_deterministic_folder(monkeypatch, tmp_path):
    import torch

    from trl_pruned_dpo.demo import build_model

    monkeypatch.setenv("TRL_PRUNED_DPO_CACHE", str(tmp_path))
    state = torch.random.get_rng_state()
    path = Path(resolve_model("builtin:tiny-demo"))
    assert torch.equal(state, torch.random.get_rng_state())  # seeding the init left the global RNG alone
    assert path.parent == tmp_path / "models" and resolve_model("builtin:tiny-demo") == str(path)
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temp folder left
    first, second = build_model("tiny-demo", seed=0), build_model("tiny-demo", seed=0)
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))
    with pytest.raises(ValueError, match="builtin:tiny-demo"):
        resolve_model("builtin:nope")
    assert resolve_model("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    shutil.rmtree(path)


def test_warm_started_builtin_model_is_built_once_and_cached(monkeypatch, tmp_path):
    """builtin:tiny-demo-sft: the seeded init after the SFT recipe (shortened here), cached, global RNG untouched."""
    import torch
    from transformers import AutoModelForCausalLM

    from trl_pruned_dpo.demo import build_model, model as builtin
    from trl_pruned_dpo.demo.sft import SFTRecipe, sft_examples

    monkeypatch.setenv("TRL_PRUNED_DPO_CACHE", str(tmp_path))
    monkeypatch.setitem(builtin.SFT_MODELS, "tiny-demo-sft", SFTRecipe(steps=30, batch_size=8, n_examples=256))
    state = torch.random.get_rng_state()
    path = resolve_model("builtin:tiny-demo-sft")
    assert torch.equal(state, torch.random.get_rng_state())
    assert resolve_model("builtin:tiny-demo-sft") == path and "tiny-demo-sft" in Path(path).name
    tuned, init = AutoModelForCausalLM.from_pretrained(path), build_model("tiny-demo", seed=0)
    moved = [not torch.equal(a, b) for a, b in zip(tuned.state_dict().values(), init.state_dict().values())]
    assert all(moved)  # every tensor trained
    rows = load_builtin("builtin:sort-short")
    sft_prompts = {r["prompt"] for r in sft_examples(builtin.SFT_MODELS["tiny-demo-sft"], 0)}
    assert not sft_prompts & (set(rows["train"]["prompt"]) | set(rows["test"]["prompt"]))
