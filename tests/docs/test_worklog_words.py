"""The tree speaks of the project, not of how it was made: no numbered work sessions, issue or
pull-request numbers, commit hashes or dates in the README, the docs or the code. A measurement
goes to docs/benchmarks.md with its CPU and command; history goes in commit messages."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CODE_DIRS = ("engine", "models", "server", "loadtest")
CODE_SUFFIXES = {".py", ".cpp", ".h"}

WORDS = {
    "a work session": re.compile(r"\bsessions? \d+|\b(?:this|that|next|last|a later|an earlier) session\b", re.I),
    "an issue or pull-request number": re.compile(
        r"\b(?:issues?|PR|pull requests?) #?\d+|(?<![\w&#/\]])#\d+\b", re.I),
    # 7-40 hex digits with a letter and a digit, standing alone: how `git rev-parse` names a commit.
    # Not part of a longer word, number or path (0x1f, 1.4426950f, a sha256 of 64 digits).
    "a commit hash": re.compile(r"(?<![\w.\-/+])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}(?![\w\-])"),
    "a date": re.compile(
        r"\b(?:19|20)\d\d-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])\b"
        r"|\b(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*\.? (?:\d{1,2}, )?(?:19|20)\d\d\b"),
}

# (path, text on the line) that may stay: say why for each.
ALLOWED: set[tuple[str, str]] = set()


def scanned_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "mkdocs.yml", *sorted((ROOT / "docs").rglob("*.md")),
             *sorted((ROOT / "docs").rglob("*.py"))]
    for name in CODE_DIRS:
        files += sorted(p for p in (ROOT / name).rglob("*") if p.suffix in CODE_SUFFIXES and p.is_file())
    return files


def worklog_words(path: Path) -> list[str]:
    rel = path.relative_to(ROOT).as_posix()
    found = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if any(rel == where and text in line for where, text in ALLOWED):
            continue
        for what, pattern in WORDS.items():
            match = pattern.search(line)
            if match:
                found.append(f"{rel}:{number}: {what} {match.group(0)!r}: {line.strip()[:120]}")
    return found


def test_the_readme_docs_and_code_carry_no_work_log_words():
    found = [hit for path in scanned_files() for hit in worklog_words(path)]
    assert not found, "work-log words (move measurements to docs/benchmarks.md):\n" + "\n".join(found)


@pytest.mark.parametrize("text", [
    "At f98eba0 (session 29) a decode ran faster", "measured in session 44", "see issue 16",
    "fixed in #123", "at c172f80, the same command", "on 2026-12-02", "in March 2026",
])
def test_the_words_it_finds(text):
    assert any(p.search(text) for p in WORDS.values())


@pytest.mark.parametrize("text", [
    "splat(1.44269504088896341f)", "mask 0x7fffffff", "#include <vector>", "sha256 " + "ab12" * 16,
    "a session-scoped fixture", "1024 tokens", "decade", "[link](#across-cpus)", "Q4_K_M, 491 MB",
])
def test_the_words_it_leaves(text):
    assert not any(p.search(text) for p in WORDS.values())
