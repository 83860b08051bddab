"""The README's commands run as written (tools/readme_commands.py extracts them).

Every ``verispec`` line parses and passes the option checks a run makes before loading
a model (so a renamed option or a flag that does not apply fails here); the cheap ones
run as written in a fresh folder (info, lab, build_info, the Python examples on the
bundled model), the generate lines with 8 new tokens and one round. The whole list as
written: ``.venv/bin/python tools/readme_commands.py``.
"""

import shlex
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import readme_commands  # noqa: E402

from verispec import cli  # noqa: E402
from verispec.cli import common  # noqa: E402

COMMANDS = readme_commands.commands(readme_commands.README.read_text(encoding="utf-8"))
VERISPEC = [c for c in COMMANDS if c.kind == "shell"
            and shlex.split(c.text, comments=True)[0] == "verispec"]
RUN = [c for c in COMMANDS if not c.skip]


def test_the_readme_has_the_commands_it_promises():
    shell = [c.text for c in COMMANDS if c.kind == "shell"]
    two = [t for t in shell if t.startswith("make ")]
    assert [t.split()[1] for t in two[:2]] == ["demo", "test"], two  # the two commands
    assert any("pip install" in t for t in shell[:1]), shell[:1]     # the install line first
    assert len(VERISPEC) >= 6 and len(RUN) >= 6


@pytest.mark.parametrize("command", VERISPEC, ids=[f"README.md:{c.line}" for c in VERISPEC])
def test_every_verispec_line_parses_and_passes_the_option_checks(command):
    argv = shlex.split(command.text, comments=True)[1:]
    args = cli.build_parser().parse_args(argv)
    if args.command in ("generate", "serve"):
        common._check_draft_options(args)
    if args.command == "generate":
        common._sampling(args)


def test_the_checks_can_fail():
    """The parse test above fails on a line that does not parse or does not apply."""
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["generate", "--prompt", "x", "--k", "100"])
    args = cli.build_parser().parse_args(["generate", "--prompt", "x", "--early-exit-layers", "8"])
    with pytest.raises(common.UsageError, match="argument --early-exit-layers"):
        common._check_draft_options(args)


@pytest.mark.parametrize("command", RUN, ids=[f"README.md:{c.line}" for c in RUN])
def test_the_runnable_lines_run(command):
    passed, tail = readme_commands.run(command, quick=True, timeout=900)
    assert passed, f"README.md:{command.line}: {command.text[:80]}: {tail}"


def test_the_readmes_links_into_docs_point_at_headings():
    import re

    from test_docs import _prose_lines, slug

    root = readme_commands.ROOT
    text = readme_commands.README.read_text(encoding="utf-8")
    broken = []
    for line in _prose_lines(text):
        for page, anchor in re.findall(r"\]\((docs/[\w.-]+\.md)(?:#([\w-]+))?\)", line):
            target = root / page
            if not target.is_file():
                broken.append(page)
            elif anchor and anchor not in {slug(x.lstrip("#")) for x in
                                           _prose_lines(target.read_text(encoding="utf-8"))
                                           if x.startswith("#")}:
                broken.append(f"{page}#{anchor}")
    assert not broken, "README.md links to missing pages or anchors: " + ", ".join(broken)
