"""verispec vs Hugging Face transformers, side by side, on SmolLM2-135M (CPU).

A thin wrapper over verispec.benchmark.run (also ``verispec bench``): three pairings
(plain decoding vs generate, n-gram lookup vs prompt lookup, a draft model vs assisted
generation with the same draft), greedy, interleaved repeats. Prints the Markdown
table; writes bench.json, bench.md and bench.png into --out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from verispec import benchmark


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench/out"), help="output folder")
    ap.add_argument("--new-tokens", type=int, default=128, help="max new tokens per generation")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats (median)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--quick", action="store_true", help="one prompt, 16 tokens, 1 repeat")
    args = ap.parse_args(argv)

    def progress(done: int, total: int, label: str) -> None:
        print(f"[{done}/{total}] {label}", file=sys.stderr, flush=True)

    benchmark.run(args.out, max_new_tokens=args.new_tokens, repeats=args.repeats,
                  quick=args.quick, threads=args.threads, progress=progress)
    print((args.out / "bench.md").read_text())
    print(f"wrote {args.out / 'bench.json'}, {args.out / 'bench.md'}, {args.out / 'bench.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
