"""The house keeps its shape: imports run one way (docs/method.md, "Where things are").

Read with `ast`, nothing imported; an import inside a function counts like one at the top (a lazy import that breaks
a circle at run time is still a circle in the design). Layers, bottom to top:

    config, errors, notices  <  method/  <  auto, reference, seam/, sampler  <  safety/  <  pruned_forward  <
    forward_choice, merged_step, metrics  <  trainer  <  cli/, trl_hook*

demo/ (the offline assets) sits beside the bottom layers and imports none of the package's training code.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "trl_pruned_dpo"
LAYERS = [
    {"config", "errors", "notices"},
    {"method"},
    {"auto", "reference", "seam", "sampler"},
    {"safety"},
    {"pruned_forward"},
    {"forward_choice", "merged_step", "metrics"},
    {"trainer"},
    {"cli", "trl_hook", "trl_hook_startup", "__main__"},
]


def modules(folder: str) -> dict[str, Path]:
    found = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that `name` imports (relative imports resolved)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            stem = ".".join(base + ([node.module] if node.module else []))
            # `from pkg import module` imports the module; `from pkg import name` imports pkg (its __init__)
            targets = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in known else stem for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def graph(folder: str) -> dict[str, set[str]]:
    found = modules(folder)
    return {name: imports(name, path, set(found)) for name, path in found.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    return out


@pytest.mark.parametrize("folder", [PACKAGE, "evaluation", "benchmarks"])
def test_no_import_circles(folder):
    assert cycles(graph(folder)) == []


def _layer(module: str) -> int | None:
    top = module.split(".")[1] if "." in module else None
    for level, names in enumerate(LAYERS):
        if top in names:
            return level
    return None


def test_imports_run_downward():
    upward = []
    for module, targets in graph(PACKAGE).items():
        here = _layer(module)
        for target in targets:
            there = _layer(target)
            if target.startswith(f"{PACKAGE}.demo") and here is not None and here < _layer(f"{PACKAGE}.cli"):
                upward.append(f"{module} -> {target} (only the CLI uses the demo assets)")
            if here is not None and there is not None and there > here:
                upward.append(f"{module} -> {target}")
    demo = [f"{m} -> {t}" for m, ts in graph(PACKAGE).items() if m.startswith(f"{PACKAGE}.demo")
            for t in ts if not t.startswith(f"{PACKAGE}.demo")]
    assert upward == [] and demo == []


def test_the_method_and_config_import_no_trl_private_and_config_no_torch():
    for name, path in modules(f"{PACKAGE}/method").items():
        text = path.read_text()
        assert "import trl" not in text and "from trl" not in text, name
    config = (ROOT / PACKAGE / "config.py").read_text()
    assert "import torch" not in config and "from torch" not in config


def test_this_checker_sees_a_circle_and_an_upward_import():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _layer(f"{PACKAGE}.method.plan") < _layer(f"{PACKAGE}.trainer")
