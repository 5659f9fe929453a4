"""The package's import layering: core imports only core and errors, lower layers never import the
layers above them, the graph of subpackage-level layers has no cycle, and neither has the graph of modules
(every import, deferred ones in functions and those under `if TYPE_CHECKING:` included: an annotation's
import is a dependency too). The CLI's start-up path (the modules `hf_fedtask.cli` imports at module level,
transitively) imports no heavy third-party package."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

import hf_fedtask

PACKAGE = Path(hf_fedtask.__file__).parent


def _modules() -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package) for every module of hf_fedtask."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def _imports(nodes: Iterable[ast.AST], type_checking: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement in `nodes`, at any depth; those under `if TYPE_CHECKING:` only when
    `type_checking` (its `else:` branch runs, so it always counts)."""
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif not type_checking and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from _imports(node.orelse, type_checking)
        else:
            yield from _imports(ast.iter_child_nodes(node), type_checking)


def _import_graph(type_checking: bool = True) -> dict[str, set[tuple[str, int, str]]]:
    """Module -> {(imported hf_fedtask module, line, source line)}: absolute and relative imports, at any
    depth (inside functions too, and under `if TYPE_CHECKING:` when `type_checking`); `from pkg import
    name` counts as `pkg.name` when that is a module, and as the lazily loaded module for `hf_fedtask`'s
    lazy names."""
    modules = _modules()
    lazy = {name: f"hf_fedtask.{target}" for name, target in hf_fedtask._LAZY.items()}
    graph = {}
    for name, (path, is_package) in modules.items():
        source = path.read_text()
        lines = source.splitlines()
        package = name if is_package else name.rpartition(".")[0]
        edges = set()
        for node in _imports([ast.parse(source, filename=str(path))], type_checking):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                targets = []
                for a in node.names:
                    if f"{module}.{a.name}" in modules:
                        targets.append(f"{module}.{a.name}")
                    elif module == "hf_fedtask" and a.name in lazy:
                        targets.append(lazy[a.name])
                    else:
                        targets.append(module)
            else:
                continue
            for target in targets:
                if target == "hf_fedtask" or target.startswith("hf_fedtask."):
                    edges.add((target, node.lineno, lines[node.lineno - 1].strip()))
        graph[name] = edges
    return graph


def _layer(module: str) -> str:
    return ".".join(module.split(".")[:2])


LAYERING = {  # layer -> the layers it must never import
    "hf_fedtask.model": ("engine", "strategies", "workflows", "cli", "config"),
    "hf_fedtask.client": ("engine", "strategies", "workflows", "cli", "config"),
    "hf_fedtask.data": ("engine", "strategies", "workflows", "cli", "config"),
    "hf_fedtask.merge": ("engine", "strategies", "workflows", "cli", "config"),
    "hf_fedtask.strategies": ("engine", "workflows", "cli", "config"),
    "hf_fedtask.engine": ("workflows", "cli"),
}


def test_import_graph_is_layered_and_acyclic():
    """core imports only core and errors; lower layers never import the layers above them (LAYERING);
    the graph of subpackage-level layers has no cycle."""
    graph = _import_graph()
    assert {"hf_fedtask.core.state", "hf_fedtask.engine.server", "hf_fedtask.strategies.base"} <= set(graph)
    assert any(t == "hf_fedtask.strategies" for t, _, _ in graph["hf_fedtask.engine.client"])  # the parser sees imports
    violations = []
    for module, edges in sorted(graph.items()):
        layer = _layer(module)
        for target, line, text in sorted(edges):
            if layer == "hf_fedtask.core" and _layer(target) not in ("hf_fedtask.core", "hf_fedtask.errors"):
                violations.append(f"{module}:{line}: {text}")
            if any(_layer(target) == f"hf_fedtask.{banned}" for banned in LAYERING.get(layer, ())):
                violations.append(f"{module}:{line}: {text}")
    assert not violations, "\n".join(violations)

    layers: dict[str, set[str]] = {}
    for module, edges in graph.items():
        layers.setdefault(_layer(module), set()).update(_layer(t) for t, _, _ in edges if _layer(t) != _layer(module))
    assert {"hf_fedtask.core", "hf_fedtask.engine", "hf_fedtask.strategies", "hf_fedtask.cli"} <= set(layers)
    done, stack = set(), []

    def visit(layer):
        if layer in stack:
            raise AssertionError("import cycle between layers: " + " -> ".join([*stack[stack.index(layer):], layer]))
        if layer in done:
            return
        stack.append(layer)
        for target in sorted(layers.get(layer, ())):
            visit(target)
        stack.pop()
        done.add(layer)

    for layer in sorted(layers):
        visit(layer)


