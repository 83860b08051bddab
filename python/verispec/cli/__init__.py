"""The verispec command line: ``verispec <command>`` or ``python -m verispec <command>``.

    verispec generate --chat "Fix the typos: ..." --greedy      # stream, then speedup vs plain
    verispec lab --p 0.6,0.3,0.1 --q 0.2,0.5,0.3                # exact table + native check + PNG
    verispec bench --quick                                     # side-by-side benchmark
    verispec info --json                                       # build, torch, GPU, model package
    verispec serve --model smollm2 --draft ngram --k auto       # OpenAI-compatible HTTP server

Exit status: 0 done; 1 the lab's empirical check rejected the sampler; 2 a usage error
(bad argument, missing package or model, an option that does not apply to the chosen
drafter), reported in one line naming the argument, what it expected and what it got,
without the usage block (``--help`` prints that) or a traceback (set VERISPEC_DEBUG=1 to
see it); 130 interrupted. Heavy imports (torch, the models)
happen inside the commands, so ``--help`` is instant.

The package, one module per job: ``parser`` (the arguments and their value checks),
``common`` (what the commands share: loading, device checks, the policy, the draft and
its options, the warm-up), ``calibrate`` (early exit's depth from measured acceptance),
``speed`` (the speed report's verdict), and one module per command: ``generate`` (with its tensor-parallel path
and its timing), ``serve``, ``lab``, ``bench`` and ``info``. The names below are
re-exported for callers of ``verispec.cli``; a test that patches a helper patches it
in the module that defines it.
"""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

from verispec.cli.bench import ProgressBar, cmd_bench
from verispec.cli.common import (BLOCK_SIZE, DEFAULT_MODEL, DTYPES, PROG, UsageError,
                                 _check_device, _describe_policy, _draft_choice, _load,
                                 _make_draft, _model_kind, _sampling, _warm_up, _weights_desc)
from verispec.cli.generate import cmd_generate
from verispec.cli.info import cmd_info, collect_info
from verispec.cli.lab import cmd_lab
from verispec.cli.parser import build_parser
from verispec.cli.serve import cmd_serve

__all__ = ["main", "build_parser", "collect_info", "UsageError", "ProgressBar", "PROG",
           "DEFAULT_MODEL", "DTYPES", "BLOCK_SIZE", "cmd_generate", "cmd_serve", "cmd_lab",
           "cmd_bench", "cmd_info"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the command line; returns the exit status (never raises SystemExit)."""
    parser = build_parser()
    try:
        args, extras = parser.parse_known_args(argv)
    except SystemExit as e:  # argparse's own errors (status 2) and --help (0)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    if extras:  # named with the command whose options they are not
        prog = f"{PROG} {args.command}" if args.command else PROG
        print(f"{prog}: error: argument {extras[0]}: expected one of the options of {prog}, "
              f"got {' '.join(extras)} (the options: {prog} --help)", file=sys.stderr)
        return 2
    if args.version:
        from verispec import __version__

        print(f"verispec {__version__}")
        return 0
    if args.command is None:
        print(f"{PROG}: error: expected a command (generate, serve, lab, bench or info), got "
              f"none (the commands: {PROG} --help)", file=sys.stderr)
        return 2
    prog = f"{PROG} {args.command}"
    try:
        return int(args.run(args) or 0)
    except UsageError as e:
        if os.environ.get("VERISPEC_DEBUG"):
            raise
        sys.stdout.flush()
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        sys.stdout.flush()
        print(f"\n{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `verispec generate ... | head`: stop quietly
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        return 1

