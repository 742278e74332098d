"""The families outside the tested table, from outside: every causal-LM `model_type` the installed transformers maps,
other than those `attention.EXACT_FAMILIES` proves exact, built tiny (tests/test_exactness_matrix.py's sizes, a
family's experts, intermediate sizes and latent-attention ranks shrunk; dropout and router jitter off), trained one
batch by stock `DPOTrainer` and by `PrunedDPOTrainer` (`share_prompt` + `padding_free`, with and without
`prune_common_prefix`, checkpointing off and on): loss within 1e-5 and every gradient within 1e-4 relative
(`assert_exact`), and the warnings counted.

What each family comes out as (`outcome`):
- `packed`: exact, packed after the first-batch check, no warning;
- `fell back`: exact, one line naming why (`lines`), by the check or by the verdict from the config and model file;
- `refused`: a ValueError naming why, when the trainer was built (e.g. `prune_common_prefix` with a MoE router aux
  loss, or on a bidirectional model) or on its first batch (the causality check);
- `MISMATCH` / `CRASH`: what must never happen (a silent difference; the plugin failing where stock runs);
- `stock fails`, `not built`, `multimodal`, `too big`: stock itself cannot train the tiny config, the tiny config
  cannot be made from the sizes here, the config is a composite (vision or audio + text), or it has over 5M
  parameters even shrunk. Nothing about the plugin is learned from these.

    python tests/family_survey.py [--out FILE] [model_type ...]

Appends one JSON line per family to FILE (default: tests/family_survey.jsonl) and prints a table of outcomes.
docs/parity.md quotes the last run. Not part of the suite (minutes of CPU); tests/test_exactness_matrix.py runs one
family through `survey_family` so this script cannot rot.
"""

import argparse
import collections
import json
import pathlib
import signal
import sys
import tempfile
import traceback
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).parent))

import torch  # noqa: E402
from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

from conftest import first_batch, loss_and_grads  # noqa: E402
from test_exactness_matrix import BATCH, SMALL, _seeded_without_dropout, exact, trainers  # noqa: E402
from tiny import char_tokenizer  # noqa: E402
from trl_pruned_dpo.seam import attention  # noqa: E402

# tests/test_exactness_matrix.py's DeepSeek-V3 row: multi-head latent attention at the matrix's sizes
LATENT = dict(kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, head_dim=4,
              num_key_value_heads=4)
MAX_PARAMETERS = 5_000_000
SECONDS_PER_FAMILY = 900


def outside_the_table() -> list[str]:
    known = set(attention.EXACT_FAMILIES) | attention.RECURRENT_FAMILIES | attention.ALIBI_FAMILIES
    return sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) - known)


def small_sizes(config_class, vocabulary: int) -> dict:
    """Overrides of the family's default config that keep it tiny: experts (4, 2 per token), intermediate sizes,
    routing groups, per-layer input embeddings, latent-attention ranks."""
    default = vars(config_class())
    sizes = {}
    for key, value in default.items():
        if key == "num_experts_per_tok" and value is None:  # DeepSeek-V2's default: set only with experts
            sizes[key] = 2
        if not isinstance(value, int) or isinstance(value, bool):
            continue
        if ("expert" in key and ("per_tok" in key or "top" in key)) or key in ("moe_k", "moe_topk", "top_k"):
            sizes[key] = min(value, 2)
        elif "expert" in key and value > 4 and "interval" not in key and "freq" not in key:
            sizes[key] = 4
        elif "intermediate" in key and value > 64:
            sizes[key] = 32
        elif key in ("n_group", "topk_group"):
            sizes[key] = 1
        elif key == "vocab_size_per_layer_input":
            sizes[key] = vocabulary
        elif key == "hidden_size_per_layer_input" and value > 0:
            sizes[key] = 8
    if "qk_rope_head_dim" in default:
        sizes.update(LATENT)
    return sizes


def tiny_config(model_type: str, tokenizer):
    config_class = CONFIG_MAPPING[model_type]
    ids = dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
               bos_token_id=tokenizer.bos_token_id)
    sizes = {**SMALL, **small_sizes(config_class, len(tokenizer))}
    try:
        return config_class(**sizes, **ids)
    except Exception:  # noqa: BLE001 - a config without a settable head_dim (Falcon's is derived)
        sizes.pop("head_dim")
        return config_class(**sizes, **ids)


def _stock_error(stock) -> str | None:
    try:
        loss_and_grads(stock, first_batch(stock, BATCH))
        return None
    except Exception as error:  # noqa: BLE001
        return f"{type(error).__name__}: {str(error)[:200]}"


