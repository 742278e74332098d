"""`python -m trl_pruned_dpo`: the same as the `trl-pruned-dpo` console script (see cli/)."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
