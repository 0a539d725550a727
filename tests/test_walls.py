"""The three walls: the runtime runs without torch or transformers, and the executor never
touches our graph code (it must stand on the saved program alone)."""

import ast
import subprocess
import sys
from pathlib import Path

SCRIPT = r"""
import sys, importlib.abc

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers", "safetensors"):
            raise ImportError(f"{name} is walled off")
        return None

sys.meta_path.insert(0, Block())
import gemma_ane
model = gemma_ane.load(sys.argv[1], backend="mil")
result = model.generate("hello", max_tokens=3, temperature=0)
assert result.finish_reason == "length" and len(result.tokens) == 3
banned = [m for m in sys.modules if m.split(".")[0] in ("torch", "transformers")
          or m.startswith(("gemma_ane.convert", "gemma_ane.oracle"))]
assert not banned, banned
print("OK")
"""


def test_runtime_and_executor_stand_alone(tiny_bundle16):
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_bundle16)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stderr[-3000:]


# -- the same walls, read off the source: every import, at module level or inside a function --------

PACKAGE = Path(__file__).parent.parent / "gemma_ane"


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name below gemma_ane ("engine", "bundle.layout"; a folder's
    __init__.py is the folder's name; the package itself is "")."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_package(module: str) -> bool:
    return modules()[module].name == "__init__.py"


def our_imports(module: str) -> set[str]:
    """The modules of ours that `module` imports (dotted, as modules() names them), at module level or inside a
    function: `from .a import b` names a (and a.b when b is a module)."""
    known, found = modules(), set()
    here = module.split(".") if module else []
    if not _is_package(module):
        here = here[:-1]
    for node in ast.walk(ast.parse(known[module].read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                base += node.module.split(".") if node.module else []
            elif node.module.split(".")[0] == "gemma_ane":
                base = node.module.split(".")[1:]
            else:
                continue
            name = ".".join(base)
            found.add(name)
            found |= {f"{name}.{a.name}".strip(".") for a in node.names if f"{name}.{a.name}".strip(".") in known}
        elif isinstance(node, ast.Import):
            found |= {".".join(a.name.split(".")[1:]) for a in node.names if a.name.split(".")[0] == "gemma_ane"}
    return {m for m in found if m in known}


def imports(module: str) -> set[str]:
    """Top-level package names a module imports, with our own modules as "gemma_ane.<name>"."""
    found = set()
    for node in ast.walk(ast.parse(modules()[module].read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.add(node.module.split(".")[0])
    return found | {f"gemma_ane.{m}" for m in our_imports(module)}


def in_folder(folder: str) -> set[str]:
    return {m for m in modules() if m == folder or m.startswith(folder + ".")}


# The folders are the sides: what runs (numpy only) and what it stands on, what converts (torch), and the
# oracle (transformers). errors and files are shared by all; cli is a shell over every side.
SHARED = {"", "errors", "files"}
RUNTIME = in_folder("runtime") | in_folder("server") | in_folder("mil") | in_folder("bundle") | SHARED
CONVERTER_SIDE = in_folder("convert") | in_folder("oracle")


def test_every_module_lives_on_a_side():
    sided = RUNTIME | CONVERTER_SIDE | in_folder("cli") | {"__main__"}  # python -m gemma_ane: the cli
    assert set(modules()) == sided, f"modules on no side: {sorted(set(modules()) - sided)}"


def test_runtime_side_never_imports_torch_transformers_or_the_converter():
    for module in RUNTIME:
        banned = imports(module) & (
            {"torch", "transformers", "safetensors"} | {f"gemma_ane.{m}" for m in CONVERTER_SIDE}
        )
        assert not banned, f"{module}.py imports {sorted(banned)}"


def test_executor_stands_on_the_saved_program_alone():
    for module in in_folder("mil"):
        ours = {m for m in imports(module) if m.startswith("gemma_ane.")}
        allowed = {
            "gemma_ane.mil",
            "gemma_ane.mil.package",
            "gemma_ane.mil.ops",
            "gemma_ane.mil.program",
            "gemma_ane.mil.executor",  # mil.serve runs packages for another process
            "gemma_ane.files",
            "gemma_ane.errors",
        }  # errors: none of ours
        assert ours <= allowed, f"{module}.py imports {sorted(ours)}"
    assert not {m for m in imports("errors") if m.startswith("gemma_ane.")}


def test_the_runtime_side_imports_coremltools_only_for_core_ml():
    """Saved programs are read by our own reader (mil/program.py: coremltools' generated protobuf modules, loaded
    without its package): coremltools itself is imported only where Core ML runs a model, runtime/backend.py's
    macOS path. (test_mil_reader runs a bundle in a fresh process and finds no coremltools package imported.)"""
    users = {m for m in RUNTIME if "coremltools" in imports(m)}
    assert users == {"runtime.backend"}, sorted(users)


def test_transformers_is_imported_only_by_the_oracle_side():
    users = {m for m in modules() if "transformers" in imports(m)}
    assert users <= in_folder("oracle"), sorted(users)
