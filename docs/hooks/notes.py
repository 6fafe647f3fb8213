"""An mkdocs hook: the ``[Note: ...]`` blocks of the source, collected into the design pages.

The design is written where the code is, as FSDP2 does: a block opens with ``[Note: name]`` at the start of a docstring
paragraph or a comment, and other places cite it by name. This hook reads every module of ``lightning_zero/`` and
replaces a placeholder ``<!-- notes -->`` (every note), ``<!-- notes: path/prefix -->`` (the notes of the modules
under that path, relative to ``lightning_zero/``) or ``<!-- notes: folder/* -->`` (the modules directly in that folder,
not in its subpackages) with one section per note: its name as the heading (so a page can
link ``#note-flat-layout``), the module it lives in, and its text. The site therefore never says something the code
no longer does.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
from typing import Any

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "lightning_zero"
_PLACEHOLDER = re.compile(r"^<!-- notes(?::\s*(\S+))?\s*-->$", re.MULTILINE)
# A definition starts a line: "[Note: name] Text..." in a docstring (maybe right after its opening quotes, or after a
# list item's bold heading, "2. **Heading.** [Note: name] Text") or a comment, or "[Note: name]" alone on its line
# with the text in the lines below. A citation that merely wraps to the start of a line is followed by ")", ",", "."
# or a joining word ("in ...", "and ..."), never by the start of a sentence.
_OPENING = re.compile(
    r'^\s*(?P<comment>#\s*)?(?:[rbu]?""")?(?:(?:\d+\.|-)\s+\*\*[^*]+\*\*\s+)?\[Note: (?P<name>[^\]]+)\](?P<rest>.*)$'
)
_STARTS_TEXT = re.compile(r"^ +(?!(?:in|and|or|above|below|of|for|on|at)\b)[A-Za-z(`*]")
_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj):`(~?)([^`]+)`")


@dataclasses.dataclass
class Note:
    name: str
    module: str  # path relative to the repository root
    text: str
    anchor: str = ""  # set by collect(): unique on the site


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _role(match: re.Match[str]) -> str:
    short, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


def _paragraph(lines: list[str], start: int, rest: str, comment: bool) -> str:
    """The note's text: ``rest`` of the opening line, then the lines up to a blank one or the end of the docstring."""
    body = [rest.strip()] if rest.strip() else []
    for line in lines[start + 1 :]:
        stripped = line.strip()
        if comment:
            if not stripped.startswith("#"):
                break
            stripped = stripped.lstrip("#").strip()
            if not stripped:
                break
        elif not stripped or stripped.startswith('"""'):
            break
        body.append(stripped.split('"""')[0].rstrip())
        if '"""' in stripped:
            break
    text = "\n".join(body)
    return _ROLE.sub(_role, text.replace("``", "`"))


def collect(package: pathlib.Path = PACKAGE) -> list[Note]:
    """Every note defined in ``package``, in module order. A note may go on where its code does (the docstring of a
    method it explains): a later paragraph of the same module under the same name is appended to the first. Two
    modules may each have a note of one name (their own ``tensor roles``): a citation names the module then."""
    notes: dict[tuple[str, str], Note] = {}
    for path in sorted(package.rglob("*.py")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            match = _OPENING.match(line)
            if match is None:
                continue
            rest, comment = match["rest"], match["comment"] is not None
            if not (_STARTS_TEXT.match(rest) or not rest.strip()):
                continue
            name = match["name"]
            module = str(path.relative_to(package.parent))
            text = _paragraph(lines, i, rest, comment)
            if (module, name) in notes:
                notes[module, name].text += "\n\n" + text
            else:
                notes[module, name] = Note(name, module, text)
    names = [name for _, name in notes]
    for (module, name), note in notes.items():
        unique = names.count(name) == 1
        note.anchor = "note-" + _slug(name if unique else f"{name} {module.removesuffix('.py')}")
    return list(notes.values())


def render(notes: list[Note]) -> str:
    sections = []
    for note in notes:
        sections.append(f"### [Note: {note.name}] {{#{note.anchor}}}\n\n*In `{note.module}`.*\n\n{note.text}\n")
    return "\n".join(sections)


def _selected(module: str, prefix: str | None) -> bool:
    if prefix is None:
        return True
    if prefix.endswith("/*"):
        return str(pathlib.PurePath(module).parent) == f"lightning_zero/{prefix[:-2]}"
    return module.startswith(f"lightning_zero/{prefix}")


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    if "<!-- notes" not in markdown:
        return markdown
    notes = collect()

    def replace(match: re.Match[str]) -> str:
        prefix = match.group(1)
        chosen = [n for n in notes if _selected(n.module, prefix)]
        if not chosen:
            raise ValueError(f"<!-- notes: {prefix} --> selects no note: no module under lightning_zero/{prefix}")
        return render(chosen)

    return _PLACEHOLDER.sub(replace, markdown)
