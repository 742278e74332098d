"""Contract: every invalid pruning value raises before any work, with a message naming the field and the fix."""

import pytest
from trl import DPOConfig

from tiny import SAVINGS_OFF, build_trainer
from trl_pruned_dpo import PrunedDPOConfig, PrunedDPOTrainer
from trl_pruned_dpo.config import uses_pruned_forward
from trl_pruned_dpo.seam import as_pruned_config


def config(**kw):
    return PrunedDPOConfig(output_dir="unused", report_to="none", bf16=False, **kw)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("position_keep_prob", 0.0, r"`position_keep_prob` must lie in \(0.0, 1.0\]"),
        ("position_keep_prob", 1.5, "position_keep_prob"),
        ("position_keep_prob", -0.1, "position_keep_prob"),
        ("branch_keep_prob", 0.0, "branch_keep_prob"),
        ("branch_keep_prob", 2, "branch_keep_prob"),
        ("prefix_prune_prob", -0.5, r"`prefix_prune_prob` must lie in \[0.0, 1.0\]"),
        ("prefix_prune_prob", 1.01, "prefix_prune_prob"),
        ("prefix_min_ratio", 0.0, "prefix_min_ratio"),
        ("prefix_min_ratio", 1.2, "prefix_min_ratio"),
        ("branch_sampling", "stratified", "branch_sampling.*paired.*independent"),
        ("position_keep_prob", float("nan"), "position_keep_prob"),
    ],
)
def test_invalid_values_are_rejected(field, value, message):
    with pytest.raises(ValueError, match=message):
        config(**{field: value})


def test_non_numeric_probability_is_rejected():
    with pytest.raises(TypeError, match="position_keep_prob"):
        config(position_keep_prob="half")


def test_unknown_loss_type_is_rejected_up_front():
    with pytest.raises(ValueError, match="Unknown `loss_type`.*'sigmoid'"):
        config(loss_type=["sigmoidd"], position_keep_prob=0.5)
    assert config(loss_type=["sigmoidd"]).loss_type == ["sigmoidd"]  # pruning off: stock accepts it here


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(loss_type=["ipo"]), "prune_common_prefix.*'ipo'"),
        (dict(loss_type=["sigmoid", "bco_pair"]), "bco_pair"),
        (dict(f_divergence_type="js_divergence"), "f_divergence_type"),
        (dict(use_weighting=True), "use_weighting"),
    ],
)
def test_common_prefix_is_only_for_pair_difference_losses(kw, message):
    with pytest.raises(ValueError, match=message):
        config(prune_common_prefix=True, **kw)


def test_defaults_prune_nothing_and_seed_follows_the_run():
    args = config(seed=7)
    assert not args.pruning_enabled and args.prune_seed == 7
    assert config(prune_seed=3, seed=7).prune_seed == 3
    assert config(branch_keep_prob=0.5).pruning_enabled


def test_exact_savings_are_on_by_default_and_off_restores_stocks_code():
    """Issue 20: `share_prompt` and `padding_free` (exact) default to True, so the plugin's forward runs; both off with
    every pruning off is stock TRL's own code (`uses_pruned_forward` False)."""
    args = config()
    assert args.share_prompt is True and args.padding_free is True and not args.pruning_enabled
    assert uses_pruned_forward(args)
    assert not uses_pruned_forward(config(**SAVINGS_OFF))
    assert uses_pruned_forward(config(share_prompt=False)) and uses_pruned_forward(config(padding_free=False))
    assert not uses_pruned_forward(DPOConfig(output_dir="unused", report_to="none", bf16=False))


@pytest.mark.parametrize("field", ["share_prompt", "padding_free"])
def test_exact_saving_switches_must_be_booleans(field):
    with pytest.raises(TypeError, match=f"`{field}` must be true or false"):
        config(**{field: "no"})