def _cycles(graph: dict[str, set[tuple[str, int, str]]]) -> list[tuple[list[str], list[tuple[str, int, str]]]]:
    """Each strongly connected component of more than one module (Tarjan's algorithm) and a shortest
    cycle through its first module: the cycle's edges as (module, line, source line of the import that
    leads to the next module)."""
    adjacent = {m: sorted({t for t, _, _ in edges if t in graph and t != m}) for m, edges in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components = []

    def connect(module):  # recursive: the package's import chains are a few dozen modules deep at most
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in adjacent[module]:
            if target not in index:
                connect(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = set()
            while module not in component:  # the stack down to `module` is its component
                component.add(stack.pop())
            if len(component) > 1:
                components.append(component)

    for module in sorted(adjacent):
        if module not in index:
            connect(module)
    cycles = []
    for component in components:  # walk from the component's first module back to it, inside it
        start = min(component)
        paths = {start: [start]}
        queue = [start]
        while queue:
            module = queue.pop(0)
            for target in adjacent[module]:
                if target == start:
                    path = [*paths[module], start]
                    queue = []
                    break
                if target in component and target not in paths:
                    paths[target] = [*paths[module], target]
                    queue.append(target)
        cycles.append((sorted(component), [(a, line, text) for a, b in zip(path, path[1:])
                                           for line, text in [min((ln, tx) for t, ln, tx in graph[a] if t == b)]]))
    return cycles


def test_module_import_graph_has_no_cycle():
    """No module imports, directly or through others, a module that imports it back: not at module level
    and not inside a function either (a deferred import hides a circle, it does not remove it), nor under
    `if TYPE_CHECKING:` (an annotation's import is a dependency a reader follows too)."""
    graph = _import_graph(type_checking=True)
    assert _cycles({"a": {("b", 1, "import b")}, "b": {("a", 2, "import a")}, "c": {("a", 3, "import a")}}) == [
        (["a", "b"], [("a", 1, "import b"), ("b", 2, "import a")])]
    assert any(t == "hf_fedtask.engine.flower.handler" for t, _, _ in graph["hf_fedtask.engine.flower.worker"])
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(
        f"  among {', '.join(component)}:\n    " + " -> ".join([*(m for m, _, _ in cycle), cycle[0][0]]) + "".join(
            f"\n      {m}:{line}: {text}" for m, line, text in cycle) for component, cycle in cycles)


# third-party packages the CLI's start-up must not import (seconds each: `hf-fedtask --help` stays quick);
# the commands import them inside their functions
HEAVY = ("torch", "transformers", "datasets", "peft", "accelerate", "numba", "safetensors", "flwr", "evaluate")


def _module_level_imports(path: Path, package: str) -> list[tuple[str, list[str], int, str]]:
    """(module, names, line, source line) of each import that runs when the module is imported: at module
    level and in class bodies, under `if`/`try` too, but not in functions nor under `if TYPE_CHECKING:`."""
    source = path.read_text()
    lines = source.splitlines()
    out = []

    def visit(body):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, ast.Import):
                for a in node.names:
                    out.append((a.name, [], node.lineno, lines[node.lineno - 1].strip()))
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                out.append((module, [a.name for a in node.names], node.lineno, lines[node.lineno - 1].strip()))
            for field in ("body", "orelse", "finalbody", "handlers"):
                visit(getattr(node, field, []))

    visit(ast.parse(source, filename=str(path)).body)
    return out


def test_cli_start_up_imports_nothing_heavy():
    """Static twin of tests/test_cli_startup.py: following the imports that run at import time from
    `hf_fedtask.cli` (each module's parent packages included), no module imports a HEAVY package; a
    violation is reported with the chain of imports that reaches it."""
    modules = _modules()
    edges: dict[str, list[tuple[str, int, str]]] = {}
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        edges[name] = []
        for module, names, line, text in _module_level_imports(path, package):
            targets = [f"{module}.{n}" for n in names if f"{module}.{n}" in modules] or [module]
            for target in targets:
                parts = target.split(".")  # importing a.b.c runs a, a.b and a.b.c
                edges[name] += [(".".join(parts[:i]), line, text) for i in range(1, len(parts) + 1)]

    start = "hf_fedtask.cli"
    reached, queue, violations = {start: None, "hf_fedtask": None}, [start, "hf_fedtask"], []
    while queue:
        module = queue.pop(0)
        for target, line, text in edges.get(module, ()):
            if target.split(".")[0] in HEAVY:
                chain, at = [f"{module}:{line}: {text}"], reached[module]
                while at is not None:
                    chain.append(f"{at[0]}:{at[1]}: {at[2]}")
                    at = reached[at[0]]
                violations.append(" <- ".join(chain))
            elif target in modules and target not in reached:
                reached[target] = (module, line, text)
                queue.append(target)
    assert {"hf_fedtask.config", "hf_fedtask.strategies.configs", "hf_fedtask.strategies"} <= set(reached)
    assert "hf_fedtask.strategies.base" not in reached  # the strategies load on first use, not at start-up
    assert not violations, "\n".join(violations)
