"""Built-in tiny models: a small Llama built from a config, deterministic from a seed, cached as a local folder.

``builtin:<name>`` (e.g. ``builtin:tiny-demo``) is accepted wherever a model id is: `resolve_model` turns it into a
folder under the cache (``$TRL_PRUNED_DPO_CACHE``, default ``~/.cache/trl_pruned_dpo``) holding the model and the
character-level tokenizer, writing it on first use. Everything downstream then loads from that folder exactly as it
would a downloaded hub model, so TRL's reference model, which DPOTrainer reloads from the policy's
``name_or_path``, is read from disk too and no network is ever touched.

The weights of ``tiny-demo`` and ``small-demo`` are random (a seeded init, not pretrained). ``tiny-demo-sft`` is
``tiny-demo`` warm-started by a short SFT on right answers (sft.py, ~30 s of one CPU core the first time), the
starting point on which the demo's DPO visibly learns.

``builtin:smollm2-135m-instruct`` (SmolLM2-135M-Instruct) and ``builtin:gemma3-270m`` (the base Gemma 3 270M) are real
pretrained models, built once from the package registry and de-quantized into the same cache (pretrained.py); offline
from then on.
"""

import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from .pretrained import PRETRAINED_MODELS, build_pretrained, folder_name
from .sft import SFT_MODELS, fine_tune
from .tokenizer import build_tokenizer

BUILTIN_PREFIX = "builtin:"
# name -> LlamaConfig fields. Changing a spec changes its cache folder (the folder name holds a hash of the spec).
BUILTIN_MODELS = {
    "tiny-demo": dict(
        hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=512,
    ),
    "small-demo": dict(
        hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=1024,
    ),
}
# Bump when the tokenizer or the way models are built changes.
_FORMAT_VERSION = 1


def cache_dir() -> Path:
    """Root of the demo cache: ``$TRL_PRUNED_DPO_CACHE``, else ``$XDG_CACHE_HOME/trl_pruned_dpo`` (~/.cache)."""
    if os.environ.get("TRL_PRUNED_DPO_CACHE"):
        return Path(os.environ["TRL_PRUNED_DPO_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "trl_pruned_dpo"


def is_builtin(name_or_path: str | None) -> bool:
    return isinstance(name_or_path, str) and name_or_path.startswith(BUILTIN_PREFIX)


def build_model(name: str = "tiny-demo", seed: int = 0) -> LlamaForCausalLM:
    """A freshly initialised built-in model (fp32), the same weights for the same (name, seed) on every machine."""
    if name not in BUILTIN_MODELS:
        raise ValueError(f"Unknown built-in model {name!r}: choose among {sorted(BUILTIN_MODELS)}.")
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        **BUILTIN_MODELS[name],
    )
    # Seed the init without moving the caller's global RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.float()


def builtin_model_names() -> list[str]:
    return [BUILTIN_PREFIX + n for n in sorted(BUILTIN_MODELS) + sorted(SFT_MODELS) + sorted(PRETRAINED_MODELS)]


def _build(name: str, seed: int) -> LlamaForCausalLM:
    """A built-in model: a seeded init, or for a warm-started name its base init after the recipe's SFT."""
    if name in SFT_MODELS:
        recipe = SFT_MODELS[name]
        print(f"Building builtin:{name} once (SFT of builtin:{recipe.base}, {recipe.steps} steps; cached after)",
              file=sys.stderr, flush=True)
        return fine_tune(build_model(recipe.base, seed), recipe, seed)
    return build_model(name, seed)


def _folder(name: str, seed: int) -> Path:
    # Pretrained weights: the seed plays no part.
    if name in PRETRAINED_MODELS:
        return cache_dir() / "models" / folder_name(name)
    recipe = SFT_MODELS.get(name)
    spec = BUILTIN_MODELS[name] if recipe is None else [asdict(recipe), BUILTIN_MODELS[recipe.base]]
    spec = json.dumps([_FORMAT_VERSION, spec], sort_keys=True)
    return cache_dir() / "models" / f"{name}-seed{seed}-{hashlib.sha256(spec.encode()).hexdigest()[:10]}"


def resolve_model(name_or_path: str, seed: int = 0) -> str:
    """Return a loadable path for `name_or_path`: ``builtin:<name>`` becomes its cached folder (built and saved on
    first use); anything else (a local folder, a hub id) is returned unchanged."""
    if not is_builtin(name_or_path):
        return name_or_path
    name = name_or_path[len(BUILTIN_PREFIX):]
    if name not in BUILTIN_MODELS and name not in SFT_MODELS and name not in PRETRAINED_MODELS:
        raise ValueError(
            f"Unknown built-in model {name_or_path!r}: choose among {builtin_model_names()}, or pass a local folder "
            "or a hub id."
        )
    folder = _folder(name, seed)
    if (folder / "model.safetensors").is_file():
        return str(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Write into a temporary sibling and rename: concurrent processes (one per rank) never see a half-written folder.
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        if name in PRETRAINED_MODELS:
            build_pretrained(name, tmp)
        else:
            _build(name, seed).save_pretrained(tmp)
            build_tokenizer().save_pretrained(tmp)
        try:
            tmp.rename(folder)
        except OSError:
            # Another process got there first; its folder is identical.
            if not (folder / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(folder)
