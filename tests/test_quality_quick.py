"""CI smoke tests of the studies (evaluation/): every command docs/quality.md gives, at its smallest sizes, end to end,
with every setting its tables name (the main study trains its prototype laws and diagnoses every setting; the
regimes study runs every setting of its tables and of the `auto` rows; the three `auto` tools run).

They check that the documented commands run and that what they write is well formed. They assert nothing about which
setting wins: at these sizes the numbers are noise.
"""

import json

import pytest

from tiny import run_module

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def in_process(tmp_path, module: str, *argv: str) -> None:
    run_module(module, *argv, env={"TRL_PRUNED_DPO_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"})


def test_quality_quick_smoke(tmp_path):
    out, docs = tmp_path / "out", tmp_path / "docs"
    in_process(tmp_path, "evaluation.quality", "--smoke", "--out", str(out), "--docs", str(docs))

    # Training runs: one JSON per setting and seed, each with an exact evaluation curve.
    from evaluation.quality import SMOKE
    from evaluation.settings import DIAGNOSED, EXACT_BASELINES, FAR_DIAGNOSED, SETTINGS

    runs = sorted((out / "runs").glob("*.json"))
    assert {p.stem for p in runs} == {f"{name}-s{seed}" for name in SMOKE.settings for seed in (0, 1)}
    digests = {}
    for path in runs:
        record = json.loads(path.read_text())
        assert record["curve"], path
        for point in record["curve"]:
            assert 0.0 <= point["pref_acc"] <= 1.0 and point["time"] >= 0.0
        assert any("gen_acc" in p for p in record["curve"])
        assert record["max_steps"] == record["curve"][-1]["step"]
        digests.setdefault(record["seed"], set()).add(record["data_digest"])
    assert all(len(d) == 1 for d in digests.values()), "settings of one seed saw different data orders"

    # Timing and gradient diagnostics.
    timing = json.loads((out / "timing.json").read_text())["timing"]
    assert set(timing) == set(SMOKE.settings) | set(EXACT_BASELINES)
    assert timing["stock"]["ratio"] == 1.0 and all(t["step_s"] > 0 for t in timing.values())
    for state, names in (("start", DIAGNOSED), ("trained", DIAGNOSED), ("far", FAR_DIAGNOSED)):
        grads = json.loads((out / f"gradients-{state}.json").read_text())["diagnostics"]
        assert grads["_meta"]["sgd_noise"] > 0
        for name in names:
            entry = grads[name]
            assert -1.0 <= entry["cos"] <= 1.0 and entry["rel_mse"] >= 0.0 and entry["cost"] > 0.0, (state, name)

    # The report: markdown with the headline table and the plots it links, all real PNGs.
    text = (docs / "quality.md").read_text()
    assert text.count("<!-- study:start -->") == 1 and "## The main study" in text
    assert all(f"| {SETTINGS[name].label} |" in text for name in SMOKE.settings)
    assert "python -m evaluation.quality --quick" in text
    for name in ("steps", "time", "margin_gen", "gradients"):
        png = docs / "img" / f"quality_{name}.png"
        assert f"img/quality_{name}.png" in text
        assert png.read_bytes()[:8] == PNG_MAGIC
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) >= set(SMOKE.settings)


def test_pair_shared_masks_keep_the_trainer_marginals():
    """The prototype estimator (evaluation/prototypes.py) changes only the joint law of the masks: for every row,
    E[weight * kept] = 1 on each response position (unbiased sums), as for the trainer's masks; and within a pair the
    two rows are kept together at every column where both have a response token (no prefix cut involved)."""
    import torch

    from evaluation.prototypes import draw_shared_masks

    # Two pairs, [chosen_0, chosen_1, rejected_0, rejected_1]; response lengths 6/4 and 5/4, prompt of 2 tokens.
    lengths = [6, 4, 5, 4]
    completion_mask = torch.zeros(4, 9, dtype=torch.long)
    for row, n in enumerate(lengths):
        completion_mask[row, 2 : 2 + n] = 1
    input_ids = torch.arange(36).view(4, 9) % 7
    response = completion_mask[:, 1:].bool()
    generator = torch.Generator().manual_seed(0)
    total = torch.zeros(response.shape, dtype=torch.float64)
    draws = 4000
    together = True
    for _ in range(draws):
        masks = draw_shared_masks(
            input_ids, completion_mask, position_keep_prob=0.5, prefix_prune_prob=0.5, prefix_min_ratio=0.5,
            branch_keep_prob=0.5, branch_sampling="paired", drop_common_prefix=False, generator=generator,
        )
        total += masks.weights.double() * masks.scored
        both = response[:2] & response[2:]
        positions_only = draw_shared_masks(
            input_ids, completion_mask, position_keep_prob=0.5, prefix_prune_prob=0.0, prefix_min_ratio=0.5,
            branch_keep_prob=1.0, branch_sampling="paired", drop_common_prefix=False, generator=generator,
        ).scored
        together &= bool(((positions_only[:2] == positions_only[2:]) | ~both).all())
    mean = total / draws
    assert together
    assert torch.allclose(mean[response], torch.ones_like(mean[response]), atol=0.12)
    assert float(mean[~response].abs().max()) == 0.0


# Every setting of the regimes tables and of the `auto` rows (docs/quality.md), in one regime. All stages (runs,
# gradients, timing, report) for the first two; training runs (what the tables read) for the rest.
REGIMES_SETTINGS = ["stock", "auto_cp"]
REGIMES_TRAINED = ["common_prefix", "branch_cp", "position_cp", "prefix_cp", "combined_cp", "auto_share_cp",
                   "auto_cp_acc2"]


