"""Degenerate and truncated training pairs are reported once, with numbers; datasets that cannot train are refused.
Only when the plugin's forward is used (every pruning and exact saving off is stock, which says nothing), vectorised
(checked against a naive per-row loop), once, on the main process.

Each case builds the trainer only (no training step): a few seconds in all.
"""

import warnings

import pytest
from datasets import Dataset

from conftest import SAVINGS_OFF, build_trainer, preference_rows
from trl_pruned_dpo import PrunedDPOConfig, PrunedDPOTrainer
from trl_pruned_dpo.errors import EmptyTrainingSet
from trl_pruned_dpo.safety import data_checks

PRUNED = {"position_keep_prob": 0.5}  # the checks run with the pruned forward only


def build(tokenizer, rows, tmp_path, **overrides):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, Dataset.from_list(rows), tmp_path,
                      **{**PRUNED, **overrides})
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning) and "training pairs" in str(w.message)]


def test_clean_pairs_raise_no_warning(tokenizer, tmp_path):
    assert build(tokenizer, preference_rows(8), tmp_path) == []


def test_degenerate_pairs_are_counted_with_an_example_index(tokenizer, tmp_path):
    rows = preference_rows(8)
    rows[2] = {**rows[2], "rejected": rows[2]["chosen"]}  # identical
    rows[4] = {**rows[4], "chosen": "", "rejected": ""}  # both empty: identical too
    rows[5] = {**rows[5], "chosen": ""}  # one empty response: the EOS still carries a signal
    messages = build(tokenizer, rows, tmp_path)
    assert len(messages) == 2, messages
    assert "2 of 8 training pairs (25.0%) are degenerate" in messages[0] and "row 2:" in messages[0], messages
    assert "1 of 8 training pairs (12.5%) have an empty response" in messages[1] and "row 5" in messages[1]


def test_all_degenerate_is_refused(tokenizer, tmp_path):
    rows = [{**row, "rejected": row["chosen"]} for row in preference_rows(4)]
    with pytest.raises(ValueError, match="Every training pair is degenerate"):
        build(tokenizer, rows, tmp_path)


def test_truncation_is_reported_with_its_share(tokenizer, tmp_path):
    rows = preference_rows(8)
    # Tokens of prompt + the longer response, plus the EOS TRL appends.
    lengths = [max(len(tokenizer(r["prompt"] + r[k])["input_ids"]) for k in ("chosen", "rejected")) + 1 for r in rows]
    assert build(tokenizer, rows, tmp_path, max_length=max(lengths)) == []
    messages = build(tokenizer, rows, tmp_path, max_length=min(lengths))
    count = sum(length > min(lengths) for length in lengths)
    assert len(messages) == 1 and messages[0].startswith(f"{count} of 8 training pairs ({100 * count / 8:.1f}%) are "
                                                         "longer than `max_length`"), messages


def test_every_pair_dropped_by_truncation_is_refused(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="Every one of the 8 training pairs was dropped"):
        build(tokenizer, preference_rows(8), tmp_path, max_length=3)


def test_every_pair_dropped_is_refused_before_the_reference_precompute(tokenizer, tmp_path):
    """TRL's precompute would fail first, on an empty concatenation (stock: "torch.cat(): expected a non-empty list of
    Tensors"); the plugin refuses with the same error as without the precompute."""
    with pytest.raises(EmptyTrainingSet, match="Every training pair was dropped because its prompt alone fills"):
        build(tokenizer, preference_rows(8), tmp_path, max_length=3, precompute_ref_log_probs=True)


def test_pruning_off_runs_no_check_as_stock(tokenizer, tmp_path, monkeypatch):
    rows = [{**row, "rejected": row["chosen"]} for row in preference_rows(4)]  # refused with pruning on
    monkeypatch.setattr(data_checks, "pair_findings", lambda *a: pytest.fail("checked with pruning off"))
    assert build(tokenizer, rows, tmp_path, position_keep_prob=1.0, **SAVINGS_OFF) == []


def test_vectorised_findings_equal_a_per_row_loop(tokenizer, tmp_path):
    """`pair_findings` (numpy over Arrow) against the obvious loop, on pairs with every case mixed, shuffled so the
    prepared dataset reads through an indices mapping."""
    rows = preference_rows(40)
    for i in range(0, 40, 5):
        rows[i] = {**rows[i], "rejected": rows[i]["chosen"]}
    for i in range(2, 40, 7):
        rows[i] = {**rows[i], "chosen": ""}
    for i in range(3, 40, 9):
        rows[i] = {**rows[i], "chosen": "", "rejected": ""}
    trainer = build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, Dataset.from_list(rows), tmp_path,
                            **PRUNED)
    prepared = trainer.train_dataset.shuffle(seed=0)
    assert prepared._indices is not None
    eos = tokenizer.eos_token_id
    for max_length, keep_start in ((None, True), (30, True), (20, False)):
        found = data_checks.pair_findings(prepared, max_length, keep_start, eos)
        expected = {"degenerate": 0, "first": None, "empty": 0, "first_empty": None, "truncated": 0, "misaligned": 0}
        for i, row in enumerate(prepared):
            chosen, rejected = row["chosen_ids"], row["rejected_ids"]
            strip = lambda ids: ids[:-1] if ids and ids[-1] == eos else ids  # noqa: E731
            if chosen == rejected:
                expected["degenerate"] += 1
                expected["first"] = i if expected["first"] is None else expected["first"]
            elif not strip(chosen) or not strip(rejected):
                expected["empty"] += 1
                expected["first_empty"] = i if expected["first_empty"] is None else expected["first_empty"]
            longest = max(len(chosen), len(rejected)) + (len(row["prompt_ids"]) if keep_start else 0)
            expected["truncated"] += max_length is not None and longest > max_length
            cut_from_start = not keep_start and max_length is not None and (
                len(row["prompt_ids"]) + max(len(chosen), len(rejected)) > max_length)
            expected["misaligned"] += cut_from_start and len(chosen) != len(rejected)
        assert found == {"total": len(prepared), **expected}, (max_length, keep_start)
        assert found["degenerate"] and found["empty"] and (max_length is None or found["truncated"])
        assert keep_start or found["misaligned"]
