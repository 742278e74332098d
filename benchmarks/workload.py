"""The benchmark workload: a scaled-down Qwen2.5-shaped model, a local tokenizer, synthetic pairs, and the two trainers.

Nothing here touches the hub. The model is built from a config; the tokenizer is a WordLevel vocabulary of `t<i>` words
(one word = one token, so prompt and response lengths are exact); the pairs are random tokens. Stock and pruned sides
get identical model weights, the same dataset, seed and batch size; the stock side is TRL's own `DPOTrainer`.

With `Workload.model` (a local HF folder or a `builtin:` name) the model and its tokenizer are loaded from that folder
instead, and the pairs are real English text (the Python documentation every installation ships, `pydoc_data`) cut to
the length model's token counts under that tokenizer, in TRL's conversational format when the tokenizer has a chat
template (then the template's tokens count in the lengths, as they do for TRL): `text_rows`.

A trainer is driven step by step (`StepRunner`) the way `Trainer._inner_training_loop` drives it on one process:
`training_step` (TRL's forward, loss and backward), gradient clipping, `optimizer.step`, scheduler step, `zero_grad`,
`global_step += 1`. Both sides do exactly this, so the optimizer work is the same.
"""

from __future__ import annotations

import atexit
import copy
import logging
import math
import os
import platform
import random
import shutil
import tempfile
import warnings
from dataclasses import dataclass, field, replace

import torch

# Shape of the scaled-down model: Qwen2.5-0.5B (hidden 896, 24 layers, MLP 4864, 14 heads / 2 KV heads of 64, vocab
# 151936, tied embeddings) has its LM head at ~25-27% of forward FLOPs; this shape (MLP ratio 5, GQA 2:1, tied
# embeddings) keeps it at ~29% with an 8k vocabulary and a ~190-token row.
MODEL_SHAPE = dict(
    hidden_size=256,
    num_hidden_layers=4,
    intermediate_size=1280,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    tie_word_embeddings=True,
)
SPECIAL_TOKENS = ("<pad>", "</s>", "<unk>")


@dataclass(frozen=True)
class Workload:
    """What one benchmark cell trains on (identical on the stock and pruned sides)."""

    vocab_size: int = 8192
    prompt_len: int = 64
    response_len: int = 128
    batch_size: int = 4  # pairs per step (per_device_train_batch_size)
    num_batches: int = 4  # distinct batches, cycled
    seed: int = 0
    model_shape: dict = field(default_factory=lambda: dict(MODEL_SHAPE))
    shared_response: float = 0.0  # fraction of the chosen response the rejected one repeats at its start (near-copies)
    name: str = ""  # the workload's name in tables (e.g. "multi-turn")
    # Ragged lengths: a key of LENGTH_MODELS (then prompt_len / response_len are unused) and the factor its lengths
    # are scaled by (medians and truncation alike, so every ratio is kept).
    lengths: str = ""
    length_scale: float = 1.0
    # Std of the Gaussian noise added to the reference's weights (a copy of the policy's): with the reference equal to
    # the policy every DPO loss is log 2 whatever the log-probs, and loss agreement with stock would check nothing.
    reference_noise: float = 0.0
    # A local HF folder or a `builtin:` name (trl_pruned_dpo.demo.resolve_model): its weights and tokenizer, real text.
    # Empty: the bench model above (random weights, `t<i>` words).
    model: str = ""

    def label(self) -> str:
        vocab = os.path.basename(self.model.rstrip("/")).replace("builtin:", "") if self.model else (
            f"V{self.vocab_size // 1024}k")
        if self.lengths:
            m = length_model(self.lengths)
            cap = m.scaled(self.length_scale).max_total
            base = f"{self.lengths}x{self.length_scale:g}_{vocab}_max{cap}"
            base += f"_B{self.batch_size}" + (f"_copy{self.shared_response:g}" if self.shared_response else "")
        else:
            base = f"{vocab}_P{self.prompt_len}_R{self.response_len}_B{self.batch_size}"
        return f"{self.name}:{base}" if self.name and self.name != self.lengths else base

    def max_row(self) -> int:
        """The longest row (prompt + response, EOS included) the dataset can hold."""
        if self.lengths:
            return length_model(self.lengths).scaled(self.length_scale).max_total
        return self.prompt_len + self.response_len


