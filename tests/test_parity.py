"""Drop-in parity: TRL's own DPOTrainer scenarios (its tests/test_dpo_trainer.py, on tiny local models) run through
`trl.DPOTrainer` and through `PrunedDPOTrainer` with pruning off, and must end the same way: both succeed with the
same logged history and the same final weights, or both raise the same exception type with the same message.

"Pruning off" is every pruning and both exact savings off (`SAVINGS_OFF`: `share_prompt=False, padding_free=False`,
on by default): the plugin then runs stock TRL's own code, hence bit-identical weights. The defaults (exact savings
on) are compared with stock to round-off in test_default_config_trains_packed_and_matches_stock.

Each scenario is a function of (trainer class, config class, output dir) returning a summary of what it produced.
"""

import copy
import functools
import tempfile

import pytest
import torch
from datasets import Dataset, DatasetDict, IterableDatasetDict
from peft import LoraConfig, get_peft_model
from trl import DPOConfig, DPOTrainer

from tiny import SAVINGS_OFF, char_tokenizer, preference_rows, tiny_model, tiny_moe_model
from trl_pruned_dpo import PrunedDPOConfig, PrunedDPOTrainer



def plugin_config(**kw):
    """The plugin's config on stock's path: every pruning (at its default) and both exact savings off."""
    return PrunedDPOConfig(**{**SAVINGS_OFF, **kw})


STOCK, PLUGIN = (DPOTrainer, DPOConfig), (PrunedDPOTrainer, plugin_config)
TOKENIZER = char_tokenizer()
ARGS = dict(per_device_train_batch_size=2, per_device_eval_batch_size=2, max_steps=1, learning_rate=1e-2,
            report_to="none", bf16=False, logging_steps=1, save_strategy="no", disable_tqdm=True)
VOLATILE = ("_runtime", "_samples_per_second", "_steps_per_second", "_model_preparation_time", "total_flos")


@functools.cache
def saved(family: str = "llama") -> str:
    """A tiny model saved to disk, passed by path as TRL's tests pass hub ids (TRL reloads the reference from it)."""
    path = tempfile.mkdtemp(prefix=f"parity-{family}-")
    model = tiny_model(TOKENIZER) if family == "llama" else tiny_moe_model(TOKENIZER, family)
    model.save_pretrained(path)
    TOKENIZER.save_pretrained(path)
    return path


def data(n=4, **extra):
    return Dataset.from_list([{**row, **extra} for row in preference_rows(n)])


def summary(trainer, metrics=None):
    history = [{k: v for k, v in h.items() if not any(k.endswith(x) for x in VOLATILE)}
               for h in trainer.state.log_history]
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return {"history": history, "metrics": {k: v for k, v in (metrics or {}).items()
                                            if not any(k.endswith(x) for x in VOLATILE)}, "weights": weights}


def outcome(scenario, classes, out):
    try:
        return "ok", scenario(*classes, str(out))
    except Exception as error:  # noqa: BLE001 - the outcome *is* the exception
        return "raised", type(error), str(error)


def nan_equal(value):
    """`value` with every float NaN replaced by a marker, so that equal histories with NaN in them compare equal."""
    if isinstance(value, dict):
        return {k: nan_equal(v) for k, v in value.items()}
    if isinstance(value, list):
        return [nan_equal(v) for v in value]
    return "NaN" if isinstance(value, float) and value != value else value


def assert_parity(scenario, tmp_path):
    stock = outcome(scenario, STOCK, tmp_path / "run")
    plugin = outcome(scenario, PLUGIN, tmp_path / "run")
    assert stock[0] == plugin[0], f"stock {stock[0]} {stock[1:] if stock[0] == 'raised' else ''}, plugin {plugin[:3]}"
    if stock[0] == "raised":
        assert (plugin[1], plugin[2]) == (stock[1], stock[2])
        return stock
    s, p = stock[1], plugin[1]
    assert nan_equal(p["history"]) == nan_equal(s["history"])
    assert nan_equal(p["metrics"]) == nan_equal(s["metrics"])
    assert p["weights"].keys() == s["weights"].keys()
    for name, value in s["weights"].items():  # bit-identical, NaN where stock has NaN
        assert torch.equal(p["weights"][name].nan_to_num(7.0), value.nan_to_num(7.0)), name
        assert torch.equal(p["weights"][name].isnan(), value.isnan()), name
    return stock


