"""The `<!-- runnable -->` marker convention (tests/docs/runnable_blocks.py), checked without a server:
tests/e2e/test_default_model_server.py runs the marked blocks against one."""

from __future__ import annotations

import pytest

from tests.docs.runnable_blocks import DEFAULT_URLS, MARKER, ROOT, blocks, documents, runnable


@pytest.mark.parametrize("document", documents(), ids=lambda d: d.name)
def test_every_marker_stands_just_before_a_fence(document):
    lines = document.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        if line.strip() == MARKER:
            assert number < len(lines) and lines[number].startswith("```"), f"{document.name}:{number}: no block after"


def test_marked_blocks_are_shell_or_python_and_a_file_first_names_the_default_server():
    marked = [b for d in documents() for b in runnable(d)]
    assert marked
    for block in marked:
        assert block.language in ("bash", "python"), block.where()
    for first in (runnable(d)[0] for d in documents() if runnable(d)):
        assert any(url in first.code for url in DEFAULT_URLS), f"{first.where()}: names no server"


def test_the_readme_first_request_and_structured_output_examples_are_marked():
    readme = runnable(ROOT / "README.md")
    assert [b.section for b in readme] == ["Talk to it"] * 2 + ["Structured output and tool calls"] * 2
    assert readme[0].language == "bash" and "curl" in readme[0].code


def test_the_parser_reads_fences_markers_and_sections(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A\n\n```bash\nmake serve\n```\n\n## B\n\n" + MARKER + "\n```python\nprint(1)\n```\n")
    found = blocks(page)
    assert [(b.language, b.section, b.runnable, b.code) for b in found] == [
        ("bash", "A", False, "make serve\n"),
        ("python", "B", True, "print(1)\n"),
    ]
