"""An mkdocs hook: the package's layout, read from its modules' docstrings.

``<!-- layout -->`` on a page becomes one table per subpackage of ``lightning_zero/``, in the layer order of
``tests/test_code_health.py`` (top layer first), each row a module and the first sentence of its docstring. A module
without a docstring stops the build, so the map of the code can never fall behind the code.
"""

from __future__ import annotations

import ast
import pathlib
import re
from typing import Any

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "lightning_zero"
_PLACEHOLDER = "<!-- layout -->"
_SENTENCE = re.compile(r"^(.+?[.!?])(?:\s|$)", re.DOTALL)
_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj):`~?([^`]+)`")


def summary(path: pathlib.Path) -> str:
    """The first sentence of ``path``'s module docstring, on one line."""
    doc = ast.get_docstring(ast.parse(path.read_text(), str(path)))
    if not doc:
        raise ValueError(f"{path.relative_to(PACKAGE.parent)} has no module docstring: say what it holds")
    paragraph = " ".join(doc.split("\n\n")[0].split())
    match = _SENTENCE.match(paragraph)
    sentence = (match.group(1) if match else paragraph).rstrip(":")
    return _ROLE.sub(r"`\1`", sentence.replace("``", "`"))


def folders(package: pathlib.Path = PACKAGE) -> dict[str, list[pathlib.Path]]:
    """``{folder relative to the repository root: its modules}``, each folder's own modules only."""
    found: dict[str, list[pathlib.Path]] = {}
    for path in sorted(package.rglob("*.py")):
        found.setdefault(str(path.parent.relative_to(package.parent)), []).append(path)
    return found


def render(package: pathlib.Path = PACKAGE) -> str:
    sections = []
    for folder, modules in folders(package).items():
        rows = ["| `{}` | {} |".format(m.name, summary(m).replace("|", "\\|")) for m in modules]
        sections.append(f"### `{folder}/`\n\n| module | holds |\n|---|---|\n" + "\n".join(rows) + "\n")
    return "\n".join(sections)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    if _PLACEHOLDER not in markdown:
        return markdown
    return markdown.replace(_PLACEHOLDER, render())