def train(model_fn=saved, dataset_fn=data, ref=None, evaluate=None, **config):
    """A scenario: build, train, optionally evaluate; `ref`: "copy" for an explicit reference model."""
    def scenario(trainer_cls, config_cls, out):
        model = model_fn()
        if ref == "copy":
            model = tiny_model(TOKENIZER)
        args = config_cls(output_dir=out, **{**ARGS, **config})
        trainer = trainer_cls(model=model, ref_model=copy.deepcopy(model) if ref == "copy" else None, args=args,
                              train_dataset=dataset_fn(), processing_class=TOKENIZER)
        trainer.train()
        return summary(trainer, trainer.evaluate(evaluate()) if evaluate else None)
    return scenario


# ------------------------------------------------------------------------------------------------ training scenarios
# (every loss type, ld_alpha and WPO are compared step by step in tests/test_off_means_stock.py; `padding_free`, which
# stock ignores and the plugin runs, against stock in tests/test_packed.py)
CASES = {
    "default": {},
    "explicit_ref_model": {"ref": "copy"},
    "implicit_prompt": {"dataset_fn": lambda: Dataset.from_list(
        [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in preference_rows(4)])},
    "multi_loss": {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]},
    "f_divergence": {"f_divergence_type": "js_divergence"},
    "sync_ref_model": {"ref": "copy", "sync_ref_model": True, "ref_model_sync_steps": 1, "max_steps": 2},
    "precompute": {"precompute_ref_log_probs": True},
    "gradient_checkpointing": {"gradient_checkpointing": True},
    "iterable_train": {"dataset_fn": lambda: data().to_iterable_dataset()},
    "grad_accumulation": {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 1},
    "with_eval": {"eval_strategy": "steps", "eval_steps": 1, "eval_dataset_fn": True},
}
for family in ("qwen3_moe", "mixtral", "gpt_oss"):  # MoE: router aux loss on (coefficient 0.01)
    CASES[f"moe_{family}"] = {"model_fn": lambda f=family: saved(f), "max_steps": 1}


@pytest.mark.parametrize("name", list(CASES))
def test_training_matches_stock(name, tmp_path):
    case = dict(CASES[name])
    if case.pop("eval_dataset_fn", False):
        def scenario(trainer_cls, config_cls, out):
            args = config_cls(output_dir=out, **{**ARGS, **case})
            trainer = trainer_cls(model=saved(), args=args, train_dataset=data(), eval_dataset=data(2),
                                  processing_class=TOKENIZER)
            trainer.train()
            return summary(trainer)
    else:
        scenario = train(**case)
    result = assert_parity(scenario, tmp_path)
    assert result[0] == "ok", result
    if name.startswith("moe_"):
        assert any("aux_loss" in h for h in result[1]["history"])  # stock logs the router aux loss: so does the plugin


@pytest.mark.parametrize("target", ["dense", "moe"])
@pytest.mark.parametrize("wrapped", [False, True], ids=["peft_config", "peft_model"])
def test_peft_matches_stock(target, wrapped, tmp_path):
    def scenario(trainer_cls, config_cls, out):
        model = tiny_model(TOKENIZER) if target == "dense" else tiny_moe_model(TOKENIZER, "qwen3_moe")
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        kwargs = {"peft_config": lora}
        if wrapped:
            torch.manual_seed(0)
            model, kwargs = get_peft_model(model, lora), {}
        args = config_cls(output_dir=out, **{**ARGS, "max_steps": 1})
        trainer = trainer_cls(model=model, args=args, train_dataset=data(), processing_class=TOKENIZER, **kwargs)
        trainer.train()
        return summary(trainer)

    assert assert_parity(scenario, tmp_path)[0] == "ok"


# ------------------------------------------------------------------------------------------- errors and evaluation
def raise_case(**config):
    """Build only (no training): for constructor errors."""
    dataset_fn = config.pop("dataset_fn", data)

    def scenario(trainer_cls, config_cls, out):
        args = config_cls(output_dir=out, **{**ARGS, **config})
        trainer_cls(model=saved(), args=args, train_dataset=dataset_fn(), processing_class=TOKENIZER)
        return {"history": [], "metrics": {}, "weights": {}}
    return scenario


