"""Workloads nobody wrote by hand: each case draws a dataset (standard, implicit-prompt or conversational rows of
random length, shared prompts, shared response starts, identical answers, characters outside the vocabulary), a
model family (packed, checked or falling back), a loss and the DPOConfig fields that change the batch (max_length and
truncation side, batch size, accumulation, checkpointing, a precomputed reference, LoRA, evaluation), then trains two
steps with stock `DPOTrainer` and with `PrunedDPOTrainer` under one of the exact settings (the defaults, the exact
preset, a merged step of any budget, one saving alone). The contract (docs/parity.md): the same outcome as stock
(both train, or both raise the same error; nothing drawn here is one of the plugin's refusals), and when both train,
the same logged history (1e-4 relative; a key the common prefix moves is read under its new name only) and the same
update of every trained parameter (plain SGD, so the update is the clipped gradient:
1e-4 of the tensor's largest change, plus a floor of 1e-6 of a gradient entry and 4 float32 ulps of
the tensor's largest weight: an update is read as the difference of two weights).

CI runs `CI_CASES` draws; `python tests/test_workload_fuzz.py FIRST COUNT` runs any range and prints one line per case
(the last run, quoted in docs/parity.md: tests/workload_fuzz_0_293.txt). With `--wide` the family is drawn from every
family the exactness matrix holds and every family outside it that the last survey found exact
(tests/family_survey.jsonl), and the tokenizer from the character one and a merging one (BPE, <bos> first: a prompt's
tokens need not be a prefix of prompt + answer's); the rest of each draw is unchanged. With `--estimators` the plugin
also gets estimators (position, branch, prefix pruning, `auto`); an estimator's step is not stock's, so the contract
there is: it trains where stock trains, its logged losses are finite where stock's are, and its evaluation before
training (never pruned) is stock's."""

import copy
import functools
import math
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from trl import DPOConfig, DPOTrainer

sys.path.insert(0, str(Path(__file__).parent))
from test_exactness_matrix import CONFIGS, _other, _seeded_without_dropout, tiny_family  # noqa: E402
from tiny import QUIET_TRAINING, bpe_tokenizer, char_tokenizer  # noqa: E402
from trl_pruned_dpo import PrunedDPOConfig, PrunedDPOTrainer  # noqa: E402
from trl_pruned_dpo.config import PAIR_DIFFERENCE_LOSSES  # noqa: E402

CI_CASES = 20
LEARNING_RATE = 0.5  # plain SGD: an update is LEARNING_RATE times the (clipped) gradient
FAMILIES = {  # name -> builder; packed, checked on the first batch, or falling back
    "llama": lambda tok: tiny_family("llama", tok),
    "qwen2-sliding-layers": lambda tok: tiny_family("qwen2-sliding-layers", tok),
    "mistral-window-7": lambda tok: tiny_family("mistral-window-7", tok),
    "gemma2": lambda tok: tiny_family("gemma2", tok),
    "gpt2": lambda tok: tiny_family("gpt2", tok),
    "phi": lambda tok: tiny_family("phi", tok),
    "qwen3_moe": lambda tok: tiny_family("qwen3_moe", tok),
    "gemma3_text": lambda tok: tiny_family("gemma3_text", tok),
    "gpt_oss": lambda tok: tiny_family("gpt_oss", tok),
    "deepseek_v3": lambda tok: tiny_family("deepseek_v3", tok),
    "olmo2": lambda tok: tiny_family("olmo2", tok),
    "opt": lambda tok: tiny_family("opt", tok),
    "gpt_neo": lambda tok: _other("gpt_neo", tok, num_layers=2, num_heads=4, window_size=6,
                                  attention_types=[[["global", "local"], 1]]),
}


@functools.cache
def wide_families() -> dict:
    """FAMILIES, every row of the exactness matrix, and every family outside it that tests/family_survey.py last found
    exact (packed, or falling back in one line), built as the survey builds them."""
    import json

    from family_survey import tiny_config

    pool = {**FAMILIES, **{name: (lambda tok, name=name: tiny_family(name, tok)) for name in CONFIGS}}
    for line in (Path(__file__).parent / "family_survey.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["outcome"] in ("packed", "fell back"):
            pool[record["family"]] = lambda tok, name=record["family"]: _seeded_without_dropout(tiny_config(name, tok))
    return pool


LOSSES = [["sigmoid"], ["hinge"], ["ipo"], ["robust"], ["exo_pair"], ["nca_pair"], ["bco_pair"], ["sppo_hard"],
          ["aot"], ["aot_unpaired"], ["apo_zero"], ["apo_down"], ["discopop"], ["sigmoid_norm"], ["sigmoid", "sft"],
          ["sigmoid", "bco_pair", "sft"]]
ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 .,:;+-=?!"
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};{% endfor %}"
                 "{% if add_generation_prompt %}a:{% endif %}")