@dataclass(frozen=True)
class LengthModel:
    """How long one pair's prompt and responses are: log-normal (the median and sigma of log-length), truncated.

    A draw, per pair: prompt P ~ exp(N(ln prompt_median, prompt_sigma^2)), chosen and rejected lengths C, R drawn
    independently from exp(N(ln response_median, response_sigma^2)) (EOS included), each at least 2 tokens. Then
    truncation, as TRL's `max_length` with `truncation_mode="keep_start"` would do it: the prompt is cut to
    `max_prompt`, each response to `max_total - P`. The responses share their first k tokens, k ~ Geometric with mean
    `shared_start_mean` (P(k = 0) = 1 / (1 + mean)), at most min(C, R) - 1: real dissimilar responses often open with
    the same word or two ("Sure", "I"), and that start is what `prune_common_prefix` can skip. `uniform`: every length
    is exactly its median (no raggedness; no shared start).
    """

    prompt_median: float
    prompt_sigma: float
    response_median: float
    response_sigma: float
    max_total: int
    max_prompt: int
    shared_start_mean: float = 0.0
    uniform: bool = False

    def scaled(self, scale: float) -> "LengthModel":
        """The same shape at `scale` times the lengths (medians and truncation; sigmas and the shared start kept)."""
        return replace(
            self, prompt_median=self.prompt_median * scale, response_median=self.response_median * scale,
            max_total=max(8, round(self.max_total * scale)), max_prompt=max(4, round(self.max_prompt * scale)),
        )

    def sample(self, rng: random.Random) -> tuple[int, int, int, int]:
        """(prompt, chosen, rejected, shared start) lengths of one pair, in tokens (responses with their EOS)."""

        def draw(median, sigma):
            return round(median) if self.uniform else round(rng.lognormvariate(math.log(median), sigma))

        prompt = min(max(draw(self.prompt_median, self.prompt_sigma), 2), self.max_prompt)
        room = self.max_total - prompt
        chosen, rejected = (min(max(draw(self.response_median, self.response_sigma), 2), room) for _ in range(2))
        shared = 0
        if self.shared_start_mean > 0 and not self.uniform:
            stop = 1.0 / (1.0 + self.shared_start_mean)  # geometric on {0, 1, ...} with this mean
            while rng.random() > stop:
                shared += 1
        return prompt, chosen, rejected, min(shared, min(chosen, rejected) - 1)


# Full-scale length models (tokens). Fitted so that a 20k-pair sample has (tests/test_benchmarks_smoke.py checks it):
#   ultrafeedback  median row (prompt + chosen) ~409, median prompt / median response ~0.42, tail truncated at 1024
#   hh             median row ~186, median prompt / median response ~2.15 (HH-RLHF: the dialogue so far is the prompt)
#   multiturn      median row ~512, median prompt / median response ~3 (a long chat history, a shorter answer)
#   short          uniform 32 + 32: no padding to remove and no shared start (the "never slower" sanity check)
LENGTH_MODELS = {
    "ultrafeedback": LengthModel(prompt_median=108, prompt_sigma=0.9, response_median=258, response_sigma=0.6,
                                 max_total=1024, max_prompt=512, shared_start_mean=1.0),
    "hh": LengthModel(prompt_median=112, prompt_sigma=0.8, response_median=52.5, response_sigma=0.8,
                      max_total=1024, max_prompt=768, shared_start_mean=1.0),
    "multiturn": LengthModel(prompt_median=364, prompt_sigma=0.5, response_median=121, response_sigma=0.6,
                             max_total=1024, max_prompt=768, shared_start_mean=1.0),
    "short": LengthModel(prompt_median=32, prompt_sigma=0.0, response_median=32, response_sigma=0.0,
                         max_total=64, max_prompt=32, uniform=True),
}


