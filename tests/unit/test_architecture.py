"""The package's architecture holds: the folders are the layers, dependencies point down them, no
import circle of any kind (type-only imports included), no reaching into another module's private
names, adapters and users' code import only public names."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).parents[2]
PACKAGE = ROOT / "kvrag"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60

#: The layers, bottom first: a module may import its own layer and the layers below it, never above.
LAYERS: list[tuple[str, ...]] = [
    ("kvrag.errors", "kvrag.paths", "kvrag.data", "kvrag.version"),
    ("kvrag.kernels",),
    ("kvrag.models",),
    ("kvrag.artifacts",),
    ("kvrag.codecs",),
    ("kvrag.stores",),
    ("kvrag.trust",),
    ("kvrag.paged",),
    ("kvrag.core",),
    ("kvrag.reuse",),
    ("kvrag.engine",),
    ("kvrag.apps",),
    ("kvrag.server",),
    ("kvrag.cli",),
    ("kvrag", "kvrag.testing"),
]
#: What may sit at the top of `kvrag/` besides the subpackages.
TOP_LEVEL_MODULES = {"__init__.py", "errors.py", "paths.py", "testing.py", "version.py"}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, tuple[pathlib.Path, ast.AST]]:
    return {_module_name(p): (p, ast.parse(p.read_text())) for p in sorted(PACKAGE.rglob("*.py"))}


def _imported(name: str, path: pathlib.Path, tree: ast.AST, modules: set[str]) -> set[str]:
    """The kvrag modules `name` imports anywhere in its body (under `TYPE_CHECKING` and inside
    functions too): a type-only import is still a dependency a reader walks."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.add(target if target in modules else base)
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imported(name, path, tree, set(modules)) for name, (path, tree) in modules.items()}


def _layer(module: str) -> int:
    best, depth = -1, -1
    for index, layer in enumerate(LAYERS):
        for prefix in layer:
            if (module == prefix or module.startswith(prefix + ".")) and prefix.count(".") > depth:
                best, depth = index, prefix.count(".")
    return best


def _is_own_package(module: str, target: str) -> bool:
    """A package's `__init__` re-exporting its own submodules is how packages work."""
    return target.startswith(module + ".")


def test_every_module_belongs_to_a_layer():
    assert [m for m in _graph() if _layer(m) < 0] == []


def test_top_level_holds_only_the_facade_errors_paths_and_testing():
    top = {p.name for p in PACKAGE.glob("*.py")}
    assert top == TOP_LEVEL_MODULES


def test_every_package_says_what_it_holds():
    for init in PACKAGE.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc, f"{init.relative_to(ROOT)} has no docstring"
        assert len(doc.strip().splitlines()) <= 12, f"{init.relative_to(ROOT)}: say it short"


def test_no_import_reaches_a_higher_layer():
    upward = []
    for module, targets in _graph().items():
        for target in targets:
            if _is_own_package(module, target) or module == "kvrag":
                continue
            if _layer(target) > _layer(module):
                upward.append(f"{module} -> {target}")
    assert upward == []


def test_no_import_circle_of_any_kind_inside_kvrag():
    graph = {m: {t for t in ts if not _is_own_package(m, t)} for m, ts in _graph().items()}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def walk(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                walk(nxt, stack + [nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            walk(module, [module])
    assert cycles == []


def test_the_checker_sees_type_only_imports_and_circles(tmp_path):
    """The rules above can fail: a type-only import is found, and so is a circle it closes."""
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvrag.engine.engine import KVEngine\n"
    found = _imported("kvrag.core.schedule", PACKAGE / "core" / "schedule.py", ast.parse(source),
                      {"kvrag.engine.engine", "kvrag.core.schedule"})
    assert found == {"kvrag.engine.engine"}
    assert _layer("kvrag.engine.engine") > _layer("kvrag.core.schedule")


@pytest.mark.parametrize("root", ["kvrag", "integrations", "examples", "benchmarks"])
def test_no_module_imports_another_modules_private_names(root):
    offenders = []
    for path in sorted((ROOT / root).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("kvrag", "langchain_kvrag", "llama_index"):
                offenders += [f"{path.relative_to(ROOT)}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
                if any(part.startswith("_") for part in node.module.split(".")):
                    offenders.append(f"{path.relative_to(ROOT)}: {node.module}")
    assert not offenders, offenders


def _public(package: str) -> set[str]:
    """The names a package's `__init__` lists in `__all__` (read from the source, not imported)."""
    init = PACKAGE.joinpath(*package.split(".")[1:], "__init__.py")
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            return {ast.literal_eval(e) for e in node.value.elts}  # type: ignore[attr-defined]
    return set()


def test_integrations_import_only_public_names():
    """Adapters import kvrag's packages' `__all__` names only: `from kvrag import X` or
    `from kvrag.<package> import X`, never a module inside a package."""
    offenders = []
    for path in sorted((ROOT / "integrations").rglob("*.py")):
        if "tests" in path.parts or "build" in path.parts:  # build/: a copy pip made when installing it
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "kvrag":
                package_init = PACKAGE.joinpath(*node.module.split(".")[1:], "__init__.py")
                if node.module != "kvrag" and not package_init.exists() and node.module != "kvrag.errors":
                    offenders.append(f"{path.relative_to(ROOT)}: {node.module} is a module, not a package")
                    continue
                public = _public(node.module) if node.module != "kvrag.errors" else {a.name for a in node.names}
                offenders += [f"{path.relative_to(ROOT)}: {node.module}.{a.name}" for a in node.names if a.name not in public]
    assert offenders == []


def test_modules_and_functions_stay_a_readable_size():
    """No module over `MAX_MODULE_LINES` lines, no function over `MAX_FUNCTION_LINES` (docstring
    included): past those, a module holds two concepts or a function does two things."""
    long_modules, long_functions = [], []
    for path in PACKAGE.rglob("*.py"):
        source = path.read_text()
        where = str(path.relative_to(ROOT))
        if len(source.splitlines()) > MAX_MODULE_LINES:
            long_modules.append(f"{where}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if length > MAX_FUNCTION_LINES:
                    long_functions.append(f"{where}:{node.lineno} {node.name}: {length} lines")
    assert (long_modules, long_functions) == ([], [])
