"""The offline default: a character-level tokenizer, tiny Llama models and preference tasks with a ground truth.

- `tokenizer.build_tokenizer()`: the local character-level tokenizer.
- `model.resolve_model("builtin:tiny-demo")`: a cached local folder with a seeded tiny model and that tokenizer;
  ``builtin:tiny-demo-sft`` is the same model warm-started by a short SFT (sft.py), the demo's default;
  ``builtin:smollm2-135m-instruct`` and ``builtin:gemma3-270m`` are real pretrained models, built once from the
  package registry (pretrained.py).
- `tasks.make_dataset(task, n, seed)`, `tasks.is_correct(task, prompt, completion)`, `tasks.load_builtin(name)`;
  ``builtin:python-docs`` is real text from the Python documentation, as chat messages (realtext.py).

Nothing here touches the network, but the one-time download of a pretrained built-in (pip, the package registry).
See docs/cli.md ("The built-in demo", "A real model, offline").
"""

from .model import BUILTIN_MODELS, build_model, cache_dir, is_builtin, resolve_model
from .tasks import TASKS, is_correct, load_builtin, make_dataset, make_splits, solve
from .tokenizer import build_tokenizer

__all__ = [
    "BUILTIN_MODELS", "TASKS", "build_model", "build_tokenizer", "cache_dir", "is_builtin", "is_correct",
    "load_builtin", "make_dataset", "make_splits", "resolve_model", "solve",
]
