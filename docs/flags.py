"""Writes docs/configuration.md from the server's own argparse parser, so the flag reference
cannot drift from `python -m server --help`.

    .venv/bin/python docs/flags.py            # rewrite docs/configuration.md
    .venv/bin/python docs/flags.py --check    # exit 1 if the committed page is stale

tests/server/test_flags_doc.py runs the check in `make test`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "configuration.md"

HEADER = """\
# Configuration

Every flag of `python -m server` (the `pagedserve` console script takes the same). This page is
generated from the server's argument parser by `docs/flags.py`; a test fails when it is stale.
`make serve ARGS="--port 9000"` passes flags through `make`.

Environment: `PAGEDSERVE_API_KEY` (the same as `--api-key`), `PAGEDSERVE_CACHE` (where fetched
models are kept, default `~/.cache/pagedserve`), `HF_HUB_OFFLINE=1` (hub ids from the local cache
only), `PAGEDSERVE_CPU_ISA=<target>` (pick a CPU kernel build, [Design](design.md#how-a-kernel-is-chosen)),
`PAGEDSERVE_HUGEPAGES=0` (no huge-page arena), `PAGEDSERVE_WIDE_TILES=0` (8-lane tiles on AVX-512
builds), `PAGEDSERVE_AMX_TILES=0` (no AMX tiles on the `avx512amx` build; the same bits either way).
"""


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _row(action: argparse.Action) -> str:
    names = ", ".join(f"`{s}`" for s in action.option_strings)
    if action.nargs == 0:
        value = ""
    else:
        value = (
            f"`{action.metavar or action.dest.upper()}`"
            if not action.choices
            else " \\| ".join(f"`{c}`" for c in action.choices)
        )
    default = "" if action.default in (None, False, argparse.SUPPRESS) else f"`{action.default}`"
    return f"| {names} | {value} | {default} | {_cell(action.help or '')} |"


def render(parser: argparse.ArgumentParser) -> str:
    out = [HEADER]
    for group in parser._action_groups:  # argparse keeps its groups in this private list only
        actions = [a for a in group._group_actions if a.option_strings and a.dest != "help"]
        if not actions:
            continue
        title = "General" if group.title == "options" else group.title[0].upper() + group.title[1:]
        out += [f"## {title}", "", "| flag | value | default | what it does |", "|---|---|---|---|"]
        out += [_row(a) for a in actions]
        out.append("")
    return "\n".join(out)


def main() -> int:
    sys.path.insert(0, str(ROOT))
    from server.__main__ import build_parser

    text = render(build_parser())
    if "--check" in sys.argv[1:]:
        if PAGE.read_text() != text:
            print(f"{PAGE.relative_to(ROOT)} is stale: run `python docs/flags.py`", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
