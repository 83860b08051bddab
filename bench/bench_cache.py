"""Paged KV block allocator benchmark.

1. Rollback cost against sequence length (1e3, 1e5, 1e6 tokens): a speculative step
   appends k draft slots and rolls back the rejected ones; the rollback must cost the
   same whatever the length (it touches only trailing blocks).
2. Operations per second of append / rollback / fork / free, native against the
   pure-Python allocator of the same design, measured side by side in one run.

Prints a table and writes JSON (--out). Timings are medians over repeats; the
machine is shared, so compare ratios within one run, not across runs.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import verispec
from verispec.reference_allocator import PyBlockAllocator

BLOCK_SIZE = 16
IMPLS = {"native": verispec.BlockAllocator, "python": PyBlockAllocator}


def time_rollback(impl, length: int, k: int, repeats: int) -> float:
    """Median ns of rollback(seq, length) after append(seq, k) at sequence `length`."""
    a = impl(length // BLOCK_SIZE + 16, BLOCK_SIZE)
    seq = a.add_sequence()
    a.append(seq, length)
    samples = []
    clock = time.perf_counter_ns
    for _ in range(repeats):
        a.append(seq, k)
        t0 = clock()
        a.rollback(seq, length)
        samples.append(clock() - t0)
    return statistics.median(samples)


def ops_per_second(impl, op: str, n: int, rounds: int) -> float:
    """Median rate of one operation over `n` calls, on 64 live sequences."""
    rates = []
    for _ in range(rounds):
        a = impl(64 * 64 + 4096, BLOCK_SIZE)
        seqs = [a.add_sequence() for _ in range(64)]
        for s in seqs:
            a.append(s, 100)
        if op == "append":
            calls = [(a.append, (seqs[i % 64], 1)) for i in range(n)]
        elif op == "rollback":
            for s in seqs:
                a.append(s, n // 64 + 1)
            calls = [(a.rollback, (seqs[i % 64], a.length(seqs[i % 64]) - 1 - i // 64)) for i in range(n)]
        elif op == "fork":
            calls = [(a.fork, (seqs[i % 64],)) for i in range(n)]
        elif op == "free":
            extra = [a.fork(seqs[i % 64]) for i in range(n)]
            calls = [(a.free, (s,)) for s in extra]
        else:
            raise ValueError(f"op must be append, rollback, fork or free, got {op!r}")
        t0 = time.perf_counter()
        for f, args in calls:
            f(*args)
        rates.append(n / (time.perf_counter() - t0))
    return statistics.median(rates)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench/out/cache.json"))
    ap.add_argument("--quick", action="store_true", help="fewer repeats (smoke run)")
    args = ap.parse_args(argv)
    repeats = 300 if args.quick else 3000
    n_ops, rounds = (2000, 3) if args.quick else (20000, 5)

    lengths = [1_000, 100_000, 1_000_000]
    rollback = {
        name: {str(L): time_rollback(impl, L, k=5, repeats=repeats) for L in lengths}
        for name, impl in IMPLS.items()
    }
    ops = {
        op: {name: ops_per_second(impl, op, n_ops, rounds) for name, impl in IMPLS.items()}
        for op in ("append", "rollback", "fork", "free")
    }

    print(f"verispec {verispec.__version__}  block_size={BLOCK_SIZE}  "
          f"python {platform.python_version()}  {platform.machine()}")
    print("\nrollback of 5 draft slots (median ns per call)")
    print(f"{'length':>10} | {'native':>8} | {'python':>8}")
    for L in lengths:
        print(f"{L:>10} | {rollback['native'][str(L)]:>8.0f} | {rollback['python'][str(L)]:>8.0f}")
    flat = max(rollback["native"].values()) / min(rollback["native"].values())
    print(f"native max/min over lengths: {flat:.2f}x (flat means ~1)")
    print("\noperations per second (64 live sequences)")
    print(f"{'op':>10} | {'native':>12} | {'python':>12} | {'ratio':>6}")
    for op, r in ops.items():
        print(f"{op:>10} | {r['native']:>12,.0f} | {r['python']:>12,.0f} | {r['native'] / r['python']:>5.1f}x")

    result = {
        "benchmark": "bench_cache",
        "version": verispec.__version__,
        "build_info": verispec.build_info(),
        "block_size": BLOCK_SIZE,
        "rollback_ns_median": rollback,
        "rollback_native_max_over_min": flat,
        "ops_per_second": ops,
        "ratio_native_over_python": {op: r["native"] / r["python"] for op, r in ops.items()},
        "argv": sys.argv[1:],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
