"""The code blocks of the docs marked ``<!-- runnable -->`` run, each as a user would paste it.

A marker is the line right before a fenced ``bash`` or ``python`` block in ``docs/**/*.md`` or ``README.md``. A bash
block runs under ``bash -euo pipefail`` and a python block as a script (Lightning's popen launcher re-executes
``sys.argv`` for rank 1, so a Trainer with ``devices=2`` needs a file), each in a fresh directory that holds a link
to ``examples/`` and nothing else, with a free rendezvous port. Whatever the block writes stays in that directory.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.cli import cli_env

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- runnable -->"
_FENCE = re.compile(r"^```(\w+)\s*$")
LANGUAGES = ("bash", "python")


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    language: str
    code: str


def runnable_blocks(page: Path, root: Path = ROOT) -> list[Block]:
    """The blocks of ``page`` right after a marker; a marker not followed by a bash or python block is an error."""
    lines = page.read_text().splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if line.strip() != MARKER:
            continue
        fence = _FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
        where = f"{page.relative_to(root)}:{i + 1}"
        if fence is None or fence.group(1) not in LANGUAGES:
            raise ValueError(f"{where}: {MARKER} must be followed by a ```bash or ```python block")
        end = next((j for j in range(i + 2, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise ValueError(f"{where}: the block after {MARKER} is never closed")
        code = "\n".join(lines[i + 2 : end]) + "\n"
        blocks.append(Block(str(page.relative_to(root)), i + 2, fence.group(1), code))
    return blocks


PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCKS = [block for page in PAGES for block in runnable_blocks(page)]


def test_the_collector_reads_markers_and_refuses_a_dangling_one(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(f"text\n{MARKER}\n```bash\necho one\necho two\n```\n\n```bash\nnot marked\n```\n")
    assert runnable_blocks(page, tmp_path) == [Block("page.md", 3, "bash", "echo one\necho two\n")]
    page.write_text(f"{MARKER}\n```text\noutput\n```\n")
    with pytest.raises(ValueError, match=r"page.md:1: <!-- runnable --> must be followed by a ```bash"):
        runnable_blocks(page, tmp_path)


def test_the_docs_have_runnable_examples() -> None:
    # The getting-started page's example, a Trainer snippet and the command line, at least.
    assert {b.page for b in BLOCKS} >= {"docs/getting-started.md", "docs/index.md"}
    assert {b.language for b in BLOCKS} == set(LANGUAGES)


def _run(block: Block, cwd: Path) -> subprocess.CompletedProcess[str]:
    (cwd / "examples").symlink_to(ROOT / "examples")
    if block.language == "python":
        (cwd / "snippet.py").write_text(block.code)
        command = [sys.executable, "snippet.py"]
    else:
        command = ["bash", "-euo", "pipefail", "-c", block.code]
    env = cli_env()
    bin_dir = str(Path(sys.executable).parent)  # `python` and the console scripts of this interpreter
    env["PATH"] = bin_dir + ":" + env.get("PATH", "")
    return subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=150, start_new_session=True
    )


@pytest.mark.timeout(180)
@pytest.mark.parametrize("block", BLOCKS, ids=[f"{b.page}:{b.line}" for b in BLOCKS])
def test_runnable_block(block: Block, tmp_path: Path) -> None:
    result = _run(block, tmp_path)
    output = (result.stdout + result.stderr)[-4000:]
    assert result.returncode == 0, f"{block.page}:{block.line} exited {result.returncode}:\n{output}"