def _text(g, low, high):
    n = int(torch.randint(low, high + 1, (1,), generator=g))
    chars = [ALPHABET[int(i)] for i in torch.randint(0, len(ALPHABET), (n,), generator=g)]
    if n and float(torch.rand(1, generator=g)) < 0.1:
        chars[int(torch.randint(0, n, (1,), generator=g))] = "é"  # outside the vocabulary: <unk>
    return "".join(chars)


def _rows(g, form, n):
    pool = [_text(g, 1, 40) for _ in range(3)]
    repeat = float(torch.rand(1, generator=g)) < 0.4  # several pairs of one prompt
    rows = []
    for _ in range(n):
        prompt = pool[int(torch.randint(0, 3, (1,), generator=g))] if repeat else _text(g, 1, 40)
        start = _text(g, 0, 10)
        chosen, rejected = start + _text(g, 0, 25), start + _text(g, 0, 25)
        if float(torch.rand(1, generator=g)) < 0.1:
            rejected = chosen
        if form == "conversational":
            turns = [{"role": "user", "content": prompt}]
            if float(torch.rand(1, generator=g)) < 0.3:  # a system line and an earlier exchange
                turns = [{"role": "system", "content": _text(g, 0, 8)}, {"role": "user", "content": _text(g, 1, 8)},
                         {"role": "assistant", "content": _text(g, 0, 8)}] + turns
            rows.append({"prompt": turns,
                         "chosen": [{"role": "assistant", "content": chosen}],
                         "rejected": [{"role": "assistant", "content": rejected}]})
        elif form == "implicit":
            rows.append({"chosen": prompt + chosen, "rejected": prompt + rejected})
        else:
            rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return rows


def _pick(g, options):
    return options[int(torch.randint(0, len(options), (1,), generator=g))]


TOKENIZERS = {"char": char_tokenizer, "bpe": bpe_tokenizer}


def draw(seed: int, families: dict = FAMILIES, tokenizers: tuple = ("char",), estimators: bool = False) -> dict:
    """One case: what both trainers get (`stock`), what only the plugin gets (`plugin`), and how it is built. With
    `estimators`, the plugin also gets estimators (drawn after everything else, so the rest of the case is the same)
    and both trainers evaluate before training."""
    g = torch.Generator().manual_seed(seed)
    form = _pick(g, ["standard", "standard", "implicit", "conversational"])
    setting = _pick(g, ["defaults", "exact preset", "merged, any budget", "merged off", "share_prompt only",
                        "padding_free only"])
    # the exact preset's common prefix is exact for the losses of a pair's difference only (docs/method.md)
    loss = _pick(g, [x for x in LOSSES if set(x) <= PAIR_DIFFERENCE_LOSSES] if setting == "exact preset" else LOSSES)
    stock = dict(loss_type=loss, beta=_pick(g, [0.1, 0.5]),
                 max_length=_pick(g, [None, 1024, int(torch.randint(12, 61, (1,), generator=g)),
                                      int(torch.randint(3, 12, (1,), generator=g))]),
                 truncation_mode=_pick(g, ["keep_start", "keep_end"]),
                 per_device_train_batch_size=int(torch.randint(1, 6, (1,), generator=g)),
                 gradient_accumulation_steps=int(torch.randint(1, 4, (1,), generator=g)),
                 gradient_checkpointing=bool(torch.rand(1, generator=g) < 0.3),
                 precompute_ref_log_probs=bool(torch.rand(1, generator=g) < 0.2))
    if len(loss) > 1:
        stock["loss_weights"] = [1.0] + [0.5] * (len(loss) - 1)
    if float(torch.rand(1, generator=g)) < 0.2:
        stock["pad_to_multiple_of"] = 8
    if float(torch.rand(1, generator=g)) < 0.1:
        stock.update(sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5)
    if loss[0] in ("robust", "exo_pair"):
        stock["label_smoothing"] = 0.1
    if loss == ["sigmoid"] and float(torch.rand(1, generator=g)) < 0.4:
        # the common prefix refuses WPO weights and f-divergences (config.py): only ld_alpha with the exact preset
        key = _pick(g, ["ld_alpha"] if setting == "exact preset" else ["use_weighting", "ld_alpha", "f_divergence_type"])
        stock[key] = {"use_weighting": True, "ld_alpha": 0.5, "f_divergence_type": "alpha_divergence"}[key]
    plugin = {}
    if setting == "exact preset":
        plugin["prune_common_prefix"] = True
    elif setting == "merged, any budget":
        plugin["step_token_budget"] = _pick(g, [10**9, int(torch.randint(16, 200, (1,), generator=g))])
    elif setting == "merged off":
        plugin["step_token_budget"] = 0
    elif setting == "share_prompt only":
        plugin["padding_free"] = False
    elif setting == "padding_free only":
        plugin["share_prompt"] = False
    family = _pick(g, list(families))
    case = dict(seed=seed, form=form, rows=int(torch.randint(4, 13, (1,), generator=g)), family=family,
                lora=bool(torch.rand(1, generator=g) < 0.2), evaluate=bool(torch.rand(1, generator=g) < 0.3),
                stock=stock, plugin=plugin, data_seed=int(torch.randint(0, 2**31, (1,), generator=g)),
                tokenizer=_pick(g, list(tokenizers)))  # drawn last: the draws before it do not depend on the pool
    if estimators:
        case.update(estimators=True, evaluate=True)
        plugin.update(_estimator_fields(g))
    return case