def length_model(name: str) -> LengthModel:
    """A key of LENGTH_MODELS, or `uniform:P+R`: every prompt exactly P tokens and every response R (EOS included),
    no shared start (the memory-against-length sweep, benchmarks/memory.py)."""
    if name.startswith("uniform:"):
        prompt, response = (int(x) for x in name.split(":", 1)[1].split("+"))
        return LengthModel(prompt_median=prompt, prompt_sigma=0.0, response_median=response, response_sigma=0.0,
                           max_total=prompt + response, max_prompt=prompt, uniform=True)
    return LENGTH_MODELS[name]


def quiet():
    """Silence the per-trainer warnings and progress bars that would drown the table."""
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    warnings.filterwarnings("ignore")
    for name in ("transformers", "trl", "datasets", "accelerate", "trl_pruned_dpo"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        import datasets

        datasets.disable_progress_bars()
    except ImportError:
        pass
    try:
        import transformers

        transformers.logging.set_verbosity_error()
    except ImportError:
        pass


_SCRATCH: list = []


def scratch_root() -> str:
    """One temporary folder per process, removed when the process exits (forked children that `os._exit` share their
    parent's), so runs leave no `bench_*` folders behind in the system temp directory."""
    if not _SCRATCH:
        root = tempfile.mkdtemp(prefix="bench_")
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        _SCRATCH.append(root)
    return _SCRATCH[0]


def scratch_dir(side: str) -> str:
    """An output folder for a benchmark trainer (it never saves), inside `scratch_root()`."""
    return tempfile.mkdtemp(prefix=f"{side}_", dir=scratch_root())


def build_tokenizer(vocab_size: int):
    """A WordLevel tokenizer over `t<i>` words: exactly `vocab_size` ids, one token per word."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"t{i}": i for i in range(len(SPECIAL_TOKENS), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def resolve_model_path(name: str) -> str:
    """A local folder for `name`: a `builtin:` name through the package's own resolver, anything else unchanged."""
    from trl_pruned_dpo.demo import resolve_model

    return resolve_model(name)


def load_tokenizer(w: Workload):
    """The workload's tokenizer: the model folder's own with `w.model`, else the `t<i>` WordLevel one."""
    if not w.model:
        return build_tokenizer(w.vocab_size)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(w.model))


