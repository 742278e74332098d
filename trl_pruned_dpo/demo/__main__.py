"""`python -m trl_pruned_dpo.demo prepare`: write the built-in model and a built-in dataset as local folders.

For tools that take only paths, e.g. stock `trl dpo` (with or without the hook of trl_hook.py): it prints the model
folder and a dataset folder of JSON-lines splits (``train.jsonl``, ``test.jsonl``) that `datasets.load_dataset`
reads offline.
"""

import argparse
import sys
from pathlib import Path

from .model import cache_dir, resolve_model
from .tasks import load_builtin


def export_dataset(name: str, folder: Path) -> Path:
    """Write the splits of built-in dataset `name` as `<folder>/<split>.jsonl`; returns `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    for split, data in load_builtin(name).items():
        data.to_json(folder / f"{split}.jsonl", lines=True)
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trl_pruned_dpo.demo", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["prepare"])
    parser.add_argument("--model", default="builtin:tiny-demo")
    parser.add_argument("--dataset", default="builtin:mix")
    parser.add_argument("--out", type=Path, default=None, help="dataset folder (default: under the demo cache)")
    args = parser.parse_args(argv)
    model = resolve_model(args.model)
    task = args.dataset.split(":", 1)[-1]
    data = export_dataset(args.dataset, args.out or cache_dir() / "datasets" / task)
    print(f"model_name_or_path: {model}\ndataset_name: {data}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
