"""Drop-in parity: TRL's own DPOTrainer scenarios (its tests/test_dpo_trainer.py, on tiny local models) run through
`trl.DPOTrainer` and through `PrunedDPOTrainer` with pruning off, and must end the same way: both succeed with the
same logged history and the same final weights, or both raise the same exception type with the same message.

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

from tiny import char_tokenizer, preference_rows, tiny_model, tiny_moe_model
from trl_pruned_dpo import PrunedDPOConfig, PrunedDPOTrainer

STOCK, PLUGIN = (DPOTrainer, DPOConfig), (PrunedDPOTrainer, PrunedDPOConfig)
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


def assert_parity(scenario, tmp_path):
    stock = outcome(scenario, STOCK, tmp_path / "run")
    plugin = outcome(scenario, PLUGIN, tmp_path / "run")
    assert stock[0] == plugin[0], f"stock {stock[0]} {stock[1:] if stock[0] == 'raised' else ''}, plugin {plugin[:3]}"
    if stock[0] == "raised":
        assert (plugin[1], plugin[2]) == (stock[1], stock[2])
        return stock
    s, p = stock[1], plugin[1]
    assert p["history"] == s["history"]
    assert p["metrics"] == s["metrics"]
    assert p["weights"].keys() == s["weights"].keys()
    for name, value in s["weights"].items():
        assert torch.equal(p["weights"][name], value), name
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
# (every loss type, ld_alpha and WPO are compared step by step in tests/test_off_means_stock.py)
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
    "padding_free_falls_back": {"padding_free": True},
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
def test_errors_match_stock(name, tmp_path):
    if name == "model_equals_ref":
        def scenario(trainer_cls, config_cls, out):
            model = tiny_model(TOKENIZER)
            trainer_cls(model=model, ref_model=model, args=config_cls(output_dir=out, **ARGS), train_dataset=data(),
                        processing_class=TOKENIZER)
    elif name == "args_none_on_cpu":  # stock's default config asks for bf16, which a CPU refuses: the same error
        def scenario(trainer_cls, config_cls, out):
            trainer_cls(model=tiny_model(TOKENIZER), args=None, train_dataset=data(), processing_class=TOKENIZER)
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
        pruning = {"position_keep_prob": 0.5} if config_cls is PrunedDPOConfig else {}
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
