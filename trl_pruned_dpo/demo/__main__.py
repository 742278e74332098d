"""`python -m trl_pruned_dpo.demo prepare`: write the built-in model and a built-in dataset as local folders.

For tools that take only paths, e.g. stock `trl dpo` (with or without the hook of trl_hook.py): it prints the model
folder and a dataset folder of JSON-lines splits (``train.jsonl``, ``test.jsonl``) that `datasets.load_dataset`
reads offline.
"""

import argparse
import sys
from pathlib import Path

from .export import export_builtin
from .model import builtin_model_names, resolve_model
from .tasks import builtin_names


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m trl_pruned_dpo.demo", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["prepare"],
                        help="prepare: write the model folder and the dataset folder, then print both paths")
    parser.add_argument("--model", default="builtin:tiny-demo-sft",
                        help=f"built-in model to write (default: %(default)s, the demo's; one of "
                             f"{', '.join(builtin_model_names())})")
    parser.add_argument("--dataset", default="builtin:sort-short",
                        help=f"built-in dataset to export as train.jsonl and test.jsonl (default: %(default)s, the "
                             f"demo's; one of {', '.join(builtin_names())})")
    parser.add_argument("--out", type=Path, default=None,
                        help="dataset folder (default: <demo cache>/datasets/<task>-seed0-<hash of the content>; the "
                             "model always goes to the demo cache, $TRL_PRUNED_DPO_CACHE or ~/.cache/trl_pruned_dpo)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    model = resolve_model(args.model)
    data = export_builtin(args.dataset, args.out)
    print(f"model_name_or_path: {model}\ndataset_name: {data}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