def build_dataset(w: Workload):
    """Random pairs: prompt length in [3P/4, P], each response length in [3R/4, R] (then TRL appends EOS)."""
    from datasets import Dataset

    rng = random.Random(w.seed)
    if w.model:
        return Dataset.from_dict(text_rows(w, rng, load_tokenizer(w)))
    lo_id = len(SPECIAL_TOKENS)

    def words(n):
        return " ".join(f"t{rng.randrange(lo_id, w.vocab_size)}" for _ in range(n))

    rows = {"prompt": [], "chosen": [], "rejected": []}
    if w.lengths:
        return Dataset.from_dict(_ragged_rows(w, rng, words))
    for _ in range(w.batch_size * w.num_batches):
        rows["prompt"].append(words(rng.randint(3 * w.prompt_len // 4, w.prompt_len)))
        # The leading space keeps prompt + completion a word boundary, so TRL's prompt/completion split is exact.
        chosen = words(rng.randint(3 * w.response_len // 4, w.response_len) - 1).split()
        rejected = words(rng.randint(3 * w.response_len // 4, w.response_len) - 1).split()
        common = int(w.shared_response * len(chosen))
        rejected = chosen[:common] + rejected[common:]  # near-copies: the same start, then their own tokens
        rows["chosen"].append(" " + " ".join(chosen))
        rows["rejected"].append(" " + " ".join(rejected))
    return Dataset.from_dict(rows)


def _ragged_rows(w: Workload, rng: random.Random, words) -> dict:
    """Pairs with lengths drawn from `LENGTH_MODELS[w.lengths]` at `w.length_scale`; near-copies (`shared_response`)
    repeat that fraction of the chosen response at the rejected one's start instead of the model's shared start."""
    model = length_model(w.lengths).scaled(w.length_scale)
    rows = {"prompt": [], "chosen": [], "rejected": []}
    for _ in range(w.batch_size * w.num_batches):
        prompt, n_chosen, n_rejected, shared = model.sample(rng)
        chosen, rejected = words(n_chosen - 1).split(), words(n_rejected - 1).split()  # TRL appends the EOS
        if w.shared_response:
            shared = int(w.shared_response * len(chosen))
        shared = max(min(shared, len(chosen) - 1, len(rejected) - 1), 0)  # each response keeps a token of its own
        rejected = chosen[:shared] + rejected[shared:]
        rows["prompt"].append(words(prompt))
        rows["chosen"].append(" " + " ".join(chosen))
        rows["rejected"].append(" " + " ".join(rejected))
    return rows


_CORPUS: dict = {}


def english_corpus_ids(tokenizer) -> list[int]:
    """The Python documentation's help topics (`pydoc_data.topics`, in every CPython installation), tokenized once per
    tokenizer: ~450k characters of English prose with some code. Lines made only of markup (`****`, `====`) dropped."""
    key = (tokenizer.name_or_path, len(tokenizer))
    if key not in _CORPUS:
        from pydoc_data.topics import topics

        lines = (line for name in sorted(topics) for line in topics[name].splitlines())
        text = "\n".join(line for line in lines if not line.strip() or line.strip().strip("*=-~^") != "")
        _CORPUS[key] = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    return _CORPUS[key]


def text_rows(w: Workload, rng: random.Random, tokenizer) -> dict:
    """Real-text pairs at the length model's token counts, as TRL will tokenize them.

    Per pair: (P, C, R, k) from `length_model(w.lengths)` at `w.length_scale`; the prompt is a window of the corpus,
    chosen and rejected two other windows, the rejected one repeating the chosen one's first k tokens (the shared start
    `prune_common_prefix` skips; `w.shared_response` overrides k as a fraction of C). With a chat template the pair
    is conversational (a user message, an assistant message each) and P, C, R count TRL's tokens: the prompt rendered
    with its generation prompt, each completion with its end-of-turn tokens. Without one, plain text (TRL appends EOS).
    A window's length is adjusted until the rendered count is the target (BPE merges at a window's edges can move it by
    a token); a target below the template's own tokens gets a one-token message.
    """
    corpus = english_corpus_ids(tokenizer)
    model = length_model(w.lengths).scaled(w.length_scale)
    chat = bool(getattr(tokenizer, "chat_template", None))

    def render(messages, generation_prompt=False):
        if chat:
            return tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt,
                                                 return_dict=False)
        text = "".join(m["content"] for m in messages) + ("" if generation_prompt else tokenizer.eos_token)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def window(start, n, head=()):
        return tokenizer.decode(list(head) + corpus[start:start + n]).strip() or "."

    def fit(target, count, head=()):
        """A text whose `count` is `target` (or as close as 6 adjustments get): a window at a random start."""
        n = max(target - len(head), 1)
        start = rng.randrange(0, len(corpus) - 4 * max(n, 64))
        for _ in range(6):
            text = window(start, n, head)
            got = count(text)
            if got == target or (n == 1 and got > target):
                break
            n = max(n + target - got, 1)
        return text

    def message(role, text):
        return [{"role": role, "content": text}] if chat else [{"role": role, "content": " " + text}]

    rows = {"prompt": [], "chosen": [], "rejected": []}
    for _ in range(w.batch_size * w.num_batches):
        n_prompt, n_chosen, n_rejected, shared = model.sample(rng)
        prompt = message("user", fit(n_prompt, lambda t: len(render(message("user", t), True))))
        prompt_ids = render(prompt, True)

        def completion_count(text):
            return len(render(prompt + message("assistant", text))) - len(prompt_ids)

        chosen = fit(n_chosen, completion_count)
        if w.shared_response:
            shared = int(w.shared_response * n_chosen)
        start = tokenizer(chosen, add_special_tokens=False)["input_ids"][:max(min(shared, n_rejected - 1), 0)]
        rejected = fit(n_rejected, completion_count, head=start)
        if chat:
            rows["prompt"].append(prompt)
            rows["chosen"].append(message("assistant", chosen))
            rows["rejected"].append(message("assistant", rejected))
        else:
            rows["prompt"].append(prompt[0]["content"])
            rows["chosen"].append(" " + chosen)
            rows["rejected"].append(" " + rejected)
    return rows


def build_model(w: Workload, dtype=torch.float32, *, attn: str | None = None, device: str = "cpu"):
    """The cell's model, random weights from `w.seed`: the one builder of every benchmark (CPU harness and GPU check).

    `attn`: the attention implementation (None: transformers' default). `device`: where the weights are created; the
    GPU check creates them on CUDA, so a 0.5B model is never materialised on the host first. With `w.model`: that
    folder's weights (its config's own attention implementation unless `attn`).
    """
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if w.model:
        extra = {"attn_implementation": attn} if attn else {}
        model = AutoModelForCausalLM.from_pretrained(resolve_model_path(w.model), dtype=dtype, **extra)
        return model.to(device)

    config = Qwen2Config(
        vocab_size=w.vocab_size,
        max_position_embeddings=max(2048, 2 * w.max_row()),
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
        attn_implementation=attn,
        **w.model_shape,
    )
    torch.manual_seed(w.seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    return model.to(dtype)


# LoRA's targets with `lora_r` (the real-model study's: evaluation/real_run.py, ModelSpec).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_trainer(
    side: str,
    w: Workload,
    model,
    *,
    precompute: bool,
    checkpointing: bool,
    pruning: dict | None = None,
    device: str = "cpu",
    bf16: bool = False,
    output_dir: str | None = None,
    ref_model=None,
    learning_rate: float = 1e-6,
    dataset=None,
    lora_r: int = 0,
    training: dict | None = None,
):
    """`side` is "stock" (TRL's `DPOTrainer` + `DPOConfig`) or "pruned" (`PrunedDPOTrainer` + `PrunedDPOConfig`).

    `model` is this side's own copy; the reference is `ref_model`, else a (perturbed) deep copy of it (live
    reference), or none with `precompute_ref_log_probs=True` (then TRL precomputes with the policy itself, as it does
    for users). `dataset`: the pairs (default: `build_dataset(w)`). `lora_r` > 0: a LoRA adapter of that rank on every
    projection (the real-model study's), the reference being the policy with its adapter off (TRL: no copy).
    `training`: further `DPOConfig` fields, the same on both sides (they override the benchmark's own, e.g.
    `gradient_accumulation_steps`, `optim`, `loss_type`, `logging_steps`: benchmarks/passes.py).
    """
    from trl import DPOConfig, DPOTrainer

    if side == "stock":
        config_cls, trainer_cls, extra = DPOConfig, DPOTrainer, {}
    elif side == "pruned":
        from trl_pruned_dpo import PrunedDPOConfig, PrunedDPOTrainer

        config_cls, trainer_cls, extra = PrunedDPOConfig, PrunedDPOTrainer, dict(pruning or {})
    else:
        raise ValueError(f"side must be 'stock' or 'pruned', got {side!r}")

    fields = dict(
        output_dir=output_dir or scratch_dir(side),
        per_device_train_batch_size=w.batch_size,
        max_length=None,  # no truncation: the response lengths are what the cell says
        gradient_checkpointing=checkpointing,
        precompute_ref_log_probs=precompute,
        bf16=bf16,
        fp16=False,
        use_cpu=device == "cpu",
        learning_rate=learning_rate,
        seed=w.seed,
        data_seed=w.seed,
        report_to=[],
        logging_steps=10**9,
        save_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    args = config_cls(**{**fields, **(training or {}), **extra})
    if side == "pruned":
        from trl_pruned_dpo.config import uses_pruned_forward

        # nothing pruned or saved (the `none` row): time the plugin's forward, not the TRL path it delegates to
        trainer_cls = PrunedDPOTrainer if uses_pruned_forward(args) else _plugin_forward_trainer()
    model = model.to(device)
    peft = {}
    if lora_r:
        from peft import LoraConfig

        peft = dict(peft_config=LoraConfig(r=lora_r, lora_alpha=2 * lora_r, lora_dropout=0.0, task_type="CAUSAL_LM",
                                           target_modules=list(LORA_TARGETS)))
    if precompute or lora_r:
        ref_model = None
    elif ref_model is None:
        ref_model = perturbed_copy(model, w.reference_noise, w.seed)
    return trainer_cls(
        model=model,
        ref_model=ref_model.to(device) if ref_model is not None else None,
        args=args,
        train_dataset=build_dataset(w) if dataset is None else dataset,
        processing_class=load_tokenizer(w),
        **peft,
    )


def weight_sharing_copy(model):
    """A copy of `model`'s modules and config whose parameters are `model`'s own tensors (buffers copied).

    The `--model` timing process holds one trainer per setting side by side; seven private copies of a 135M model with
    its reference and Adam state would take ~19 GB. Each trainer gets its own module tree and config (the plugin
    repoints its config's attention, workload stock's must stay stock) over one set of weights, and one optimizer
    (`StepRunner(optimizer=)`) at learning rate 0, so the weights every trainer sees stay identical while each step
    still runs the optimizer's arithmetic.
    """
    return copy.deepcopy(model, memo={id(p): p for p in model.parameters()})


def perturbed_copy(model, noise: float, seed: int):
    """A deep copy of `model` (the live reference), its weights plus N(0, noise^2) noise drawn from `seed` (the same
    reference on every side of a comparison)."""
    ref = copy.deepcopy(model)
    if noise > 0:
        generator = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for p in ref.parameters():
                p.add_(torch.randn(p.shape, generator=generator, dtype=torch.float32).to(p) * noise)
    return ref


def _plugin_forward_trainer():
    """The `none` row's trainer: the plugin's own forward with nothing pruned (compacted head, masks at identity).

    With pruning off, `PrunedDPOTrainer` is TRL's own path (a drop-in); the benchmark's `none` row measures the
    plugin's machinery instead, so that "vs none" isolates what each pruning buys: the trainer's public hook
    `always_pruned_forward` (the per-token reference columns, the collator and the pruned loss, as with pruning on).
    """
    from trl_pruned_dpo import PrunedDPOTrainer

    class PluginForwardAtIdentity(PrunedDPOTrainer):
        always_pruned_forward = True

    return PluginForwardAtIdentity


class StepRunner:
    """Drives one trainer step by step, as `Trainer._inner_training_loop` does on a single process."""

    def __init__(self, trainer, max_steps: int = 10**6, optimizer=None):
        """`optimizer`: a torch optimizer shared with other runners over the same weights (workload.weight_sharing_copy);
        None: the trainer creates its own, as `Trainer.train` does."""
        self.trainer = trainer
        args = trainer.args
        if args.activation_checkpointing:  # what `Trainer.train` does before the loop
            kwargs = dict(args.activation_checkpointing_kwargs or {})
            trainer.model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None)
        trainer.optimizer = optimizer
        trainer.create_optimizer()
        self.optimizer = trainer.optimizer  # unwrapped (accelerate wraps it below)
        self.model, trainer.optimizer = trainer.accelerator.prepare(trainer.model, trainer.optimizer)
        trainer.model_wrapped = self.model
        trainer.create_scheduler(num_training_steps=max_steps)
        trainer.current_gradient_accumulation_steps = 1
        trainer.state.global_step = 0
        # Batches come from the trainer's own dataloader, as in `train()`: fetching and collating (TRL's collator; the
        # pruned side adds its columns) is part of the step. Same seed and dataset: both sides see the same batches.
        self.loader = trainer.get_train_dataloader()
        self._iterator = iter(self.loader)
        self.last_batch = None
        self.last_grad_norm = None  # the total gradient norm before clipping (a tensor: reading it is left to callers)

    def _next_batch(self):
        try:
            return next(self._iterator)
        except StopIteration:
            self._iterator = iter(self.loader)
            return next(self._iterator)

    def step(self):
        """One optimizer step; returns the (detached) loss."""
        t = self.trainer
        batch = self._next_batch()
        self.last_batch = batch
        loss = t.training_step(self.model, batch)
        if t.args.max_grad_norm and t.args.max_grad_norm > 0:
            self.last_grad_norm = t.accelerator.clip_grad_norm_(self.model.parameters(), t.args.max_grad_norm)
        t.optimizer.step()
        t.lr_scheduler.step()
        self.model.zero_grad()
        t.state.global_step += 1
        return loss


def layout_tokens(batch, scored: torch.Tensor | None = None) -> dict:
    """The real (non-padding) tokens a policy forward of this collated batch must execute, per layout, from the batch
    alone (and the trainer's scored mask when it prunes positions or prefixes; None: every response position).

    `padded`: TRL's batch, rows padded to the longest (every real token of every row).
    `rows`: one row per response, each run up to its last scored token (what the unshared forward needs, its labels
    read from its own input). `rows_packed`: the same rows with pre-shifted labels, one position fewer per row (the
    token after a row's last needed position is only a label), as a packed padding-free forward runs them.
    `shared`: per pair, the s - 1 positions before the last token that chosen and rejected share (prompt and common
    response start) once, then each branch's own positions, up to the position predicting its last scored token
    (labels pre-shifted: the last token is only a label), as in docs/method.md's packed layout.
    Padding of a forward = executed - real tokens of its layout. Rows are right-padded (TRL's collator).
    """
    ids, valid = batch["input_ids"].cpu(), batch["attention_mask"].cpu().bool()
    if scored is None:
        scored = batch["completion_mask"].cpu()[:, 1:].bool()
    scored = scored.cpu().bool()
    cols = torch.arange(1, scored.size(1) + 1)
    need = (scored.long() * cols).amax(dim=1) if scored.numel() else torch.zeros(ids.size(0), dtype=torch.long)
    pairs = ids.size(0) // 2
    agree = (ids[:pairs] == ids[pairs:]) & (valid[:pairs] == valid[pairs:]) & valid[:pairs]
    common = agree.long().cumprod(dim=1).sum(dim=1)
    need_w, need_l = need[:pairs], need[pairs:]
    shared = torch.minimum((common - 1).clamp(min=0), torch.maximum(need_w, need_l))
    return dict(
        padded=int(valid.sum()),
        rows=int((need + (need > 0).long()).sum()),
        rows_packed=int(need.sum()),
        shared=int((shared + (need_w - shared).clamp(min=0) + (need_l - shared).clamp(min=0)).sum()),
    )


def machine_info(device: str, threads: int) -> dict:
    import accelerate
    import transformers
    import trl

    import trl_pruned_dpo

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = dict(
        cpu=cpu, cpu_count=os.cpu_count(), torch_threads=threads, python=platform.python_version(),
        platform=platform.platform(), torch=torch.__version__, trl=trl.__version__,
        transformers=transformers.__version__, accelerate=accelerate.__version__,
        trl_pruned_dpo=getattr(trl_pruned_dpo, "__version__", "?"), device=device,
    )
    if device != "cpu":
        info["gpu"] = torch.cuda.get_device_name()
    try:
        import subprocess

        found = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=os.path.dirname(__file__)
        )
        # Never an empty field: a record whose commit git could not give says why (its first line of stderr).
        info["git"] = found.stdout.strip() or "unknown: " + (found.stderr.strip().splitlines() or ["no output"])[0]
    except OSError as error:
        info["git"] = f"unknown: {error}"
    return info