def _estimator_fields(g) -> dict:
    """At least one estimator on: position, branch (paired or independent) and prefix pruning, `auto` among them, the
    reference pruned or exact."""
    fields = {}
    while not fields:
        if float(torch.rand(1, generator=g)) < 0.5:
            fields["position_keep_prob"] = _pick(g, [0.5, 0.9, "auto"])
        if float(torch.rand(1, generator=g)) < 0.5:
            fields.update(branch_keep_prob=_pick(g, [0.3, 0.5, "auto"]),
                          branch_sampling=_pick(g, ["paired", "independent"]))
        if float(torch.rand(1, generator=g)) < 0.4:
            fields.update(prefix_prune_prob=0.5, prefix_min_ratio=_pick(g, [0.2, 0.5]))
    if float(torch.rand(1, generator=g)) < 0.3:
        fields["prune_reference"] = False
    return fields


def _outcome(case, trainer_cls, config_cls, extra, out, dtype=torch.float32):
    tokenizer = TOKENIZERS[case["tokenizer"]]()
    tokenizer.chat_template = CHAT_TEMPLATE
    g = torch.Generator().manual_seed(case["data_seed"])
    train, held_out = Dataset.from_list(_rows(g, case["form"], case["rows"])), Dataset.from_list(_rows(g, case["form"], 5))
    model = wide_families()[case["family"]](tokenizer).to(dtype)
    if dtype != torch.float32:  # torch's grouped matmul of MoE experts takes no float64
        model.config._experts_implementation = "eager"
    ref_model, peft_config = copy.deepcopy(model), None
    with torch.no_grad():  # the policy away from the reference: log-ratios are not zero
        gen = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    if case["lora"]:
        from peft import LoraConfig
        ref_model, peft_config = None, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    try:
        args = config_cls(output_dir=str(out), **{**QUIET_TRAINING, "learning_rate": LEARNING_RATE, "optim": "sgd",
                                                  "per_device_eval_batch_size": 3, **case["stock"], **extra})
        trainer = trainer_cls(model=model, ref_model=ref_model, args=args, train_dataset=train,
                              eval_dataset=held_out if case["evaluate"] else None, processing_class=tokenizer,
                              peft_config=peft_config)
        if case["lora"]:
            with torch.no_grad():  # the adapter off zero: the policy differs from its adapter-off reference
                gen = torch.Generator().manual_seed(5)
                for name, p in trainer.model.named_parameters():
                    if "lora_B" in name:
                        p.add_(0.1 * torch.randn(p.shape, generator=gen))
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
        first = trainer.evaluate() if case.get("estimators") else {}  # never pruned: stock's, at the same weights
        trainer.train()
        metrics = trainer.evaluate() if case["evaluate"] else {}
    except Exception as error:  # noqa: BLE001 - the outcome *is* the exception
        return {"raised": type(error), "message": (str(error).splitlines() or [""])[0][:200],
                "constructed": "trainer" in locals()}
    update = {n: p.detach() - before[n] for n, p in trainer.model.named_parameters() if n in before}
    history = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    return {"history": history, "eval": metrics, "first_eval": first, "update": update,
            "size": {n: float(w.abs().max()) for n, w in before.items()},
            "packed": getattr(trainer, "forward_choice", None)}


def _layout(plugin) -> str:
    choice = plugin["packed"]
    return "packed" if choice is not None and choice.packed else "not packed"


