"""The one home of the tests' tiny local assets: a character tokenizer, a merging (BPE) tokenizer, tiny dense and MoE
models built from configs, preference data, and the trainer builders. Nothing here touches a hub.

Imported by tests/conftest.py (which adds the pytest fixtures), tests/distributed/run_pruned.py and the parity tests.
"""

import contextlib
import copy
import importlib
import io
import math
import os
import string
from unittest import mock

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
CHARACTERS = string.ascii_letters + string.digits + string.punctuation + " "  # both tokenizers' alphabet


def char_tokenizer() -> PreTrainedTokenizerFast:
    alphabet = SPECIALS + list(CHARACTERS)
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )


def bpe_tokenizer(vocab_size: int = 160) -> PreTrainedTokenizerFast:
    """A byte-pair tokenizer trained here on a fixed text of the character tokenizer's alphabet: tokens merge across
    spaces and across a prompt's end (so a tokenized prompt need not be a prefix of prompt + answer), and every
    encoding starts with <bos>, as Llama's and Gemma's tokenizers do."""
    alphabet = list(CHARACTERS)
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.decoder = decoders.BPEDecoder()
    g = torch.Generator().manual_seed(0)
    text = ["".join(alphabet[int(i)] for i in torch.randint(0, 40, (60,), generator=g)) for _ in range(200)]
    text += ["the answer is " + " ".join(str(int(i)) for i in torch.randint(0, 99, (8,), generator=g))
             for _ in range(50)]
    backend.train_from_iterator(text, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                                          initial_alphabet=alphabet, show_progress=False))
    bos = backend.token_to_id("<bos>")
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                           special_tokens=[("<bos>", bos)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )


def tiny_model(tokenizer, seed: int = 0, layers: int = 2, hidden: int = 32) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    return LlamaForCausalLM(config)


def preference_rows(n: int = 8, seed: int = 0):
    """Sums with a right and a near-copy wrong answer; lengths vary."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        a, b = (int(x) for x in torch.randint(1, 999, (2,), generator=g))
        pad = "." * int(torch.randint(0, 12, (1,), generator=g))
        right = f"{a}+{b}={a + b}{pad}"
        wrong = f"{a}+{b}={a + b + 1 + i % 3}{pad}"
        rows.append({"prompt": f"Q{i}: {a}+{b}? ", "chosen": right, "rejected": wrong})
    return rows


def ragged_rows(n: int = 8, seed: int = 0) -> list[dict]:
    """Prompts of ragged length with short answers: stock pads every row to the longest, the packed layout runs each
    prompt once per pair, so several micro-batches fit in stock's padded tokens of one (the default budget)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        a, b = (int(x) for x in torch.randint(1, 999, (2,), generator=g))
        context = "abc " * int(torch.randint(1, 12, (1,), generator=g))
        rows.append({"prompt": f"{context}Q{i}: {a}+{b}? ", "chosen": f"{a + b}", "rejected": f"{a + b + 1 + i % 3}"})
    return rows


# Quiet, short, fp32 training: the fields every test run shares (tests/distributed/run_pruned.py too).
QUIET_TRAINING = dict(
    max_steps=2,
    learning_rate=1e-3,
    report_to="none",
    bf16=False,
    logging_steps=1,
    save_strategy="no",
    disable_tqdm=True,
    dataloader_num_workers=0,
)
BASE_ARGS = dict(output_dir="unused", per_device_train_batch_size=4, per_device_eval_batch_size=4, **QUIET_TRAINING)

# PrunedDPOConfig's two exact savings (on by default), off: with every pruning off too (`uses_pruned_forward` False),
# PrunedDPOTrainer runs stock TRL's own code. Tests of "pruning off is stock" pass it explicitly.
SAVINGS_OFF = dict(share_prompt=False, padding_free=False)


def build_trainer(trainer_cls, config_cls, tokenizer, train_dataset, tmp_path, *, model=None, ref_model="copy",
                  seed=0, **overrides):
    """A trainer on the tiny local model; the policy starts away from the reference so log-ratios are non-zero."""
    if model is None:
        model = tiny_model(tokenizer, seed=seed)
    if ref_model == "copy":
        ref_model = copy.deepcopy(model)
        with torch.no_grad():  # move the policy off the reference: d_t != 0
            g = torch.Generator().manual_seed(seed + 1)
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    args = config_cls(**{**BASE_ARGS, "output_dir": str(tmp_path), **overrides})
    return trainer_cls(model=model, ref_model=ref_model, args=args, train_dataset=train_dataset,
                       processing_class=tokenizer)


