"""The starting policy: the demo's tiny Llama, warm-started by a short SFT on the chosen answers, cached on disk.

DPO needs a policy that already half-knows the task, or there is nothing to sharpen. This is a plain causal-LM loop
(AdamW, linear warmup then cosine decay, loss on the completion tokens only) over the `sft` split, which shares no
prompt with the DPO train or test splits (drawn with the same sizes as the study's). The sequence layout is exactly
TRL's DPO one for this tokenizer: ``<bos> prompt completion <eos>``. The result is saved with `save_pretrained`
under the demo cache (``$TRL_PRUNED_DPO_CACHE/quality/``), keyed by a hash of everything that determines it, so every
setting and seed starts from the very same weights and a second run of the study loads instead of training.
"""

import hashlib
import json
import math
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from trl_pruned_dpo.demo import build_model, build_tokenizer, cache_dir

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


def _encode(tokenizer, rows):
    """(ids, first completion index) per row: <bos> prompt completion <eos>, as TRL lays out a DPO sequence."""
    out = []
    for row in rows:
        prompt = tokenizer(row["prompt"])["input_ids"]
        full = tokenizer(row["prompt"] + row["chosen"])["input_ids"] + [tokenizer.eos_token_id]
        out.append((full, len(prompt)))
    return out


def _batch(encoded, pad_id):
    width = max(len(ids) for ids, _ in encoded)
    input_ids = torch.full((len(encoded), width), pad_id, dtype=torch.long)
    labels = torch.full((len(encoded), width), -100, dtype=torch.long)
    attention = torch.zeros((len(encoded), width), dtype=torch.long)
    for row, (ids, start) in enumerate(encoded):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, start : len(ids)] = torch.tensor(ids[start:])
        attention[row, : len(ids)] = 1
    return input_ids, labels, attention


def train_sft(spec: SFTSpec, log=print):
    """Train the starting policy from the demo's seeded init; returns the model (fp32, eval mode)."""
    tokenizer = build_tokenizer()
    rows = make_study_splits(spec.n_examples, spec.n_train, spec.n_test, seed=spec.data_seed, quick=spec.quick)["sft"]
    encoded = _encode(tokenizer, rows)
    model = build_model(spec.model, spec.model_seed)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.learning_rate, weight_decay=0.0, betas=(0.9, 0.98))

    def lr_at(step):
        if step < spec.warmup:
            return (step + 1) / spec.warmup
        progress = (step - spec.warmup) / max(1, spec.steps - spec.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    order = random.Random(spec.data_seed)
    started = time.perf_counter()
    for step in range(spec.steps):
        batch = [encoded[order.randrange(len(encoded))] for _ in range(spec.batch_size)]
        input_ids, labels, attention = _batch(batch, tokenizer.pad_token_id)
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 250 == 0 or step == spec.steps - 1:
            log(f"  sft step {step:5d}  loss {loss.item():.3f}  ({time.perf_counter() - started:.0f}s)")
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
