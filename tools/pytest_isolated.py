"""Runs pytest so that a test that kills the process does not hide the tests after it.

    python tools/pytest_isolated.py [-m MARKEXPR] [--per-test-timeout S] FILES... [PYTEST_OPTIONS]

The first run is one ordinary pytest process (verbose, so each outcome is on record;
unknown options such as --junitxml=F go to it). If that process dies by a signal (a
segfault in native code, an abort), every collected test without a recorded outcome is
run again, each in its own process, and the ones that crash again are named. Made for
bench/gpu_check.sh: a lent GPU machine is rare, and one crash must not cost the rest.

Exit status: pytest's own when the first run ended normally; otherwise 1 (a crash is a
failure even when every test passes alone), after the summary of what failed where.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

OUTCOME = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
BAD = {"FAILED", "ERROR"}


def pytest_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args]


def run_streaming(cmd: list[str]) -> tuple[int, list[str]]:
    """Runs cmd, echoing its output as it comes; returns (returncode, lines)."""
    lines = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          errors="replace") as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            lines.append(line.rstrip("\n"))
    sys.stdout.flush()
    return proc.returncode, lines


def recorded_outcomes(lines: list[str]) -> dict[str, str]:
    outcomes = {}
    for line in lines:
        m = OUTCOME.match(line)
        if m:
            outcomes[m.group(1)] = m.group(2)
    return outcomes


def collect(files: list[str], markexpr: str | None) -> list[str]:
    args = ["--collect-only", "-q", *files]
    if markexpr:
        args += ["-m", markexpr]
    out = subprocess.run(pytest_cmd(*args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, errors="replace").stdout
    return [line.strip() for line in out.splitlines() if "::" in line and " " not in line.strip()]


def describe(returncode: int) -> str:
    if returncode < 0:
        return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("files", nargs="+", help="test files")
    parser.add_argument("-m", dest="markexpr", default=None, help="pytest -m expression")
    parser.add_argument("--per-test-timeout", type=float, default=120.0,
                        help="seconds for each isolated rerun (default 120)")
    args, extra = parser.parse_known_args(argv)
    if args.per_test_timeout <= 0:
        parser.error(f"--per-test-timeout must be > 0, got {args.per_test_timeout}")

    first = ["-v", "-rs", *args.files, *extra]
    if args.markexpr:
        first += ["-m", args.markexpr]
    returncode, lines = run_streaming(pytest_cmd(*first))
    if returncode >= 0:
        return returncode

    outcomes = recorded_outcomes(lines)
    ids = collect(args.files, args.markexpr)
    left = [i for i in ids if i not in outcomes]
    print(f"\npytest_isolated: the run died ({describe(returncode)}) after {len(outcomes)} "
          f"recorded outcomes; rerunning the {len(left)} other tests one process each",
          flush=True)
    results = {}
    for node in left:
        print(f"--- alone: {node}", flush=True)
        try:
            proc = subprocess.run(pytest_cmd("-q", "-rs", node), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, errors="replace",
                                  timeout=args.per_test_timeout)
            sys.stdout.write(proc.stdout)
            rc = proc.returncode
            if rc in (0, 5):  # passed or skipped; 5: nothing left to run after deselection
                results[node] = "passed"
            elif rc < 0:
                results[node] = f"CRASHED ({describe(rc)})"
            else:
                results[node] = f"FAILED ({describe(rc)})"
        except subprocess.TimeoutExpired as e:
            out = e.stdout or ""
            sys.stdout.write(out if isinstance(out, str) else out.decode(errors="replace"))
            results[node] = f"TIMED OUT after {args.per_test_timeout:g} s"
    sys.stdout.flush()

    bad_before = sorted(i for i, o in outcomes.items() if o in BAD)
    bad_after = {i: r for i, r in results.items() if r != "passed"}
    print(f"\npytest_isolated: before the crash {len(outcomes)} outcomes, "
          f"{len(bad_before)} failed; isolated reruns {len(results) - len(bad_after)} passed, "
          f"{len(bad_after)} not")
    for node in bad_before:
        print(f"  {outcomes[node]} (first run): {node}")
    for node, result in bad_after.items():
        print(f"  {result}: {node}")
    if not left:
        print("  no test was left to rerun: the process died outside a test")
    return 1  # the first run died: a failure even if every test passes alone

if __name__ == "__main__":
    sys.exit(main())