def test_regimes_quick_smoke(tmp_path, capsys):
    """The regimes study (evaluation/regimes.py) at tiny sizes: runs, noise diagnostics, step timing and the report
    section; the training runs of every other setting; `auto_rows` on its folder; the other regimes' data (a regime
    is its pairs: the same runs read them)."""
    from evaluation import auto_rows
    from evaluation.regimes import REGIME_NAMES, Regimes

    out = tmp_path / "regimes"

    def regimes(*argv):
        in_process(tmp_path, "evaluation.regimes", "--quick", "--seeds", "0", "--batches", "8", "--out", str(out),
                   *argv)

    regimes("--steps", "2", "--regimes", "dissimilar", "--settings", *REGIMES_SETTINGS)
    runs = {p.stem: json.loads(p.read_text()) for p in (out / "dissimilar-b8" / "runs").glob("*.json")}
    assert set(runs) == {"stock-s0", "auto_cp-s0"}
    assert runs["stock-s0"]["data_digest"] == runs["auto_cp-s0"]["data_digest"]
    # what auto decided (its first decision comes at step 8 on this single-process path: none in a 3-step run)
    assert all(0 < c["branch_keep_prob"] <= 1 and 0 < c["position_keep_prob"] <= 1 for c in runs["auto_cp-s0"]["auto"])
    diag = json.loads((out / "gradients-dissimilar.json").read_text())["diagnostics"]
    assert diag["_meta"]["pooled_norm2"] > 0 and "auto_cp" in diag
    timing = json.loads((out / "timing-dissimilar-b8.json").read_text())["timing"]
    assert set(timing) == {"stock", "auto_cp"} and timing["stock"]["ratio"] == 1.0 and timing["auto_cp"]["ratio"] > 0
    report = (out / "regimes.md").read_text()
    assert report.startswith("<!-- regimes:start -->") and "| dissimilar | 8 |" in report
    auto_row = next(line for line in report.splitlines() if line.startswith("| dissimilar | 8 | auto"))
    assert "nan" not in auto_row  # the equal-seconds reading comes from the round-robin timing

    regimes("--stage", "train", "--steps", "2", "--regimes", "dissimilar", "--settings", *REGIMES_TRAINED)
    runs = {p.stem: json.loads(p.read_text()) for p in (out / "dissimilar-b8" / "runs").glob("*.json")}
    assert set(runs) == {f"{name}-s0" for name in REGIMES_SETTINGS + REGIMES_TRAINED}
    # the same pairs in the same order (two micro-batches per step hash each half: a digest of its own)
    assert len({run["data_digest"] for name, run in runs.items() if name != "auto_cp_acc2-s0"}) == 1

    # `auto_rows` reads the auto and branch runs against the exact one, seed by seed.
    capsys.readouterr()
    auto_rows.main([str(out), "dissimilar-b8"])
    printed = capsys.readouterr().out
    assert all(f"  {name:12s} seeds [0]" in printed for name in ("auto_cp", "auto_cp_acc2", "branch_cp")), printed

    study, seen = Regimes(out, quick=True), set()
    for regime in REGIME_NAMES:
        splits = study.splits(regime)
        seen.add(repr(splits))
        assert len(splits["train"]) == study.n_train and len(splits["test"]) == study.n_test, regime
        assert all({"prompt", "chosen", "rejected"} <= set(row) and row["chosen"] != row["rejected"]
                   for rows in splits.values() for row in rows), regime
    assert len(seen) == len(REGIME_NAMES)  # each regime its own pairs



def test_auto_tools_smoke(tmp_path, monkeypatch, capsys):
    """`evaluation.auto_overhead` (auto against the exact path, alternating) and `evaluation.auto_trace` (auto's
    choices over a run) at a few steps of the random-init tiny model."""
    from evaluation import auto_overhead, auto_trace

    monkeypatch.setenv("TRL_PRUNED_DPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    auto_overhead.main(["--model", "builtin:tiny-demo", "--rounds", "1", "--steps", "4", "--batch", "4"])
    assert "auto on / off, median step CPU time per round" in capsys.readouterr().out
    trace = tmp_path / "trace.json"
    auto_trace.main(["--model", "builtin:tiny-demo", "--steps", "3", "--batch", "2", "--accumulation", "2",
                     "--out", str(trace)])
    record = json.loads(trace.read_text())
    assert record["steps"] == 3 and record["pairs_per_step"] == 4 and isinstance(record["history"], list)

def _prototype_settings() -> list[str]:
    from evaluation.settings import SETTINGS

    return [name for name, setting in SETTINGS.items() if setting.prototype]


@pytest.mark.parametrize("name", _prototype_settings())
def test_every_prototype_setting_trains(name, tokenizer, dataset, tmp_path):
    """Every prototype setting of the study (evaluation/prototypes.py: mask laws, balanced branches, annealing) trains
    two steps on the tiny model through the trainer's public draw hook, its own draw used at every micro-step."""
    import math

    from evaluation.prototypes import AnnealKeepProbs, prototype_class
    from evaluation.settings import SETTINGS
    from tiny import build_trainer
    from trl_pruned_dpo import PrunedDPOConfig, PrunedDPOTrainer

    setting = SETTINGS[name]
    custom_draw = setting.mask_law != "trainer" or setting.balanced
    cls = prototype_class(setting.mask_law, setting.balanced) if custom_draw else PrunedDPOTrainer
    trainer = build_trainer(cls, PrunedDPOConfig, tokenizer, dataset, tmp_path, **setting.pruning)
    if setting.anneal:
        trainer.add_callback(AnnealKeepProbs(setting.anneal, horizon=2))
    draws = []
    original = trainer.draw_masks

    def counted(host, options, generator):
        draws.append(options["branch_keep_prob"])
        return original(host, options, generator)

    trainer.draw_masks = counted
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert len(draws) == 2
