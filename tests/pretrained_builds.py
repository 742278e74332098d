"""What the tests of the pretrained built-ins share (test_real_model.py on SmolLM2, test_gemma3.py on Gemma 3): the
built model's folder (or a skip saying why the package registry cannot serve it), the policy/reference pair, short
real-text pairs, one training step of stock DPOTrainer or the plugin, the exactness check against stock, and the
check that a failed build cached nothing."""

import copy
import gc
import tempfile

import pytest
import torch
from datasets import Dataset
from trl import DPOConfig, DPOTrainer

from tiny import first_batch, loss_and_grads
from trl_pruned_dpo import PrunedDPOConfig, PrunedDPOTrainer
from trl_pruned_dpo.demo import pretrained, resolve_model
from trl_pruned_dpo.demo.realtext import make_splits

SCRATCH = tempfile.mkdtemp(prefix="real-model-")  # the trainers' output_dir (nothing is saved: save_strategy "no")
ARGS = dict(max_steps=1, learning_rate=1e-5, report_to="none", bf16=False, logging_steps=1, save_strategy="no",
            disable_tqdm=True, dataloader_num_workers=0, beta=0.1)


def built_or_skip(model: str) -> str:
    """The cached folder of built-in `model` (built on first use); the test skips only if the registry is out of reach."""
    try:
        return resolve_model(model)
    except pretrained.RegistryUnreachable as error:
        pytest.skip(f"{model} cannot be built here: {error}")


@pytest.fixture(scope="module")
def model_path(request):
    """The cached folder of the test module's `MODEL`."""
    return built_or_skip(request.module.MODEL)


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="module")
def models(model_path):
    """(reference, policy) of `perturbed_pair`: loaded once for the module, freed after it."""
    pair = perturbed_pair(model_path)
    yield pair
    del pair
    gc.collect()


def perturbed_pair(model_path: str):
    """(reference, policy): the built model, and a copy moved slightly off it so that every log-ratio is non-zero."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    policy = copy.deepcopy(reference)
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for p in policy.parameters():
            p.add_(0.02 * p.std() * torch.randn(p.shape, generator=g))
    return reference, policy


def short_pairs(n: int, most_words: int = 18) -> Dataset:
    """`n` real-text pairs (builtin:python-docs) with short answers, near-copies (a common prefix) and independent
    ones alike."""
    rows = [r for r in make_splits(0)["train"]
            if max(len(r["chosen"][0]["content"].split()), len(r["rejected"][0]["content"].split())) <= most_words]
    near = [r for r in rows if r["chosen"][0]["content"][:12] == r["rejected"][0]["content"][:12]]
    independent = [r for r in rows if r not in near]
    return Dataset.from_list(near[: n // 2] + independent[: n - n // 2])


def make_trainer(cls, models, tokenizer, data, pairs: int, **config):
    """A trainer of `pairs` pairs per step on the shared policy (one copy for the whole module: each test's trainer
    takes it in turn)."""
    reference, policy = models
    policy.gradient_checkpointing_disable()  # a previous trainer may have turned it on
    config_class = PrunedDPOConfig if cls is PrunedDPOTrainer else DPOConfig
    args = config_class(output_dir=SCRATCH, **{**ARGS, "per_device_train_batch_size": pairs, **config})
    return cls(model=policy, ref_model=reference, args=args, train_dataset=data, processing_class=tokenizer)


def step(trainer_, n: int):
    """Loss and gradients of one step on the first `n` pairs; the trainer's model is left without gradients."""
    try:
        return loss_and_grads(trainer_, first_batch(trainer_, n))
    finally:
        trainer_.model.zero_grad(set_to_none=True)
        gc.collect()


def lora_step(cls, reference, tokenizer, data, pairs: int, **config):
    """Loss and adapter gradients of one step of `cls` with a LoRA adapter (q and v projections) on a copy of
    `reference`, its B matrices moved off zero (so policy != reference), the same adapter for every `cls`."""
    from peft import LoraConfig

    config_class = PrunedDPOConfig if cls is PrunedDPOTrainer else DPOConfig
    args = config_class(output_dir=SCRATCH, **{**ARGS, "per_device_train_batch_size": pairs,
                                               "gradient_checkpointing": True, **config})
    torch.manual_seed(0)  # the same adapter init
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    built = cls(model=copy.deepcopy(reference), args=args, train_dataset=data, processing_class=tokenizer,
                peft_config=lora)
    with torch.no_grad():  # lora_B starts at zero (policy = reference): move it off
        g = torch.Generator().manual_seed(1)
        for name, p in built.model.named_parameters():
            if "lora_B" in name:
                p.add_(0.01 * torch.randn(p.shape, generator=g))
    try:
        return step(built, pairs)
    finally:
        del built
        gc.collect()


def worst_gradient(grads, reference_grads) -> tuple[float, str]:
    """The largest |difference| of a parameter's gradient, relative to that gradient's largest reference entry, and
    the parameter's name."""
    assert grads.keys() == reference_grads.keys() and reference_grads
    return max((float((grads[n] - reference_grads[n]).abs().max()) / (float(reference_grads[n].abs().max()) + 1e-30), n)
               for n in reference_grads)


def assert_exact(stock, plugin):
    """Loss within 1e-5; every parameter's gradient within 1e-4 of its largest stock entry."""
    (loss_s, grads_s), (loss_p, grads_p) = stock, plugin
    assert abs(float(loss_p) - float(loss_s)) <= 1e-5, (float(loss_p), float(loss_s))
    worst = worst_gradient(grads_p, grads_s)
    assert worst[0] <= 1e-4, worst


@pytest.fixture()
def empty_cache(monkeypatch, tmp_path):
    """A fresh, empty cache folder for the build's error paths."""
    monkeypatch.setenv("TRL_PRUNED_DPO_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def assert_nothing_cached(cache, model: str) -> None:
    """No folder of built-in `model` (``builtin:<name>``) under `cache`: a failed build leaves nothing behind."""
    models, name = cache / "models", model.removeprefix("builtin:")
    assert not models.exists() or not any(p.name.startswith(name) for p in models.iterdir())
