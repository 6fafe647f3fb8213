"""The ``[Note: ...]`` blocks of the source, as ``docs/hooks/notes.py`` collects them for the design pages.

Every citation ``[Note: name]`` anywhere in ``lightning_zero/`` must name a note some module defines: a design page
built from the notes must never point at a note that is not there (renamed, moved, or never written).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("docs_hooks_notes", ROOT / "docs" / "hooks" / "notes.py")
assert _spec is not None and _spec.loader is not None
notes = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = notes  # dataclasses look their module up there
_spec.loader.exec_module(notes)

_CITATION = re.compile(r"\[Note:\s+([^\]]+)\]")


def _citations(package: Path) -> list[tuple[str, str]]:
    """``(file:line, name)`` of every ``[Note: name]`` in ``package``, definitions included, names on one line."""
    found = []
    for path in sorted(package.rglob("*.py")):
        text = path.read_text()
        for match in _CITATION.finditer(text):
            name = " ".join(match.group(1).replace("#", " ").split())
            found.append((f"{path.relative_to(package.parent)}:{text.count(chr(10), 0, match.start()) + 1}", name))
    return found


def test_the_collector_tells_definitions_from_citations(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "mod.py").write_text(
        '"""[Note: first] The first note,\n'
        "wrapped.\n\n"
        "1. **A heading.** [Note: second] Text of the second.\n\n"
        "A paragraph that cites [Note: first] and, wrapped to a new line,\n"
        "[Note: second] in ``pkg/mod.py``.\n"
        '"""\n\n'
        "# [Note: third] lower-case text\n"
        "# goes on here.\n"
    )
    collected = {n.name: n.text for n in notes.collect(package)}
    assert collected == {
        "first": "The first note,\nwrapped.",
        "second": "Text of the second.",
        "third": "lower-case text\ngoes on here.",
    }


def test_every_cited_note_is_defined() -> None:
    package = ROOT / "lightning_zero"
    defined = {note.name for note in notes.collect(package)}
    undefined = [f"{where}: [Note: {name}]" for where, name in _citations(package) if name not in defined]
    assert undefined == [], "cited but defined nowhere (define it, or cite the note's exact name)"
    assert len(defined) >= 40  # the design pages are built from them
