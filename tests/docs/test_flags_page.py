"""docs/configuration.md is generated from the server's parser: it must match what
`python docs/flags.py` writes now, so a new or changed flag cannot go undocumented."""

import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_flag_reference_matches_the_servers_parser():
    from server.__main__ import build_parser

    render = runpy.run_path(str(ROOT / "docs" / "flags.py"))["render"]
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == render(build_parser()), "docs/configuration.md is stale: run `python docs/flags.py`"


def test_every_flag_is_on_the_page():
    from server.__main__ import build_parser

    page = (ROOT / "docs" / "configuration.md").read_text()
    flags = [s for a in build_parser()._actions for s in a.option_strings if s.startswith("--") and s != "--help"]
    assert flags and all(f"`{flag}`" in page for flag in flags)
