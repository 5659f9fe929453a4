"""The package's import layering: core imports only core and errors, lower layers never import the
layers above them, and the graph of subpackage-level layers has no cycle."""

from __future__ import annotations

import ast
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


def _import_graph() -> dict[str, set[tuple[str, int, str]]]:
    """Module -> {(imported hf_fedtask module, line, source line)}: absolute and relative imports, at any
    depth (inside functions and `if TYPE_CHECKING:` too); `from pkg import name` counts as `pkg.name`
    when that is a module, and as the lazily loaded module for `hf_fedtask`'s lazy names."""
    modules = _modules()
    lazy = {name: f"hf_fedtask.{target}" for name, target in hf_fedtask._LAZY.items()}
    graph = {}
    for name, (path, is_package) in modules.items():
        source = path.read_text()
        lines = source.splitlines()
        package = name if is_package else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(source, filename=str(path))):
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
