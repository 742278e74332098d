"""Opt-in: make `trl dpo` itself train with `PrunedDPOTrainer` (`TRL_PRUNED_DPO=1 trl dpo --config x.yaml`).

TRL's CLI has no plugin hook and always runs its own `trl/scripts/dpo.py`. That script, though, looks both classes
up late, by name, on the `trl` package: `make_parser()` does `from trl import DPOConfig` and `main()` does
`from trl import DPOTrainer`, in the `trl` process that parses the arguments and again in every process that
`accelerate launch` starts. Setting those two attributes of `trl` before the script runs swaps the classes
everywhere `trl dpo` looks, and nowhere else in TRL (its own modules import the classes from their submodules).

The swap has to happen at interpreter start-up in each of those processes, so it is a `.pth` file in
site-packages, written on request by `python -m trl_pruned_dpo.trl_hook install` (and removed by `uninstall`).
Its one line costs an environment lookup at every Python start-up and does nothing else unless `TRL_PRUNED_DPO=1`;
with it, it imports `trl_pruned_dpo` (hence TRL, transformers and torch, which a `trl dpo` process imports anyway)
and calls `install()` (trl_hook_startup.py), which also lets the script take `builtin:` model and dataset names.
Limits are listed in docs/cli.md.
"""

import argparse
import os
import sys
import sysconfig
from pathlib import Path

from .trl_hook_startup import install  # noqa: F401  (the swap itself; public here as before)

ENV = "TRL_PRUNED_DPO"
PTH_NAME = "trl_pruned_dpo_hook.pth"
PTH_LINE = (
    "import os; os.environ.get('TRL_PRUNED_DPO', '').lower() in ('1', 'true', 'yes') and "
    "__import__('trl_pruned_dpo.trl_hook_startup').trl_hook_startup.install()\n"
)


def default_site_dir() -> Path:
    """This interpreter's site-packages (the venv's, inside a venv)."""
    return Path(sysconfig.get_paths()["purelib"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trl_pruned_dpo.trl_hook",
        description=f"Install or remove the opt-in hook that makes `{ENV}=1 trl dpo ...` use PrunedDPOTrainer.",
    )
    parser.add_argument("action", choices=["install", "uninstall", "status"])
    parser.add_argument("--site-dir", type=Path, default=None, help="where to write the .pth (default: site-packages)")
    args = parser.parse_args(argv)
    path = (args.site_dir or default_site_dir()) / PTH_NAME
    if args.action == "install":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(PTH_LINE)
        print(f"wrote {path}: run `{ENV}=1 trl dpo --config x.yaml` to train with PrunedDPOTrainer")
    elif args.action == "uninstall":
        path.unlink(missing_ok=True)
        print(f"removed {path}")
    else:
        installed = path.is_file() and path.read_text() == PTH_LINE
        active = os.environ.get(ENV, "").lower() in ("1", "true", "yes")
        print(f"hook file {path}: {'installed' if installed else 'not installed'}; {ENV} "
              f"{'set: trl dpo uses PrunedDPOTrainer' if installed and active else 'not active in this shell'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