def _eval_gaps(stock_eval: dict, plugin_eval: dict, label: str) -> list:
    """(gap in units of 1e-4 relative + 1e-5 absolute, what) for each evaluated value of stock's."""
    return [(abs(plugin_eval.get(key, float("inf")) - value) / (1e-4 * abs(value) + 1e-5),
             f"{label} {key}: {plugin_eval.get(key, 'not logged')} against stock's {value}")
            for key, value in stock_eval.items()
            if not key.endswith(("runtime", "per_second", "_time")) and isinstance(value, float)]  # timings apart


def _judge_estimated(stock, plugin) -> tuple[str, str, float]:
    """An estimator's step is not stock's (tests/test_unbiased.py checks its expectation): here it must train where
    stock trains, every logged loss finite where stock's is, and evaluate as stock does (never pruned) before
    training, at the same weights."""
    for step, (hs, hp) in enumerate(zip(stock["history"], plugin["history"])):
        if math.isfinite(hs["loss"]) and not math.isfinite(hp["loss"]):
            return "differs", f"step {step}: loss {hp['loss']} where stock's is {hs['loss']}", float("inf")
    worst, what = max(_eval_gaps(stock["first_eval"], plugin["first_eval"], "evaluation before training"),
                      default=(0.0, ""))
    if worst > 1:
        return "differs", what, worst
    return "trained", _layout(plugin), worst


def _judge(stock, plugin, dtype, estimators=False) -> tuple[str, str, float]:
    """(verdict, detail, worst): `worst` is the largest gap of a trained value in units of its tolerance (1e-4
    relative + 1e-5 absolute for a logged float; for an update, 1e-4 of the tensor's largest change + a floor + 4 ulps
    of its largest weight); above 1 the verdict is "differs", naming that value."""
    if "raised" in stock:
        # the same error, or a narrower one saying more (EmptyTrainingSet is a ValueError: stock's sampler raises one)
        if "raised" in plugin and issubclass(plugin["raised"], stock["raised"]):
            return "both raised", f"{plugin['raised'].__name__}: {plugin['message']}", 0.0
        return "differs", (f"stock raised {stock['raised'].__name__}: {stock['message']}; plugin: "
                           f"{plugin['raised'].__name__ if 'raised' in plugin else 'trained'}"), float("inf")
    if "raised" in plugin:
        if issubclass(plugin["raised"], ValueError) and not plugin["constructed"]:
            return "refused", plugin["message"], float("inf")
        return "crashed", f"{plugin['raised'].__name__}: {plugin['message']}", float("inf")
    if len(stock["history"]) != len(plugin["history"]) or stock["update"].keys() != plugin["update"].keys():
        return "differs", "logged steps or trained parameters differ", float("inf")
    if estimators:
        return _judge_estimated(stock, plugin)
    gaps = []  # (gap in units of its tolerance, what)
    for step, (hs, hp) in enumerate(zip(stock["history"], plugin["history"])):
        for key, value in hs.items():
            if key in ("epoch", "step", "learning_rate") or not isinstance(value, float):
                continue
            if key not in hp and f"prune/{key}_after_common_prefix" in hp:
                continue  # moved under the common prefix: it covers the responses after it (docs/metrics.md)
            if key not in hp:
                return "differs", f"step {step}: {key} not logged", float("inf")
            both_nan = hp[key] != hp[key] and value != value
            gaps.append((0.0 if both_nan else abs(hp[key] - value) / (1e-4 * abs(value) + 1e-5),
                         f"step {step} {key}: {hp[key]} against stock's {value}"))
    gaps += _eval_gaps(stock["eval"], plugin["eval"], "eval")
    # a floor of 1e-6 of a gradient entry: float32 round-off of an O(1) loss's gradient (where the exact gradient is
    # 0, e.g. a batch whose answers are identical after truncation, stock's is round-off of that size; the plugin's
    # may be 0)
    floor = max(1e-7 * max(float(u.abs().max()) for u in stock["update"].values()), 1e-6 * LEARNING_RATE)
    for name, u in stock["update"].items():
        gap = float((plugin["update"][name] - u).abs().max())
        ulps = 4 * torch.finfo(dtype).eps * stock["size"][name]  # an update is a difference of two weights
        gaps.append((gap / (1e-4 * float(u.abs().max()) + floor + ulps),
                     f"update of {name}: {gap:.3g} off (largest change {float(u.abs().max()):.3g})"))
    worst, what = max(gaps, default=(0.0, ""))
    if worst > 1:
        return "differs", what, worst
    return "same", _layout(plugin), worst


def _both(case, dtype):
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stock = _outcome(case, DPOTrainer, DPOConfig, {}, Path(tmp) / "stock", dtype)
        plugin = _outcome(case, PrunedDPOTrainer, PrunedDPOConfig, case["plugin"], Path(tmp) / "plugin", dtype)
    return _judge(stock, plugin, dtype, case.get("estimators", False))


