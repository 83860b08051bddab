"""``verispec lab``: the exactness lab (verispec.lab) from the command line: the exact
table, the native empirical check, the chart and lab.json."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

from verispec.cli.common import UsageError, _check_device


def cmd_lab(args: argparse.Namespace) -> int:
    from verispec import lab

    p, q = args.p, args.q
    if len(p) != len(q):
        raise UsageError(f"argument --q: expected {len(p)} probabilities (as many as --p), got {len(q)}")
    labels = None
    if args.labels is not None:
        labels = [x.strip() for x in args.labels.split(",")]
        if len(labels) != len(p):
            raise UsageError(f"argument --labels: expected {len(p)} names (one per token), "
                             f"got {len(labels)}")
    out_dir = Path(args.out) if args.out else Path(".")
    plot_path = None
    no_matplotlib = False
    if not args.no_plot:
        plot_path = Path(args.plot) if args.plot else out_dir / "lab.png"
        if importlib.util.find_spec("matplotlib") is None:
            if args.plot:  # asked for by name: refused before any work
                raise UsageError(f"argument --plot: the bar chart needs matplotlib, not installed "
                                 f"here (pip install matplotlib), got --plot {args.plot}")
            # the default chart: the table and the check still print, the chart is skipped
            plot_path, no_matplotlib = None, True
    _check_device(args.device)

    t = lab.table(p, q)
    print(f"exact step, in {'rationals' if args.decimals is None else 'decimals'}:")
    for line in lab.format_table(t, labels=labels, decimals=args.decimals):
        print("  " + line)
    check = None
    if args.draws > 0:
        t0 = time.perf_counter()
        check = lab.empirical_check(p, q, args.draws, seed=args.seed, device=args.device,
                                    alpha=args.alpha)
        print(f"\nempirical check: {args.draws} native accept/correct steps (verispec.ops.verify, "
              f"k = 1, {args.device}, seed {args.seed}, {time.perf_counter() - t0:.2f} s):")
        for line in check.format(labels=labels):
            print("  " + line)
    if plot_path is not None or args.out:
        out_dir.mkdir(parents=True, exist_ok=True)
    if plot_path is not None:
        plot_path.parent.mkdir(parents=True, exist_ok=True)
        lab.plot(t, plot_path, check=check, labels=labels)
        print(f"\nwrote {plot_path}")
    elif no_matplotlib:
        print("no chart: matplotlib is not installed (pip install matplotlib, or pass --no-plot)",
              file=sys.stderr)
    if args.out:
        record = {"p": [str(x) for x in t.p], "q": [str(x) for x in t.q],
                  "acceptance": [str(x) for x in t.acceptance],
                  "accepted_mass": [str(x) for x in t.accepted_mass],
                  "rejection_mass": str(t.rejection_mass), "residual": [str(x) for x in t.residual],
                  "recovered": [str(x) for x in t.recovered], "exact": t.exact,
                  "empirical": None if check is None else check.to_dict()}
        (out_dir / "lab.json").write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {out_dir / 'lab.json'}")
    return 0 if check is None or check.passed else 1
