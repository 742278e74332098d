"""The class swap that the `trl dpo` hook's .pth line (trl_hook.py) runs at interpreter start-up when
``TRL_PRUNED_DPO=1``.

`trl dpo`'s script takes its four argument classes and its trainer from the `trl` package at the last moment, so
pointing `trl.DPOConfig` and `trl.DPOTrainer` at the pruned classes swaps the trainer, and pointing
`trl.ScriptArguments` and `trl.ModelConfig` at subclasses that resolve `builtin:` names makes the demo's names work:
after parsing, `model_name_or_path: builtin:<model>` becomes its cached folder and `dataset_name: builtin:<task>` a
cached folder of JSON-lines splits (demo/export.py), which the script then loads as it would any local path. An
unknown `builtin:` name ends the command in one line. Nothing else about the two classes changes.

A module of its own so that start-up never imports `trl_pruned_dpo.trl_hook`: `python -m trl_pruned_dpo.trl_hook`
would then find its module already imported and print runpy's RuntimeWarning about sys.modules.
"""

import sys
from collections.abc import Callable
from typing import Any


def _resolved(resolve: Callable[[str], Any], name: str) -> str:
    """`resolve(name)` as a string, quietly (no library progress bars); an unknown name ends the process in one line."""
    from .notices import progress_bars_hidden

    try:
        with progress_bars_hidden():
            return str(resolve(name))
    except ValueError as error:
        print(f"trl dpo: error: {' '.join(str(error).split())}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def _resolving_builtin(arguments: type, field: str, resolve: Callable[[str], Any]) -> type:
    """A subclass of the dataclass `arguments` (same name, same fields) whose `field` turns a `builtin:` name into the
    local path `resolve` returns for it."""
    from .demo import is_builtin

    # After the dataclass's own __init__ (a `__post_init__` would run only if the parent had one when decorated).
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        arguments.__init__(self, *args, **kwargs)
        if is_builtin(getattr(self, field)):
            setattr(self, field, _resolved(resolve, getattr(self, field)))

    return type(arguments.__name__, (arguments,), {"__init__": __init__, "__module__": __name__,
                                                   "__doc__": arguments.__doc__})


def install() -> None:
    """Point `trl.DPOConfig` and `trl.DPOTrainer` at the pruned classes in this process, and let `trl dpo`'s
    `ScriptArguments` and `ModelConfig` take `builtin:` names."""
    import trl

    from . import PrunedDPOConfig, PrunedDPOTrainer
    from .demo import resolve_model
    from .demo.export import export_builtin

    # Installed already in this process.
    if trl.DPOTrainer is PrunedDPOTrainer:
        return
    trl.DPOConfig = PrunedDPOConfig
    trl.DPOTrainer = PrunedDPOTrainer
    trl.ScriptArguments = _resolving_builtin(trl.ScriptArguments, "dataset_name", export_builtin)
    trl.ModelConfig = _resolving_builtin(trl.ModelConfig, "model_name_or_path", resolve_model)
