"""The starting policy: the demo's tiny Llama, warm-started by a short SFT on the chosen answers, cached on disk.

DPO needs a policy that already half-knows the task, or there is nothing to sharpen. The loop is the project's one SFT
loop (trl_pruned_dpo/demo/sft.py, `train_causal_lm`: AdamW, linear warmup then cosine decay, loss on the completion
tokens only) over the `sft` split, which shares no
prompt with the DPO train or test splits (drawn with the same sizes as the study's). The sequence layout is exactly
TRL's DPO one for this tokenizer: ``<bos> prompt completion <eos>``. The result is saved with `save_pretrained`
under the demo cache (``$TRL_PRUNED_DPO_CACHE/quality/``), keyed by a hash of everything that determines it, so every
setting and seed starts from the very same weights and a second run of the study loads instead of training.
"""

import hashlib
import json
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from trl_pruned_dpo.demo import build_model, build_tokenizer, cache_dir
from trl_pruned_dpo.demo.sft import encode, train_causal_lm

from .tasks import QUICK_SIZES, STUDY_SIZES, make_study_splits

_FORMAT = 1  # bump when this loop changes


@dataclass(frozen=True)
class SFTSpec:
    model: str = "tiny-demo"
    model_seed: int = 0
    data_seed: int = 0
    quick: bool = False
    n_examples: int = 16384
    n_train: int = 2048  # the DPO splits' sizes: their prompts are kept out of the SFT data
    n_test: int = 128
    steps: int = 1500
    batch_size: int = 32
    learning_rate: float = 3e-3
    warmup: int = 50

    def key(self) -> str:
        blob = json.dumps([_FORMAT, asdict(self), QUICK_SIZES if self.quick else STUDY_SIZES], sort_keys=True)
        return f"sft-{self.model}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


def train_sft(spec: SFTSpec, log=print):
    """Train the starting policy from the demo's seeded init; returns the model (fp32, eval mode)."""
    tokenizer = build_tokenizer()
    rows = make_study_splits(spec.n_examples, spec.n_train, spec.n_test, seed=spec.data_seed, quick=spec.quick)["sft"]
    model = build_model(spec.model, spec.model_seed)
    train_causal_lm(model, encode(tokenizer, rows), spec.steps, spec.batch_size, spec.learning_rate, spec.warmup,
                    tokenizer.pad_token_id, random.Random(spec.data_seed), log, log_every=250)
    return model.eval()


def starting_policy(spec: SFTSpec, log=print) -> str:
    """The folder of the cached starting policy (model + tokenizer), trained on first use."""
    folder = cache_dir() / "quality" / spec.key()
    if (folder / "model.safetensors").is_file():
        return str(folder)
    log(f"Warm-starting the policy by SFT ({spec.steps} steps), cached at {folder}")
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        model = train_sft(spec, log=log)
        model.save_pretrained(tmp)
        build_tokenizer().save_pretrained(tmp)
        (tmp / "sft_spec.json").write_text(json.dumps(asdict(spec), indent=1))
        try:
            tmp.rename(folder)
        except OSError:  # another process wrote the same folder first
            if not (folder / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(folder)


def load_policy(folder: str):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