def test_exact_savings_turn_off_from_flags_and_yaml(tmp_path):
    from trl import TrlParser

    from trl_pruned_dpo.cli.parse import make_parser

    base = ["--output_dir", "x", "--bf16", "false", "--report_to", "none"]
    parser = TrlParser((PrunedDPOConfig,))
    (on,) = parser.parse_args_into_dataclasses(base)
    assert on.share_prompt and on.padding_free
    (off,) = parser.parse_args_into_dataclasses(base + ["--padding_free", "false", "--share_prompt", "false"])
    assert not off.share_prompt and not off.padding_free and not uses_pruned_forward(off)
    (off,) = parser.parse_args_into_dataclasses(base + ["--no_padding_free", "--no_share_prompt"])
    assert not off.share_prompt and not off.padding_free
    yaml = tmp_path / "off.yaml"
    yaml.write_text(f"output_dir: {tmp_path}\nbf16: false\nreport_to: none\nshare_prompt: false\npadding_free: false\n")
    _, off, *_ = make_parser().parse_args_and_config(["--config", str(yaml)])
    assert not off.share_prompt and not off.padding_free and not uses_pruned_forward(off)


def test_fields_come_from_a_parser():
    from trl import TrlParser

    (args,) = TrlParser((PrunedDPOConfig,)).parse_args_into_dataclasses(
        ["--output_dir", "x", "--branch_keep_prob", "0.5", "--branch_sampling", "independent",
         "--prune_reference", "false", "--bf16", "false", "--report_to", "none"]
    )
    assert args.branch_keep_prob == 0.5 and args.branch_sampling == "independent" and not args.prune_reference


def test_trainer_promotes_a_plain_dpo_config_with_pruning_off(tokenizer, dataset, tmp_path):
    """A drop-in takes stock's config: the same settings, pruning at its identity (TRL's own path)."""
    trainer = build_trainer(PrunedDPOTrainer, DPOConfig, tokenizer, dataset, tmp_path, beta=0.3, max_steps=1)
    assert isinstance(trainer.args, PrunedDPOConfig) and not trainer.args.pruning_enabled
    # not PrunedDPOConfig's defaults (exact savings on): share_prompt off, the user's own padding_free (stock's False)
    assert trainer.args.share_prompt is False and trainer.args.padding_free is False
    assert not uses_pruned_forward(trainer.args) and not trainer.forward_choice.packed  # stock TRL's own code
    assert trainer.args.beta == 0.3 and trainer.args.prune_seed == trainer.args.seed
    trainer.train()
    assert not any(k.startswith("prune/") for k in trainer.state.log_history[0])


def test_promotion_keeps_the_users_padding_free_and_turns_share_prompt_off():
    """Promotion sets `share_prompt=False` itself (not the field's default, True) and keeps DPOConfig's `padding_free`,
    whatever the user set: the user's explicit `padding_free=True` is honoured (packed, exact), nothing else added."""
    for padding_free in (False, True):
        plain = DPOConfig(output_dir="unused", report_to="none", bf16=False, padding_free=padding_free)
        promoted = as_pruned_config(None, plain, PrunedDPOConfig)
        assert isinstance(promoted, PrunedDPOConfig) and promoted.share_prompt is False
        assert promoted.padding_free is padding_free and not promoted.pruning_enabled
        assert uses_pruned_forward(promoted) is padding_free


def test_vision_data_with_a_text_model_raises_trls_own_error(tokenizer, tmp_path):
    from datasets import Dataset

    data = Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c", "images": []}])
    with pytest.raises(ValueError, match="vision-related.*vision-language model"):
        build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, data, tmp_path, position_keep_prob=0.5)


def test_unset_bf16_follows_the_hardware_and_explicit_values_are_kept():
    """DPOConfig's unset bf16 means True, which transformers refuses on a machine without bf16 (this CPU CI)."""
    from transformers.utils import is_torch_bf16_gpu_available

    unset = PrunedDPOConfig(output_dir="unused", report_to="none")
    assert unset.bf16 is is_torch_bf16_gpu_available()
    assert PrunedDPOConfig(output_dir="unused", report_to="none", bf16=False).bf16 is False
    assert PrunedDPOConfig(output_dir="unused", report_to="none", fp16=False, use_cpu=True).bf16 is True  # as stock
    if not is_torch_bf16_gpu_available():
        with pytest.raises(ValueError, match="bf16"):  # explicit bf16 on a machine without it: refused, not changed
            PrunedDPOConfig(output_dir="unused", report_to="none", bf16=True)


@pytest.mark.parametrize("seed", ["abc", 1.5, True])
def test_prune_seed_must_be_an_integer(seed):
    with pytest.raises(TypeError, match="prune_seed"):
        config(prune_seed=seed)
