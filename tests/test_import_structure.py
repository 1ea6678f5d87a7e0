"""The package's import layering, one way: ops and data import neither the model nor the
parallelism or the trainer; the model imports neither parallelism nor the trainer; and the
module-level imports of titan_moe form no cycle, with no titan_moe import inside a function."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "titan_moe"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _resolve(name: str) -> str | None:
    """The titan_moe module an imported name lives in (a module, or its package)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imported(module: str, module_level_only: bool) -> set[str]:
    """The titan_moe modules `module` imports (module-level ones, or every one)."""
    path = MODULES[module]
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: set[str] = set()

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            local = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            if module_level_only and local:
                continue
            if isinstance(child, ast.Import):
                names = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    prefix = package[: len(package) - child.level + 1]
                    base = ".".join([*prefix, base] if base else prefix)
                names = [f"{base}.{alias.name}" for alias in child.names]
            else:
                names = []
            found.update(m for m in map(_resolve, names) if m is not None)
            visit(child, local)

    visit(ast.parse(path.read_text()), False)
    found.discard(module)
    return found


def _violations(layer: str, forbidden: tuple[str, ...]) -> list[str]:
    return [
        f"{module} imports {target}"
        for module in sorted(MODULES)
        if module == layer or module.startswith(layer + ".")
        for target in sorted(_imported(module, module_level_only=False))
        if any(target == f or target.startswith(f + ".") for f in forbidden)
    ]


def test_ops_import_nothing_from_the_model_parallelism_or_trainer():
    forbidden = ("titan_moe.model", "titan_moe.parallel", "titan_moe.train")
    assert _violations("titan_moe.ops", forbidden) == []


def test_data_imports_neither_model_nor_parallelism_nor_trainer():
    forbidden = ("titan_moe.model", "titan_moe.parallel", "titan_moe.train")
    assert _violations("titan_moe.data", forbidden) == []


def test_model_imports_neither_parallelism_nor_trainer():
    """Parallelism and float8 are applied from outside the model (torchtitan style)."""
    forbidden = ("titan_moe.parallel", "titan_moe.train")
    assert _violations("titan_moe.model", forbidden) == []


def test_module_level_imports_have_no_cycle():
    graph = {m: _imported(m, module_level_only=True) for m in MODULES}
    state: dict[str, str] = {}  # "open" while on the search path, "done" after
    cycles: list[list[str]] = []

    def search(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                cycles.append([*path[path.index(target):], target])
            elif target not in state:
                search(target, [*path, target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            search(module, [module])
    assert cycles == []


def test_no_function_local_import_hides_a_cycle():
    """Every titan_moe import sits at module level, where the cycle check above sees it."""
    hidden = {
        module: sorted(_imported(module, False) - _imported(module, True)) for module in MODULES
    }
    assert {m: targets for m, targets in hidden.items() if targets} == {}
