"""mkdocs hook: the API reference pages list every public name from its module's ``__all__``, and every strategy the
registry registers (``<!-- strategies -->``).

A page holding ``<!-- api: torchshard.presets -->`` gets one ``::: torchshard.presets.NAME`` section per name, read
from the module's source with ``ast`` (building the docs imports neither torch nor JAX), so a name added to ``__all__``
gets its page without an edit here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"<!-- api: (?P<module>[\w.]+) -->")


def public_names(module: str) -> list[str]:
    """The names in ``module.__all__`` (a literal list in its source), in order."""
    path = ROOT.joinpath(*module.split("."))
    source = (path / "__init__.py") if path.is_dir() else path.with_suffix(".py")
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return [ast.literal_eval(e) for e in node.value.elts]  # type: ignore[attr-defined]
    raise ValueError(f"{source} has no literal __all__")


def expand(markdown: str) -> str:
    """Replaces each marker with the reference sections of its module's public names."""

    def sections(match: re.Match[str]) -> str:
        module = match["module"]
        return "\n\n".join(f"::: {module}.{name}" for name in public_names(module))

    return MARKER.sub(sections, markdown)


STRATEGIES_MARKER = "<!-- strategies -->"
REGISTRY = ROOT / "torchshard" / "_strategies" / "__init__.py"
SEARCHED = (("axis", "a mesh axis"), ("searched", "its option"))  # what plan --search lays out or sets for a strategy


def _module_file(module: str, roots: tuple[Path, ...]) -> Path:
    for root in roots:
        base = root.joinpath(*module.split("."))
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.exists():
                return candidate
    raise ValueError(f"no source for module {module} under {[str(r) for r in roots]}")


def registered(registry: Path = REGISTRY, roots: tuple[Path, ...] = (ROOT,)) -> list[dict[str, str]]:
    """Every strategy the registry registers, in order: its keyword, option class, flag and search, read with ast.

    A strategy module's ``STRATEGY = Strategy(keyword=..., option=..., flag=..., searched=..., axis=...)`` is
    read where the registry's ``register(alias.STRATEGY)`` lines point (its ``from X import Y as alias``).
    """
    tree = ast.parse(registry.read_text())
    modules: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                modules[a.asname or a.name] = f"{node.module}.{a.name}"
    found = []
    for node in tree.body:
        call = node.value if isinstance(node, ast.Expr) else None
        if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "register" and call.args:
            target = call.args[0]
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
                found.append(_strategy_of(_module_file(modules[target.value.id], roots)))
    return found


def _strategy_of(path: Path) -> dict[str, str]:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "STRATEGY" for t in node.targets):
            call = node.value
            assert isinstance(call, ast.Call)
            fields = {k.arg: k.value for k in call.keywords if k.arg}
            return {
                "keyword": ast.literal_eval(fields["keyword"]),
                "option": ast.unparse(fields["option"]),
                "flag": "yes" if "flag" in fields else "",
                "search": " and ".join(w for k, w in SEARCHED if k in fields),
            }
    raise ValueError(f"{path} defines no STRATEGY = Strategy(...)")


def strategy_table(strategies: list[dict[str, str]]) -> str:
    """The Trainer keywords the registered strategies add, as a markdown table."""
    rows = [
        f"| `{s['keyword']}=` | `{s['option']}` | {'`--' + s['keyword'].replace('_', '-') + '`' if s['flag'] else ''} "
        f"| {s['search']} |"
        for s in strategies
    ]
    header = "| Trainer keyword | option | `plan --compile` flag | `plan --search` gives it |\n|---|---|---|---|"
    return "\n".join([header, *rows])


def on_page_markdown(markdown: str, **_: Any) -> str:
    """The hook mkdocs calls: the API markers, and the registered strategies' table."""
    markdown = expand(markdown)
    if STRATEGIES_MARKER in markdown:
        markdown = markdown.replace(STRATEGIES_MARKER, strategy_table(registered()))
    return markdown
