"""The tree speaks of the project, not of how it was made: no numbered work sessions, issue or
pull-request numbers, commit hashes or dates in the READMEs, the docs, the code or the tests. A measurement
goes to docs/benchmarks.md with its CPU and command; history goes in commit messages."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CODE_DIRS = ("engine", "models", "server", "loadtest", "tests")
CODE_SUFFIXES = {".py", ".cpp", ".h"}
# Not the project's own words: the virtualenv, the built site, caches, third-party checkouts.
SKIPPED_DIRS = {".venv", "site", ".git", ".pytest_cache", ".mypy_cache", ".ruff_cache", "node_modules", "shared"}

WORDS = {
    "a work session": re.compile(r"\bsessions? \d+|\b(?:this|that|next|last|a later|an earlier) session\b", re.I),
    "an issue or pull-request number": re.compile(r"\b(?:issues?|PR|pull requests?) #?\d+|(?<![\w&#/\]])#\d+\b", re.I),
    # 7-40 hex digits with a letter and a digit, standing alone: how `git rev-parse` names a commit.
    # Not part of a longer word, number or path (0x1f, 1.4426950f, a sha256 of 64 digits).
    "a commit hash": re.compile(r"(?<![\w.\-/+])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}(?![\w\-])"),
    "a date": re.compile(
        r"\b(?:19|20)\d\d-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])\b"
        r"|\b(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*\.? (?:\d{1,2}, )?(?:19|20)\d\d\b"
    ),
}

# (path, text on the line) that may stay: say why for each. Hex test data and sha256 pins need no
# entry while they are longer than a commit hash (the pattern stops at 40 digits); a shorter one
# goes here.
ALLOWED: set[tuple[str, str]] = set()


def markdown_files() -> list[Path]:
    """Every *.md of the project: the README, docs/, and the READMEs beside the code (loadtest/,
    deploy/k8s/, ...)."""
    found = []
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS]  # pruned, not walked and filtered
        found += [Path(folder, name) for name in names if name.endswith(".md")]
    return sorted(found)


def scanned_files() -> list[Path]:
    files = [ROOT / "mkdocs.yml", *markdown_files(), *sorted((ROOT / "docs").rglob("*.py"))]
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


def test_the_scan_reaches_the_readmes_beside_the_code_and_the_tests():
    scanned = {p.relative_to(ROOT).as_posix() for p in scanned_files()}
    assert {"README.md", "loadtest/README.md", "deploy/k8s/README.md", "tests/docs/test_worklog_words.py"} <= scanned


def test_the_readme_docs_code_and_tests_carry_no_work_log_words():
    found = [hit for path in scanned_files() for hit in worklog_words(path)]
    assert not found, "work-log words (move measurements to docs/benchmarks.md):\n" + "\n".join(found)


# What it finds, put together at run time so that this file carries none of it.
SESSION, ISSUE, HASH, OTHER_HASH = "ses" + "sion", "is" + "sue", f"{0xF98EBA0:07x}", f"{0xC172F80:07x}"


@pytest.mark.parametrize(
    "text",
    [
        f"At {HASH} ({SESSION} 29) a decode ran faster",
        f"measured in {SESSION} 44",
        f"see {ISSUE} 16",
        "fixed in #" + "123",
        f"at {OTHER_HASH}, the same command",
        "on " + "-".join(("2026", "12", "02")),
        f"in March {2026}",
    ],
)
def test_the_words_it_finds(text):
    assert any(p.search(text) for p in WORDS.values())


@pytest.mark.parametrize(
    "text",
    [
        "splat(1.44269504088896341f)",
        "mask 0x7fffffff",
        "#include <vector>",
        "sha256 " + "ab12" * 16,
        "a session-scoped fixture",
        "1024 tokens",
        "decade",
        "[link](#across-cpus)",
        "Q4_K_M, 491 MB",
    ],
)
def test_the_words_it_leaves(text):
    assert not any(p.search(text) for p in WORDS.values())
