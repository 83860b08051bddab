"""What one call of a verispec op costs on tiny tensors, by how the tensors are taken.

The native ops take torch tensors through the DLPack C exchange API of their type (torch
>= 2.10, DLPack >= 1.3 header; no Python-level call) and other tensors through
``__dlpack__``. This times each op both ways in one process, in alternating rounds:
"c_exchange_api" (what torch users get) and "__dlpack__" (every tensor handed to the native
entry point wrapped in an object that has only ``__dlpack__``). Sizes are tiny, so the
time is the call itself: argument checks, tensor import, output allocation. The table gives
the median us per call, the difference, and that difference per tensor imported. JSON out.

    .venv/bin/python bench/bench_overhead.py --out bench/out/overhead.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import verispec
from verispec import _C, ops


class DlpackOnly:
    """A tensor seen through __dlpack__ only (its type has no C exchange API)."""

    def __init__(self, t):
        self.t = t

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()

    def __dlpack__(self, stream=None, max_version=None):
        return self.t.__dlpack__(stream=stream, max_version=max_version)


@contextlib.contextmanager
def through(path: str, name: str, counter: list):
    """Calls of _C.<name> with tensors taken by `path`; counts the tensors per call."""
    real = getattr(_C, name)

    def wrapped(*args, **kwargs):
        values = list(args) + list(kwargs.values())
        counter[0] = sum(isinstance(a, torch.Tensor) for a in values)
        if path == "__dlpack__":
            args = [DlpackOnly(a) if isinstance(a, torch.Tensor) else a for a in args]
            kwargs = {k: DlpackOnly(v) if isinstance(v, torch.Tensor) else v
                      for k, v in kwargs.items()}
        return real(*args, **kwargs)

    setattr(_C, name, wrapped)
    try:
        yield
    finally:
        setattr(_C, name, real)


def cases():
    g = torch.Generator().manual_seed(0)
    target = torch.randn(1, 5, 16, generator=g)
    drafts = torch.randint(0, 16, (1, 4), generator=g)
    q = torch.softmax(torch.randn(1, 4, 16, generator=g), dim=-1)
    logits = torch.randn(1, 16, generator=g)
    probs = torch.softmax(logits, dim=-1)
    x, w = torch.randn(2, 16, generator=g), torch.randn(16, 16, generator=g)
    return {
        "verify": ("verify", lambda i: ops.verify(target, drafts, q, seed=1, offset=i)),
        "apply_policy": ("apply_policy", lambda i: ops.apply_policy(logits, top_p=0.9)),
        "sample": ("sample", lambda i: ops.sample(probs, seed=1, offset=i)),
        "linear": ("linear", lambda i: ops.linear(x, w)),
    }


def per_call_us(fn, calls: int) -> float:
    start = time.perf_counter()
    for i in range(calls):
        fn(i)
    return (time.perf_counter() - start) / calls * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench/out/overhead.json"))
    ap.add_argument("--calls", type=int, default=2000, help="calls per round")
    ap.add_argument("--rounds", type=int, default=7, help="alternating rounds (median)")
    ap.add_argument("--quick", action="store_true", help="200 calls, 2 rounds (a smoke run)")
    args = ap.parse_args(argv)
    if args.quick:
        args.calls, args.rounds = 200, 2
    fast_path = _C._dlpack_import_path(torch.empty(0))
    print(f"verispec {verispec.__version__}, torch {torch.__version__}, python "
          f"{platform.python_version()}; torch tensors are taken through {fast_path}",
          file=sys.stderr)

    rows = []
    for op, (entry, fn) in cases().items():
        times = {"c_exchange_api": [], "__dlpack__": []}
        tensors = [0]
        for path in times:  # warm up both
            with through(path, entry, tensors):
                per_call_us(fn, 20)
        for _ in range(args.rounds):
            for path in times:
                with through(path, entry, tensors):
                    times[path].append(per_call_us(fn, args.calls))
        fast = statistics.median(times["c_exchange_api"])
        slow = statistics.median(times["__dlpack__"])
        rows.append({"op": op, "tensors": tensors[0], "c_exchange_api_us": fast,
                     "dlpack_us": slow, "saved_us": slow - fast,
                     "saved_us_per_tensor": (slow - fast) / max(tensors[0], 1),
                     "rounds_us": times})

    print(f"\n{'op':>12} | tensors | C exchange API us | __dlpack__ us | saved us | per tensor")
    print("-" * 82)
    for r in rows:
        print(f"{r['op']:>12} | {r['tensors']:7d} | {r['c_exchange_api_us']:17.1f} | "
              f"{r['dlpack_us']:13.1f} | {r['saved_us']:8.1f} | {r['saved_us_per_tensor']:10.2f}")
    if fast_path != "c_exchange_api":
        print(f"\nnote: this build or torch has no C exchange API; both columns are {fast_path}")
    result = {"verispec": verispec.__version__, "torch": torch.__version__,
              "torch_tensor_import": fast_path, "calls": args.calls, "rounds": args.rounds,
              "quick": args.quick, "ops": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
