"""Runs the README's commands as written, so that the README stays true.

Every line of the README's ``bash`` blocks and every ``python`` block is one of:

- run: ``verispec ...`` (as ``python -m verispec ...`` with this interpreter), ``python
  -c ...`` and the Python examples, each in a fresh temporary folder (``verispec lab``
  writes lab.png there); a command fails on a non-zero exit status or a traceback;
- skipped, with the reason: what installs or builds (``pip``, ``make``: CI runs ``make
  test`` on a fresh clone), the server (it runs until stopped), the
  side-by-side benchmark (minutes), training a head (an hour), and Python examples that need a model this machine
  may not have (a path or a Hugging Face id).

    .venv/bin/python tools/readme_commands.py            # everything runnable, as written
    .venv/bin/python tools/readme_commands.py --quick    # generate with 8 new tokens, 1 round
    .venv/bin/python tools/readme_commands.py --list     # the classification only

Exit status 0 when every run command passed. tests/test_readme.py uses the same
extraction (every verispec line parses and passes the option checks; the cheap ones run).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
_FENCE = re.compile(r"^\s*```\s*([\w+-]*)\s*$")
QUICK = ["--max-new-tokens", "8", "--repeats", "1"]
# Python examples that load something this machine need not have
_NEEDS_A_MODEL = ("path/to/", "Qwen/")


@dataclass
class Command:
    line: int            # 1-based line in the README
    kind: str            # "shell" or "python"
    text: str            # the line as written, or the Python block
    skip: str = ""       # why it is not run ("" if it is)

    def argv(self, quick: bool = False) -> list[str]:
        """The command with this interpreter standing for ``verispec`` and ``python``."""
        words = shlex.split(self.text, comments=True)
        if words[0] == "verispec":
            words = [sys.executable, "-m", "verispec"] + words[1:]
        elif words[0] == "python":
            words = [sys.executable] + words[1:]
        if quick and words[3:4] == ["generate"]:
            words += QUICK
        return words


def blocks(text: str) -> list[tuple[int, str, list[str]]]:
    """(first code line, language, lines) of each fenced block."""
    out, lang, start, lines = [], None, 0, []
    for number, line in enumerate(text.splitlines(), start=1):
        fence = _FENCE.match(line)
        if lang is None:
            if fence:
                lang, start, lines = fence.group(1), number + 1, []
        elif fence and not fence.group(1):
            out.append((start, lang, lines))
            lang = None
        else:
            lines.append(line)
    return out


def _why_skipped(words: list[str]) -> str:
    if words[0] == "pip":
        return "installs packages"
    if words[0] == "make":
        return ("sets up a venv and builds (minutes); CI runs `make test` on a fresh clone "
                "(.ci/run), `make demo` is the same venv and build plus one generate")
    if words[0] == "verispec" and words[1:2] == ["serve"]:
        return "a server: runs until stopped (tests/test_serve.py drives it)"
    if words[0] == "verispec" and words[1:2] == ["bench"]:
        return "the side-by-side benchmark: minutes (tests/test_cli.py checks its command line)"
    if words[0] == "verispec" and words[1:2] == ["train-head"]:
        return ("trains a head: about an hour on a 2-core CPU (tests/test_train_head.py trains "
                "a tiny one through the same command)")
    if words[0] in ("verispec", "python"):
        return ""
    return f"not a verispec or python command ({words[0]})"


def commands(text: str) -> list[Command]:
    found = []
    for start, lang, lines in blocks(text):
        if lang == "bash":
            for offset, line in enumerate(lines):
                words = shlex.split(line, comments=True)
                if words:
                    found.append(Command(start + offset, "shell", line.strip(),
                                         _why_skipped(words)))
        elif lang == "python":
            code = "\n".join(lines) + "\n"
            needs = next((n for n in _NEEDS_A_MODEL if n in code), None)
            found.append(Command(start, "python", code,
                                 f"needs a model this machine may not have ({needs!r})"
                                 if needs else ""))
    return found


def run(command: Command, quick: bool = False, timeout: float = 600) -> tuple[bool, str]:
    """(passed, what it printed last) of one command, in a fresh temporary folder."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with tempfile.TemporaryDirectory() as cwd:
        argv = (command.argv(quick) if command.kind == "shell"
                else [sys.executable, "-c", command.text])
        proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                              env=env)
    output = (proc.stdout + proc.stderr).strip()
    passed = proc.returncode == 0 and "Traceback" not in output
    return passed, f"exit {proc.returncode}: " + " | ".join(output.splitlines()[-3:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"append {' '.join(QUICK)} to generate commands")
    ap.add_argument("--list", action="store_true", help="classify only, run nothing")
    args = ap.parse_args(argv)
    failed = 0
    for c in commands(README.read_text(encoding="utf-8")):
        title = c.text if c.kind == "shell" else f"python block: {c.text.splitlines()[0]} ..."
        if c.skip:
            print(f"skip  README.md:{c.line}: {title}  ({c.skip})")
            continue
        if args.list:
            print(f"run   README.md:{c.line}: {title}")
            continue
        passed, tail = run(c, args.quick)
        failed += not passed
        print(f"{'ok  ' if passed else 'FAIL'}  README.md:{c.line}: {title}\n      {tail}",
              flush=True)
    if not args.list:
        print(f"{'all run commands passed' if not failed else f'{failed} failed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
