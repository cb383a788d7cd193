"""The package's own imports point down the layering, with no circles (read with ast, nothing imported)."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "torchshard"
# top to bottom: a layer may import the layers below it, never one above; public faces sit on top
LAYERS = (
    "_search", "_report", "_interop", "_ckpt", "_generate", "_trainer", "_strategies", "_train", "_hlo", "_multihost",
    "_spmd", "_presets", "_sharding", "_bridge", "_base",
)  # fmt: skip
PUBLIC_FACES = (
    "__init__", "__main__", "launch", "presets", "collectives", "distributed", "inspect", "lm_eval", "track",
)  # fmt: skip


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path) -> set[str]:
    """Every torchshard module ``path`` imports, at any depth of the file (lazy imports count)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("torchshard")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("torchshard"):
            module = node.module or ""
            # `from torchshard._x import y` imports y as a module when y is one
            found |= {f"{module}.{a.name}" if _exists(f"{module}.{a.name}") else module for a in node.names}
    return found


def _exists(module: str) -> bool:
    base = PACKAGE.parent.joinpath(*module.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): {m for m in _imports(p) if m != _module_name(p)} for p in PACKAGE.rglob("*.py")}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def test_top_level_holds_only_public_faces():
    private = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem not in PUBLIC_FACES)
    assert private == [], f"private modules belong in a layer's folder ({', '.join(LAYERS)}), not at the top: {private}"


def test_every_layer_says_what_it_is_for_and_may_import():
    for layer in LAYERS:
        doc = ast.get_docstring(ast.parse((PACKAGE / layer / "__init__.py").read_text())) or ""
        assert "import" in doc.lower(), f"{layer}/__init__.py must say what the folder is for and what it may import"


def test_imports_point_down_the_layers():
    upward = []
    for module, imports in _graph().items():
        mine = _layer(module)
        if mine is None:
            continue  # public faces may import any layer
        for imported in imports:
            theirs = _layer(imported)
            if theirs is None and imported != "torchshard":
                upward.append(f"{module} imports the public face {imported}")
            elif theirs is not None and LAYERS.index(theirs) < LAYERS.index(mine):
                upward.append(f"{module} ({mine}) imports {imported} ({theirs}), a layer above it")
    assert upward == [], "imports must point down " + " > ".join(LAYERS) + ":\n" + "\n".join(sorted(upward))


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node], _ = 1, path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node], _ = 2, path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_circles():
    graph = {m: {i for i in deps if not i.endswith("__init__")} for m, deps in _graph().items()}
    # the package's __init__ imports everything; a module importing `torchshard` itself is checked by the layer test
    graph = {m: deps - {"torchshard"} for m, deps in graph.items()}
    assert _cycle(graph) is None, "import circle: " + " -> ".join(_cycle(graph) or [])


@pytest.mark.parametrize(
    "graph, expected", [({"a": {"b"}, "b": {"a"}}, ["a", "b", "a"]), ({"a": {"b"}, "b": set()}, None)]
)
def test_the_circle_finder_finds_circles(graph, expected):
    assert _cycle(graph) == expected


def _defined_privates(tree: ast.AST) -> set[str]:
    """The private attributes (``_x``) a module defines: its classes' methods and attributes, and ``obj._x = ...``."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    names.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
                elif isinstance(item, ast.Assign):
                    names |= {t.id for t in item.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _foreign_reads(source: str, watched: set[str]) -> list[str]:
    """Each ``obj._x`` read in ``source`` whose ``_x`` is one of ``watched`` and not defined in ``source`` itself."""
    tree = ast.parse(source)
    mine = _defined_privates(tree)
    return [
        f"{ast.unparse(node)} (line {node.lineno})"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)
        if node.attr in watched and node.attr not in mine
    ]


def test_no_private_attribute_of_the_trainer_is_read_outside_its_module():
    # the Trainer is one shared state (`Core`) and parts that receive it: none reaches into another's privates
    watched = set().union(*(_defined_privates(ast.parse(p.read_text())) for p in (PACKAGE / "_trainer").glob("*.py")))
    found = [
        f"{path.relative_to(PACKAGE.parent)}: {read}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for read in _foreign_reads(path.read_text(), watched)
    ]
    assert found == [], (
        "a private attribute is read outside the module that defines it; read the part's public method, or the "
        "field of the Core the parts share (torchshard/_trainer/core.py):\n" + "\n".join(found)
    )


@pytest.mark.parametrize(
    "source, expected",
    [
        ("def f(trainer):\n    return trainer._core", ["trainer._core (line 2)"]),
        ("class A:\n    def __init__(self):\n        self._core = 1\n    def f(self):\n        return self._core", []),
        ("def f(trainer):\n    return trainer._other", []),
    ],
)
def test_the_private_read_finder_finds_foreign_reads(source, expected):
    assert _foreign_reads(source, {"_core"}) == expected


MAX_LINES = 400  # a module past this is two jobs: split it by job, imports still pointing down
MAX_FMT_SKIPS = 30  # hand layouts only where they are clearer than ruff's (tables); the rest is formatted


def _private_imports(path: pathlib.Path) -> list[str]:
    """Every private name (``_x``) ``path`` takes from another torchshard module: imported, or read off an import."""
    tree = ast.parse(path.read_text())
    found, modules = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("torchshard"):
            for alias in node.names:
                if _exists(f"{node.module}.{alias.name}"):
                    modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                elif alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"from {node.module} import {alias.name}")
        elif isinstance(node, ast.Import):
            modules |= {a.asname: a.name for a in node.names if a.asname and a.name.startswith("torchshard")}
    for node in ast.walk(tree):
        read = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
        if read and node.attr.startswith("_") and not node.attr.startswith("__"):
            found.append(f"{modules[node.value.id]}.{node.attr} (line {node.lineno})")
    return [f"{path.relative_to(PACKAGE.parent)}: {f}" for f in found]


def test_no_private_name_is_imported_across_modules():
    found = [line for path in sorted(PACKAGE.rglob("*.py")) for line in _private_imports(path)]
    assert found == [], (
        "a name another module needs is public (no underscore, with a docstring) or moves to a module both import:\n"
        + "\n".join(found)
    )


def test_no_module_is_over_the_line_limit():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py") if (n := _lines(p)) > MAX_LINES}
    assert long == {}, f"modules over {MAX_LINES} lines; split each by job, imports still pointing down: {long}"


def _lines(path: pathlib.Path) -> int:
    return len(path.read_text().splitlines())


def test_few_hand_layouts_in_the_package():
    counts = {str(p.relative_to(PACKAGE.parent)): p.read_text().count("fmt: skip") for p in PACKAGE.rglob("*.py")}
    total = sum(counts.values())
    most = sorted(((n, p) for p, n in counts.items() if n), reverse=True)[:5]
    assert total <= MAX_FMT_SKIPS, (
        f"{total} `# fmt: skip` in torchshard/ (at most {MAX_FMT_SKIPS}): let ruff format the code where it reads "
        f"fine, keep hand layouts for tables; most in {most}"
    )
