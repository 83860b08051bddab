"""n-gram k="auto" against plain decoding under load, in one process (no HTTP).

``bench_serve.py`` measures the servers, where one cell moves by +-10% between rounds on a
shared 2-core machine. This runs the same work without the server: --concurrency copies
of one of bench_serve's prompts through ``SpecDecoder(model, NGram(1, 3), k="auto")`` and
``SpecDecoder(model, None, k=0)``, greedy, --runs times each, interleaved (the order
reversed every other run), and reports each run's tokens/s, the medians, the per-run
ratios and the tokens per target pass. Greedy, so both must return the same tokens
(checked).

    .venv/bin/python bench/bench_auto_load.py [--dtype float32] [--concurrency 64]

Prints a table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from verispec.decoder import SpecDecoder
from verispec.drafters import NGram
from verispec.models import load

from bench_serve import PROMPTS


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", default="open chat", choices=sorted(PROMPTS))
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32"),
                    help="auto: the GGUF's Q4_1 kept quantized; float32: dequantized")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench/out/auto_load.json"))
    args = ap.parse_args(argv)
    if args.concurrency < 1 or args.runs < 1 or args.new_tokens < 1:
        ap.error(f"--concurrency, --runs and --new-tokens must be >= 1, got "
                 f"{args.concurrency}, {args.runs}, {args.new_tokens}")
    torch.set_num_threads(args.threads)
    model, tok = load("smollm2", dtype=torch.float32 if args.dtype == "float32" else None)
    eos = list(tok.eos_token_ids)
    ids = list(tok.apply_chat_template([{"role": "user", "content": PROMPTS[args.prompt]}],
                                       add_generation_prompt=True, tokenize=True))
    blocks = args.concurrency * (-(-(len(ids) + args.new_tokens + 16) // 16) + 1)
    decs = {"plain": SpecDecoder(model, None, k=0, num_blocks=blocks),
            "auto": SpecDecoder(model, NGram(1, 3), k="auto", num_blocks=blocks)}
    for d in decs.values():  # first calls pay one-off setup
        d.generate([ids] * 2, max_new_tokens=4, greedy=True, eos_token_id=eos)
    rates: dict[str, list[float]] = {n: [] for n in decs}
    per_pass, tokens = {}, {}
    for run in range(args.runs):
        for name in (list(decs) if run % 2 == 0 else list(decs)[::-1]):
            start = time.perf_counter()
            rs = decs[name].generate([ids] * args.concurrency, max_new_tokens=args.new_tokens,
                                     greedy=True, eos_token_id=eos)
            seconds = time.perf_counter() - start
            n = sum(len(r.tokens) for r in rs)
            rates[name].append(n / seconds)
            per_pass[name] = n / max(1, sum(r.stats["steps"] for r in rs))
            tokens[name] = [r.tokens for r in rs]
            print(f"run {run + 1}/{args.runs} {name:5} {n / seconds:8.1f} tok/s", flush=True)
    if tokens["auto"] != tokens["plain"]:
        raise SystemExit("greedy tokens of auto differ from plain decoding")
    ratios = [a / p for a, p in zip(rates["auto"], rates["plain"])]
    print(f"\n{args.prompt}, concurrency {args.concurrency}, --dtype {args.dtype}:")
    print(f"{'':6} {'median tok/s':>13} {'tokens/pass':>12}")
    for name in decs:
        print(f"{name:6} {statistics.median(rates[name]):13.1f} {per_pass[name]:12.2f}")
    print(f"auto / plain per run: {' / '.join(f'{r:.3f}' for r in ratios)}; median "
          f"{statistics.median(ratios):.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(
        benchmark="bench_auto_load", prompt=args.prompt, dtype=args.dtype,
        concurrency=args.concurrency, runs=args.runs, new_tokens=args.new_tokens,
        threads=args.threads, tokens_per_s=rates, tokens_per_target_pass=per_pass,
        auto_over_plain_per_run=ratios, greedy_tokens_equal=True), indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