def train_and_compare_histories(stock, pruned, steps: int = 2):
    """Train both trainers, then check that every float TRL logged at each step (timings and schedule apart) agrees
    to 1e-4 relative / 1e-5 absolute. Returns the (stock, pruned) log entries for the caller's own checks."""
    import pytest

    stock.train()
    pruned.train()
    history_s = [h for h in stock.state.log_history if "loss" in h]
    history_p = [h for h in pruned.state.log_history if "loss" in h]
    assert len(history_s) == len(history_p) == steps
    for hs, hp in zip(history_s, history_p):
        for key, value in hs.items():
            if key not in ("epoch", "step", "learning_rate") and isinstance(value, float):
                assert hp[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    return list(zip(history_s, history_p))


def first_batch(trainer, n=4, rows=None):
    """The first n training examples (or those at `rows`), collated the way training collates them (no shuffling)."""
    trainer.model.train()
    data = trainer._remove_unused_columns(trainer.train_dataset, description="test")
    return trainer._prepare_inputs(trainer.data_collator([data[i] for i in (range(n) if rows is None else rows)]))


def loss_and_grads(trainer, batch):
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


MOE_FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss")


def tiny_moe_model(tokenizer, family: str = "qwen3_moe", seed: int = 0, hidden: int = 32):
    """A 2-layer Mixture-of-Experts model (4 experts, top-2) of the given family, from a config; router aux loss on."""
    import transformers

    classes = {
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(moe_intermediate_size=hidden, num_experts=4)),
        "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4)),
        "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(num_local_experts=4, rope_parameters=None)),
    }
    config_name, model_name, extra = classes[family]
    config = getattr(transformers, config_name)(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, num_experts_per_tok=2,
        max_position_embeddings=512, router_aux_loss_coef=0.01, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
        **{k: v for k, v in extra.items() if v is not None},
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return getattr(transformers, model_name)(config)


def lora_trainer(trainer_cls, config_cls, tokenizer, dataset, output_dir, **config):
    """A trainer on a LoRA-wrapped tiny model whose adapter is moved off zero, so the policy differs from the reference
    (the policy with its adapter disabled). `config`: the config's fields (output_dir apart)."""
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    args = config_cls(output_dir=str(output_dir), report_to="none", bf16=False, max_steps=1, learning_rate=1e-3,
                      **config)
    trainer = trainer_cls(model=tiny_model(tokenizer), args=args, train_dataset=dataset, processing_class=tokenizer,
                          peft_config=lora)
    with torch.no_grad():
        g = torch.Generator().manual_seed(5)
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name and ".default." in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return trainer


def with_cpu_loss_scaler(trainer, init_scale: float, overflow_steps=(), growth_interval: int = 2000):
    """`trainer` (built with fp16=True) under fp16 autocast with a real `torch.amp.GradScaler` on CPU, as accelerate
    builds one on a GPU (on CPU it builds none), unscaled before the gradient norm; its gradient overflows (times inf)
    at the optimizer steps in `overflow_steps`."""
    assert trainer.accelerator.scaler is None  # accelerate on CPU: this stand-in is what it builds on CUDA
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    trainer.accelerator.native_amp = True
    weight = trainer.model.get_input_embeddings().weight
    weight.register_hook(lambda grad: grad * math.inf if trainer.state.global_step in overflow_steps else grad)
    return trainer


def run_module(module: str, *argv: str, env: dict | None = None) -> str:
    """`python -m MODULE ARGV` in this process, with `env` set for the call; returns what it printed. A fresh
    interpreter re-imported torch, transformers and TRL for each call, ~40% of a smoke run's CPU; conftest restores what
    the module itself changes in the environment and the loggers. Those modules end with `sys.exit(main())` or `main()`:
    a non-zero int returned fails, any other return is not a status, a failure raises."""
    main = importlib.import_module(module).main
    with mock.patch.dict(os.environ, env or {}), contextlib.redirect_stdout(io.StringIO()) as printed:
        returned = main(list(argv))
    assert not isinstance(returned, int) or returned == 0, printed.getvalue()[-3000:]
    return printed.getvalue()