def compare(case) -> tuple[str, str]:
    """("same" | "trained" | "refused" | "both raised" | "differs" | "crashed", detail) for one case ("trained": an
    estimator case that met `_judge_estimated`).

    Trained values that differ in float32 get a second look with the model in float64: round-off shrinks there, a
    wrong mask or weight does not. A loss near a stationary point of its margin (DiscoPOP's blend has one) turns
    float32 round-off of the margin (~1e-7) into a relative change of its gradient of 1e-3 and more, in stock's own
    arithmetic as much as in the plugin's. TRL's head computes log-probabilities in float32 whatever the model's
    dtype, so float64 does not remove it: the case counts as the same when, in float64, every value is within its
    tolerance and the worst gap shrank at least 100 times."""
    verdict, detail, worst = _both(case, torch.float32)
    if verdict != "differs" or worst == float("inf"):
        return verdict, detail
    verdict64, detail64, worst64 = _both(case, torch.float64)
    if verdict64 == "same" and worst64 <= worst / 100:
        return "same", f"{detail64}; float32 round-off: {detail}, {worst / max(worst64, 1e-30):.2g}x less in float64"
    return "differs", f"{detail}; in float64: {detail64} ({worst64:.3g} of its tolerance)"


@pytest.mark.parametrize("seed", range(CI_CASES))
def test_a_drawn_workload_trains_as_stock_does(seed):
    case = draw(seed)
    verdict, detail = compare(case)
    assert verdict in ("same", "both raised"), (case, verdict, detail)



def test_a_drawn_workload_of_the_wide_pool_trains_as_stock_does():
    """One draw of `--wide` in CI (a family outside FAMILIES, the merging tokenizer), so the wide pool cannot rot (its
    runs: docs/parity.md); the merging tokenizer does merge across a prompt's end."""
    families = wide_families()
    assert len(families) > len(FAMILIES) + len(CONFIGS) // 2
    tokenizer = bpe_tokenizer()
    prompt, whole = tokenizer("what i")["input_ids"], tokenizer("what is 3")["input_ids"]
    assert whole[:len(prompt)] != prompt and tokenizer.decode(whole, skip_special_tokens=True) == "what is 3"
    case = draw(3, families, tuple(TOKENIZERS))
    assert case["family"] not in FAMILIES and case["tokenizer"] == "bpe"
    verdict, detail = compare(case)
    assert verdict == "same", (case, verdict, detail)


@pytest.mark.parametrize("seed", [0, 2])
def test_a_drawn_workload_with_estimators_trains_and_evaluates_as_stock_does(seed):
    case = draw(seed, estimators=True)
    verdict, detail = compare(case)
    assert verdict in ("trained", "both raised"), (case, verdict, detail)


def test_the_estimator_judge_sees_a_non_finite_loss_and_a_pruned_evaluation():
    stock = {"history": [{"loss": 0.7}], "update": {"w": 0}, "first_eval": {"eval_loss": 0.69, "eval_runtime": 1.0}}
    plugin = {**stock, "packed": None}
    assert _judge(stock, plugin, torch.float32, estimators=True)[0] == "trained"
    assert _judge(stock, {**plugin, "history": [{"loss": float("nan")}]}, torch.float32, True)[0] == "differs"
    assert _judge(stock, {**plugin, "first_eval": {"eval_loss": 0.70}}, torch.float32, True)[0] == "differs"


@pytest.mark.parametrize("estimator", [{"position_keep_prob": 0.9}, {"branch_keep_prob": 0.5}])
def test_the_comparison_sees_an_estimator(estimator):
    """The comparison is not blind: an unbiased estimator, which is not stock's step, is found to differ."""
    case = draw(0)
    case["plugin"] = {**case["plugin"], **estimator}
    assert compare(case)[0] == "differs"


if __name__ == "__main__":
    first, count = (int(a) for a in sys.argv[1:3])
    wide = "--wide" in sys.argv[3:]
    pool, tokenizers = (wide_families(), tuple(TOKENIZERS)) if wide else (FAMILIES, ("char",))
    for seed in range(first, first + count):
        case = draw(seed, pool, tokenizers, estimators="--estimators" in sys.argv[3:])
        verdict, detail = compare(case)
        print(f"{seed:4d} {verdict:12s} {case['family']:22s} {case['form']:14s} {case['stock']['loss_type']} "
              f"{case['plugin']} lora={case['lora']} {case['tokenizer']} | {detail}", flush=True)
