"""The code blocks of README.md and docs/*.md that a test runs against a live server.

A block is runnable when the line just before its opening fence is `<!-- runnable -->` (an HTML
comment: neither GitHub nor MkDocs shows it):

    <!-- runnable -->
    ```bash
    curl -s http://127.0.0.1:8000/v1/models
    ```

Mark a block only if it runs as written against the default server (`make serve`: the default
model on 127.0.0.1:8000, no other flags). A file's runnable blocks run in order in one scope, so
a block may use what an earlier one defined (the `client`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- runnable -->"
FENCE = re.compile(r"^```(\w*)\s*$")
# Where the docs say the default server listens: swapped for the test server's address.
DEFAULT_URLS = ("http://127.0.0.1:8000", "http://localhost:8000")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    section: str  # the heading the block is under
    runnable: bool

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT).as_posix()}:{self.line}"

    def against(self, url: str) -> str:
        """The code with the default server's address replaced by `url`."""
        code = self.code
        for default in DEFAULT_URLS:
            code = code.replace(default, url)
        return code


def blocks(path: Path) -> list[Block]:
    """Every fenced block of a Markdown file, runnable or not."""
    found, section = [], ""
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("#") and not lines[i].startswith("#!"):
            section = lines[i].lstrip("#").strip()
        fence = FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        runnable = i > 0 and lines[i - 1].strip() == MARKER
        found.append(Block(path, i + 1, fence.group(1), "\n".join(lines[i + 1 : end]) + "\n", section, runnable))
        i = end + 1
    return found


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def runnable(path: Path, section: str | None = None) -> list[Block]:
    """A file's runnable blocks in order, or those under one heading."""
    return [b for b in blocks(path) if b.runnable and (section is None or b.section == section)]
