"""Offline stand-ins for the hub assets TRL's tests/test_dpo_trainer.py loads (used by run.sh, not collected by
pytest): tiny models built from configs (saved into a local HF hub cache, so every `from_pretrained` resolves
offline), a character tokenizer with a ChatML template, and the `trl-internal-testing/zen` (and harmony/toolcall)
datasets rebuilt locally with the same columns."""

import json
import os
import shutil
import sys
from pathlib import Path

import torch
from datasets import Dataset, DatasetDict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/tiny.py
from tiny import char_tokenizer  # noqa: E402

CACHE = Path(os.environ["HF_HUB_CACHE"])  # run.sh points it at a fresh folder
CHATML = ("{%- for message in messages -%}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>\n' }}{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}")

COMMON = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, max_position_embeddings=512)
MODELS = {
    "tiny-Qwen2ForCausalLM-2.5": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "tiny-Qwen3MoeForCausalLM": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                                 dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                      router_aux_loss_coef=0.01)),
    "tiny-GptOssForCausalLM": ("GptOssConfig", "GptOssForCausalLM",
                               dict(num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.01)),
    "tiny-Cohere2ForCausalLM": ("Cohere2Config", "Cohere2ForCausalLM", {}),
    "tiny-Glm4MoeForCausalLM": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                                dict(moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                                     first_k_dense_replace=1, n_group=1, topk_group=1)),
    "tiny-NemotronHForCausalLM-nano": ("NemotronHConfig", "NemotronHForCausalLM", {}),
    "tiny-Olmo3ForCausalLM": ("Olmo3Config", "Olmo3ForCausalLM", {}),
    "tiny-Lfm2ForCausalLM": ("Lfm2Config", "Lfm2ForCausalLM", {}),
    "tiny-Lfm2ForCausalLM-2.5": ("Lfm2Config", "Lfm2ForCausalLM", {}),
}


def tokenizer():
    tok = char_tokenizer()
    tok.chat_template = CHATML
    return tok


def _place(repo_id: str, folder: Path) -> None:
    """Put `folder`'s files into the hub cache layout under `repo_id` (offline resolution by from_pretrained)."""
    root = CACHE / f"models--{repo_id.replace('/', '--')}"
    commit = "0" * 40
    snapshot = root / "snapshots" / commit
    if snapshot.exists():
        shutil.rmtree(snapshot)
    shutil.copytree(folder, snapshot)
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(commit)


def build_models() -> dict:
    import transformers

    made = {}
    tok = tokenizer()
    for name, (config_name, model_name, extra) in MODELS.items():
        try:
            config = getattr(transformers, config_name)(
                vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                bos_token_id=tok.bos_token_id, **COMMON, **extra)
            torch.manual_seed(0)
            model = getattr(transformers, model_name)(config)
            folder = CACHE.parent / "standin-build" / name
            model.save_pretrained(folder)
            tok.save_pretrained(folder)
            _place(f"trl-internal-testing/{name}", folder)
            made[name] = "ok"
        except Exception as error:  # noqa: BLE001 - reported, the test then fails as "asset missing"
            made[name] = f"{type(error).__name__}: {error}"[:200]
    return made


def _rows(n, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        a, b = (int(x) for x in torch.randint(1, 99, (2,), generator=g))
        out.append((f"What is {a}+{b}?", f" It is {a + b}.", f" It is {a + b + 1 + i % 3}."))
    return out


def zen(config: str, split: str | None):
    def make(n, seed):
        rows = _rows(n, seed)
        user = lambda p: [{"role": "user", "content": p}]  # noqa: E731
        bot = lambda c: [{"role": "assistant", "content": c.strip()}]  # noqa: E731
        if config == "standard_preference":
            data = {"prompt": [r[0] for r in rows], "chosen": [r[1] for r in rows], "rejected": [r[2] for r in rows]}
        elif config == "conversational_preference":
            data = {"prompt": [user(r[0]) for r in rows], "chosen": [bot(r[1]) for r in rows],
                    "rejected": [bot(r[2]) for r in rows]}
        elif config == "standard_implicit_prompt_preference":
            data = {"chosen": [r[0] + r[1] for r in rows], "rejected": [r[0] + r[2] for r in rows]}
        elif config == "conversational_implicit_prompt_preference":
            data = {"chosen": [user(r[0]) + bot(r[1]) for r in rows],
                    "rejected": [user(r[0]) + bot(r[2]) for r in rows]}
        elif config == "standard_unpaired_preference":
            data = {"prompt": [r[0] for r in rows], "completion": [r[1] for r in rows],
                    "label": [bool(i % 2) for i in range(n)]}
        else:
            raise FileNotFoundError(f"stand-in: no local zen config {config!r}")
        return Dataset.from_dict(data)

    splits = DatasetDict({"train": make(17, 0), "test": make(2, 1)})
    return splits if split is None else splits[split]


def load_dataset(path, name=None, split=None, streaming=False, **kwargs):
    if path == "trl-internal-testing/zen":
        result = zen(name, split)
    elif path in ("trl-internal-testing/harmony", "trl-internal-testing/toolcall") and name == "preference":
        result = zen("conversational_preference", split)
    else:
        raise FileNotFoundError(f"stand-in: {path} ({name}) is not rebuilt offline")
    if streaming:
        from datasets import IterableDatasetDict

        if isinstance(result, Dataset):
            return result.to_iterable_dataset()
        return IterableDatasetDict({k: v.to_iterable_dataset() for k, v in result.items()})
    return result


if __name__ == "__main__":
    print(json.dumps(build_models(), indent=1))