def _one_setting(model, tokenizer, common_prefix: bool, checkpointing: bool) -> dict:
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            stock, pruned = trainers(model, tokenizer, pathlib.Path(folder), prune_common_prefix=common_prefix)
        except ValueError as refusal:  # refused before any work, in one line
            return {"outcome": "refused", "detail": str(refusal)[:300]}
        stock_error = _stock_error(stock)
        if stock_error:
            return {"outcome": "stock fails", "stock": stock_error}
        try:
            exact(stock, pruned, checkpointing=checkpointing)
            outcome = None
        except AssertionError as error:
            outcome, detail = "MISMATCH", str(error).splitlines()[0][:300]
        except ValueError as refusal:  # stopped on the first batch, before any gradient (`check_causal`)
            return {"outcome": "refused", "detail": str(refusal)[:300]}
        except Exception as error:  # noqa: BLE001
            outcome, detail = "CRASH", f"{type(error).__name__}: {str(error)[:300]}"
        lines = [str(w.message) for w in caught if "ignored" in str(w.message)]
        packed = pruned.forward_choice.packed
    if outcome is None:  # exact: packed without a line, or not packed with exactly one
        outcome = "packed" if packed and not lines else "fell back" if len(lines) == 1 and not packed else "MISMATCH"
        detail = None if outcome != "MISMATCH" else f"packed {packed} with {len(lines)} fallback lines"
    return {"outcome": outcome, "detail": detail, "lines": lines}


def survey_family(model_type: str, tokenizer) -> dict:
    """One family: its outcome over `prune_common_prefix` off/on x checkpointing off/on (the worst of them)."""
    record = {"family": model_type}
    try:
        config = tiny_config(model_type, tokenizer)
    except Exception as error:  # noqa: BLE001
        return {**record, "outcome": "not built", "error": f"{type(error).__name__}: {str(error)[:200]}"}
    if config.get_text_config() is not config:
        return {**record, "outcome": "multimodal"}
    try:
        model = _seeded_without_dropout(config)
    except Exception as error:  # noqa: BLE001
        return {**record, "outcome": "not built", "error": f"{type(error).__name__}: {str(error)[:200]}"}
    record["parameters"] = sum(p.numel() for p in model.parameters())
    if record["parameters"] > MAX_PARAMETERS:
        return {**record, "outcome": "too big"}
    record["verdict"] = attention.packed_verdict(model)
    settings = []
    for common_prefix in (False, True):
        for checkpointing in (False, True) if model.supports_gradient_checkpointing else (False,):
            result = _one_setting(model, tokenizer, common_prefix, checkpointing)
            settings.append({"common_prefix": common_prefix, "checkpointing": checkpointing, **result})
            if result["outcome"] == "stock fails":
                return {**record, **result}
    rank = ["MISMATCH", "CRASH", "refused", "fell back", "packed"]
    worst = min(settings, key=lambda s: rank.index(s["outcome"]))
    return {**record, "outcome": worst["outcome"], "settings": settings}


class _Timeout(BaseException):  # not an Exception: the trainers' own `except Exception` must not take it
    pass


def _on_alarm(*_):
    raise _Timeout


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("families", nargs="*", help="model_types (default: every one outside the tested table)")
    parser.add_argument("--out", default=str(pathlib.Path(__file__).with_name("family_survey.jsonl")))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    tokenizer = char_tokenizer()
    signal.signal(signal.SIGALRM, _on_alarm)
    counts = collections.Counter()
    with open(args.out, "a") as out:
        for model_type in args.families or outside_the_table():
            signal.alarm(SECONDS_PER_FAMILY)
            try:
                record = survey_family(model_type, tokenizer)
            except _Timeout:
                record = {"family": model_type, "outcome": "timeout"}
            except Exception as error:  # noqa: BLE001 - outside the trainers: the harness's own failure
                record = {"family": model_type, "outcome": "harness error", "error": traceback.format_exc()[-400:]}
                print(error, file=sys.stderr)
            finally:
                signal.alarm(0)
                torch.set_grad_enabled(True)  # an alarm inside a no-grad block leaves it off for the next family
            counts[record["outcome"]] += 1
            print(json.dumps({k: record.get(k) for k in ("family", "outcome", "verdict", "error")}), flush=True)
            out.write(json.dumps(record) + "\n")
            out.flush()
    print(" | ".join(f"{outcome}: {n}" for outcome, n in counts.most_common()))


if __name__ == "__main__":
    main()