ERRORS = {
    "precompute_iterable_train": lambda: raise_case(precompute_ref_log_probs=True,
                                                    dataset_fn=lambda: data().to_iterable_dataset()),
    "vision_data_text_model": lambda: raise_case(dataset_fn=lambda: data(images=[])),
    "train_dataset_required": lambda: raise_case(dataset_fn=lambda: None),
    "exo_pair_without_smoothing": lambda: raise_case(loss_type=["exo_pair"]),
    "model_equals_ref": None,
    "args_none_on_cpu": None,
    "unknown_loss_type_mid_training": lambda: train(loss_type=["nope"]),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_errors_match_stock(name, tmp_path, monkeypatch):
    if name == "model_equals_ref":
        def scenario(trainer_cls, config_cls, out):
            model = tiny_model(TOKENIZER)
            trainer_cls(model=model, ref_model=model, args=config_cls(output_dir=out, **ARGS), train_dataset=data(),
                        processing_class=TOKENIZER)
    elif name == "args_none_on_cpu":
        # The one intended difference (docs/parity.md): stock's default DPOConfig asks for bf16, which a machine without
        # it refuses; the plugin's default PrunedDPOConfig leaves an unset bf16 to the hardware. So the plugin with
        # args=None must behave as stock given its own default config in fp32 (here both fail loading the reference
        # by the in-memory model's empty name), and stock itself must still refuse bf16 on such a machine.
        from transformers.utils import is_torch_bf16_gpu_available
        from trl.trainer.utils import get_config_model_id

        monkeypatch.chdir(tmp_path)  # the default output_dir is relative to the working directory
        if not is_torch_bf16_gpu_available():
            with pytest.raises(ValueError, match="bf16"):
                DPOTrainer(model=tiny_model(TOKENIZER), args=None, train_dataset=data(), processing_class=TOKENIZER)

        def scenario(trainer_cls, config_cls, out):
            model = tiny_model(TOKENIZER)
            default_dir = f"{get_config_model_id(model.config).split('/')[-1]}-DPO"
            args = None if trainer_cls is PrunedDPOTrainer else DPOConfig(output_dir=default_dir, bf16=False)
            trainer_cls(model=model, args=args, train_dataset=data(), processing_class=TOKENIZER)
    else:
        scenario = ERRORS[name]()
    assert assert_parity(scenario, tmp_path)[0] == "raised"


EVAL_TYPES = ["dataset", "iterable_dataset", "dataset_dict", "iterable_dataset_dict", "dict_of_dataset",
              "dict_of_iterable_dataset"]


def eval_split(kind):
    split = data(2)
    streaming = "iterable" in kind
    if streaming:
        split = split.to_iterable_dataset()
    if kind in ("dataset", "iterable_dataset"):
        return split
    if kind.endswith("_dict") and kind.startswith(("dataset", "iterable")):
        return (IterableDatasetDict if streaming else DatasetDict)({"data1": split, "data2": split})
    return {"data1": split, "data2": split}


@pytest.mark.parametrize("precompute", [False, True])
@pytest.mark.parametrize("kind", EVAL_TYPES)
def test_evaluate_matches_stock(kind, precompute, tmp_path):
    """TRL's test_evaluate_with_eval_dataset: every eval dataset type, with and without precomputed references."""
    def scenario(trainer_cls, config_cls, out):
        args = config_cls(output_dir=out, **{**ARGS, "precompute_ref_log_probs": precompute})
        trainer = trainer_cls(model=saved(), args=args, train_dataset=data(2), processing_class=TOKENIZER)
        return summary(trainer, trainer.evaluate(eval_dataset=eval_split(kind)))

    result = assert_parity(scenario, tmp_path)
    assert result[0] == ("raised" if precompute and "iterable" in kind else "ok")


def test_evaluate_after_training_with_precompute_matches_stock(tmp_path):
    def scenario(trainer_cls, config_cls, out):
        args = config_cls(output_dir=out, **{**ARGS, "max_steps": 1, "precompute_ref_log_probs": True})
        trainer = trainer_cls(model=saved(), args=args, train_dataset=data(2), processing_class=TOKENIZER)
        trainer.evaluate(eval_dataset=data(2))
        trainer.train()
        trainer.evaluate(eval_dataset=data(2))

    assert assert_parity(scenario, tmp_path)[0] == "raised"


def test_model_card_tags(tmp_path):
    """Stock's tags, plus the plugin's own (the one intended difference: the card says which trainer made it)."""
    tags = {}
    for trainer_cls, config_cls in (STOCK, PLUGIN):
        model = tiny_model(TOKENIZER)
        trainer_cls(model=model, ref_model=copy.deepcopy(model), args=config_cls(output_dir=str(tmp_path), **ARGS),
                    train_dataset=data(), processing_class=TOKENIZER)
        tags[trainer_cls] = list(model.model_tags)
    assert tags[PrunedDPOTrainer] == tags[DPOTrainer] + ["trl-pruned-dpo"]


@pytest.mark.parametrize("precompute", [False, True])
@pytest.mark.parametrize("kind", ["iterable_dataset", "dict_of_dataset"])
def test_evaluate_with_pruning_on_matches_stock(kind, precompute, tmp_path):
    """Evaluation is never pruned: with pruning on, `evaluate` ends as stock's (the same error, or the same metrics up
    to round-off: the plugin's precomputed reference sums come from its compact head)."""
    def scenario(trainer_cls, config_cls, out):
        pruning = {"position_keep_prob": 0.5} if config_cls is plugin_config else {}
        args = config_cls(output_dir=out, **{**ARGS, "precompute_ref_log_probs": precompute, **pruning})
        trainer = trainer_cls(model=saved(), args=args, train_dataset=data(2), processing_class=TOKENIZER)
        return trainer.evaluate(eval_dataset=eval_split(kind))

    stock = outcome(scenario, STOCK, tmp_path / "run")
    plugin = outcome(scenario, PLUGIN, tmp_path / "run")
    assert stock[0] == plugin[0]
    if stock[0] == "raised":
        assert plugin[1:] == stock[1:] and precompute and "iterable" in kind
        return
    for key, value in stock[1].items():
        if not key.endswith(VOLATILE):
            assert plugin[1][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


# ------------------------------------------------------------------------- issue 22: what TRL's own suite tripped on
def test_nan_loss_trains_on_as_stock(tmp_path, monkeypatch):
    """TRL's test_train_model_dtype (fp16 weights, learning rate 0.1) goes NaN and stock trains on: so must the plugin
    with pruning off (its guard is off unless asked for). The NaN is injected at step 2 into both trainers' loss."""
    original = DPOTrainer.compute_loss

    def poisoned(self, *args, **kwargs):
        loss = original(self, *args, **kwargs)
        return loss * float("nan") if self.state.global_step == 1 else loss

    monkeypatch.setattr(DPOTrainer, "compute_loss", poisoned)  # the plugin's pruning-off path calls it too
    result = assert_parity(train(max_steps=3), tmp_path)
    assert result[0] == "ok" and any(h.get("grad_norm") != h.get("grad_norm") for h in result[1]["history"])


def test_fp16_model_high_learning_rate_matches_stock(tmp_path):
    """TRL's test_train_model_dtype itself, on the local model: fp16 weights, learning rate 0.1."""
    result = assert_parity(train(model_init_kwargs={"dtype": torch.float16}, learning_rate=0.1, max_steps=4), tmp_path)
    assert result[0] == "ok"


@pytest.mark.parametrize("pruning", ["off", "on"])
def test_stock_checkpoint_resumes(pruning, tmp_path, caplog):
    """A stock DPOTrainer checkpoint (no plugin marker) resumes, `resume_from_checkpoint=True` included: with pruning
    off exactly as stock resumes it; with pruning on too, with a one-line note."""
    def checkpointed(out):
        args = DPOConfig(output_dir=out, **{**ARGS, "max_steps": 2, "save_strategy": "steps", "save_steps": 1})
        DPOTrainer(model=saved(), args=args, train_dataset=data(), processing_class=TOKENIZER).train()

    def scenario(trainer_cls, config_cls, out):
        checkpointed(out)
        pruning_options = {"position_keep_prob": 0.5} if pruning == "on" and config_cls is plugin_config else {}
        args = config_cls(output_dir=out, **{**ARGS, "max_steps": 3, **pruning_options})
        trainer = trainer_cls(model=saved(), args=args, train_dataset=data(), processing_class=TOKENIZER)
        trainer.train(resume_from_checkpoint=True)
        return summary(trainer)

    if pruning == "off":
        assert assert_parity(scenario, tmp_path)[0] == "ok"
        return
    with caplog.at_level("WARNING"):
        result = outcome(scenario, PLUGIN, tmp_path / "run")
    assert result[0] == "ok", result
    assert result[1]["history"][-2]["step"] == 3  # steps 1-2 from the stock checkpoint, then step 3
    notes = [r.getMessage() for r in caplog.records if "no trl-pruned-dpo completion marker" in r.getMessage()]
    assert len(notes) == 1 and "checkpoint-2" in notes[0] and "\n" not in notes[0]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_moe_aux_loss_is_logged_under_its_stock_name_with_pruning_on(family, tmp_path):
    """TRL's test_train reads `log_history[-1]["aux_loss"]` for MoE models: with pruning on it is there too. As in TRL's
    test no logging step falls inside the run, so the final summary carries the window's metrics (resolved from the
    device at that log: metrics.flush)."""
    args = PrunedDPOConfig(output_dir=str(tmp_path), **{**ARGS, "max_steps": 2, "logging_steps": 10},
                           branch_keep_prob=0.5, position_keep_prob=0.5, prefix_prune_prob=0.5)
    trainer = PrunedDPOTrainer(model=saved(family), args=args, train_dataset=data(), processing_class=TOKENIZER)
    trainer.train()
    assert trainer.aux_loss_enabled
    final = trainer.state.log_history[-1]
    assert final["aux_loss"] > 0 and "train_loss" in final  # TRL's own assertion, on the final summary
    assert isinstance(final["prune/positions_scored"], float) and 0 < final["prune/positions_scored"] < 1
    assert not any("aux_loss_grad_rows" in k for h in trainer.state.log_history for k in h)


# ------------------------------------------------------------------------------------------------- the logged keys
def documented_keys() -> set[str]:
    """Every key of docs/metrics.md's table (its first column)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "metrics.md").read_text()
    rows = [line.split("|")[1] for line in text.splitlines() if line.startswith("| `")]
    return {key for row in rows for key in row.replace(" ", "").replace("`", " ").split() if key != ","}


# Stock's per-branch and per-token keys, which `prune_common_prefix` moves to `_after_common_prefix` names.
PARTIAL = ("entropy", "logits/chosen", "logits/rejected", "mean_token_accuracy", "logps/chosen", "logps/rejected",
           "rewards/chosen", "rewards/rejected")


@pytest.mark.parametrize("setting", ["savings", "common_prefix", "position", "position_auto", "branch", "debug"])
def test_logged_keys_follow_the_table(setting, tmp_path):
    """The keys each setting logs (docs/metrics.md): stock's names where the value is stock's or unbiased for it, one
    clearly named key where none is, the diagnostics only at `prune_log_level="debug"`; every key documented."""
    pruning = {"savings": {}, "common_prefix": {"prune_common_prefix": True},
               "position": {"position_keep_prob": 0.5}, "position_auto": {"position_keep_prob": "auto"},
               "branch": {"branch_keep_prob": 0.5},
               "debug": {"branch_keep_prob": "auto", "prune_common_prefix": True, "prune_log_level": "debug"}}[setting]
    config = dict(output_dir=str(tmp_path / "stock"), **{**ARGS, "max_steps": 2})
    stock = DPOTrainer(model=saved(), args=DPOConfig(**config), train_dataset=data(), processing_class=TOKENIZER)
    stock.train()
    config["output_dir"] = str(tmp_path / "plugin")
    plugin = PrunedDPOTrainer(model=saved(), args=PrunedDPOConfig(**config, **pruning), train_dataset=data(),
                              processing_class=TOKENIZER)
    plugin.train()
    stock_keys = set(stock.state.log_history[0])
    keys = set(plugin.state.log_history[0])
    prune = {k for k in keys if k.startswith("prune/")}
    assert keys - prune <= stock_keys and prune <= documented_keys()
    work = {"prune/tokens_executed", "prune/tokens_backpropagated"}
    if setting in ("savings", "branch"):
        # Every value stock's (branch pruning changes no value, only the gradient).
        assert keys - prune == stock_keys
        assert prune == work | ({"prune/branches_backpropagated"} if setting == "branch" else set())
    if setting == "common_prefix":
        # The margins and accuracies are exact (the prefix cancels); the per-branch sums and token means cover the
        # response after the prefix, under names that say so.
        assert keys - prune == stock_keys - set(PARTIAL)
        assert prune == work | {"prune/positions_scored"} | {f"prune/{k}_after_common_prefix" for k in PARTIAL}
    if setting == "position":
        assert keys - prune == stock_keys - {"rewards/accuracies"}
        assert prune == work | {"prune/positions_scored", "prune/rewards/accuracies_of_estimate"}
    if setting == "position_auto":
        # Auto's first steps keep every position (its warm-up starts with exact blocks): the margins are exact at
        # those steps, so the accuracies keep stock's name; its diagnostics are not logged at "info".
        assert plugin.last_micro_step.options["position_keep_prob"] == 1.0 and keys - prune == stock_keys
        assert prune == work | {"prune/positions_scored"}
    if setting == "debug":
        assert {"prune/positions_scored", "prune/branches_backpropagated", "prune/pairs_shared",
                "prune/branch_keep_prob"} <= prune and "prune/position_keep_prob" not in prune
        # B_simple is logged only once auto has decided (here: never, in two steps).
        assert "prune/auto_b_simple" not in prune and "prune/auto_b_simple" in documented_keys()
