"""The package's dependencies, read off the source as test_walls does: no import cycle (module or function
level), no private name taken from another module, and every bundle file name spelled in the bundle's layout
alone."""

import ast
import sys
from pathlib import Path

from test_walls import modules, our_imports

# -- one direction per dependency, private names kept private, the bundle's names spelled once ----------------


def _depends_on(module: str) -> set[str]:
    """What importing `module` runs of ours: each module it imports and the folders (packages) holding them,
    but not its own folders (a package's __init__ importing its parts is not a cycle) nor gemma_ane itself."""
    out = set()
    for target in our_imports(module):
        out.add(target)
        parts = target.split(".")
        for k in range(1, len(parts)):
            folder = ".".join(parts[:k])
            if not (module == folder or module.startswith(folder + ".")):
                out.add(folder)
    own = module.split(".")
    return out - {""} - {".".join(own[:k]) for k in range(1, len(own))} - {module}


def import_cycles() -> list[list[str]]:
    """Strongly connected components of more than one module in the import graph (Tarjan)."""
    graph = {m: _depends_on(m) for m in modules()}
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return cycles


def test_no_import_cycles():
    assert import_cycles() == []


def test_the_cycle_check_sees_function_level_imports(monkeypatch):
    """A function-level import back into a module's importer is a cycle too."""
    real, back = our_imports, {"runtime.backend"}
    here = sys.modules[__name__]
    monkeypatch.setattr(here, "our_imports", lambda m: real(m) | (back if m == "bundle.check" else set()))
    assert any({"runtime.backend", "bundle", "bundle.check"} <= set(c) for c in import_cycles())


def test_no_private_name_is_imported_from_another_module():
    taken = []
    for module, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or node.module.startswith("gemma_ane")):
                taken += [
                    f"{module}: {a.name}" for a in node.names if a.name.startswith("_") and not a.name.startswith("__")
                ]
    assert taken == []


def _strings(path: Path) -> list[str]:
    """The string constants of a module, docstrings left out (prose may name a file)."""
    tree = ast.parse(path.read_text())
    docs = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
    ]


def bundle_file_names() -> set[str]:
    from gemma_ane.bundle import layout

    # the Core ML formats' suffixes are not the bundle's: the executor (package.py) names them, and it stands
    # on the saved program alone
    names = {v for k, v in vars(layout).items() if k.isupper() and isinstance(v, str) and "." in v}
    return names - {layout.PACKAGE, layout.COMPILED} | {layout.HF_DIR}


# spec reads a config.json wherever it sits, a bundle's hf_model/ among them (`gemma-ane plan BUNDLE`), and cannot
# import the layout: the bundle's schema stands on spec
READS_ANY_CONFIG = ("bundle.spec",)


def test_every_bundle_file_name_is_spelled_in_the_layout_alone():
    where = {}
    for module, path in modules().items():
        for s in _strings(path):
            for name in bundle_file_names():
                if name in s and module not in ("bundle.layout", *READS_ANY_CONFIG):
                    where.setdefault(name, set()).add(module)
    assert where == {}
