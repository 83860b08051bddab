"""``verispec bench``: runs verispec.benchmark with a progress bar, then prints its
tables and the files it wrote."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Optional, TextIO

from verispec.cli.common import UsageError, _missing_package


def _progress_stream_is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class ProgressBar:
    """progress(done, total, label) -> a bar on ``stream``: redrawn in place on a terminal,
    one line per update otherwise (logs, CI)."""

    def __init__(self, stream: Optional[TextIO] = None, width: int = 28) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.width = width
        self.tty = _progress_stream_is_tty(self.stream)
        self.start = time.perf_counter()
        self.drawn = False

    def __call__(self, done: int, total: int, label: str = "") -> None:
        frac = min(max(done / total, 0.0), 1.0) if total else 1.0
        filled = int(round(frac * self.width))
        bar = "#" * filled + "-" * (self.width - filled)
        line = (f"[{bar}] {done}/{total} {100 * frac:3.0f}% "
                f"{time.perf_counter() - self.start:6.1f} s  {label}")
        if self.tty:
            self.stream.write("\r\x1b[2K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        self.drawn = True

    def close(self) -> None:
        if self.tty and self.drawn:
            self.stream.write("\n")
            self.stream.flush()


def _default_bench_dir() -> Path:
    return Path("bench/out") if Path("bench").is_dir() else Path("verispec-bench")


def cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    try:
        benchmark = importlib.import_module("verispec.benchmark")
    except ModuleNotFoundError as e:
        if e.name in ("verispec.benchmark", None):
            raise UsageError("this verispec install has no benchmark module (verispec.benchmark); "
                             "install a version that ships it") from None
        raise UsageError(_missing_package(e, "the benchmark")) from None
    out_dir = Path(args.out) if args.out else _default_bench_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    kwargs: dict = dict(max_new_tokens=args.max_new_tokens, quick=args.quick, threads=args.threads)
    if args.repeats is not None:
        kwargs["repeats"] = args.repeats
    bar = ProgressBar(sys.stderr)
    started = time.time()
    try:
        benchmark.run(out_dir, progress=bar, **kwargs)
    except ModuleNotFoundError as e:
        raise UsageError(_missing_package(e, "the benchmark")) from None
    finally:
        bar.close()
    written = sorted(f for f in out_dir.rglob("*") if f.is_file() and f.stat().st_mtime >= started - 1)
    tables = [f for f in written if f.suffix == ".md"]
    for md in tables:
        print(md.read_text().rstrip())
        print()
    print(f"wrote {len(written)} files to {out_dir}:")
    for f in written:
        print(f"  {f}")
    return 0
