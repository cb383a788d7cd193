"""mkdocs hook: the API reference pages list every public name from its module's ``__all__``.

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


def on_page_markdown(markdown: str, **_: Any) -> str:
    return expand(markdown)
