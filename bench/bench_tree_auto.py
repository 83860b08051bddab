"""Draft trees with k="auto" against chains, in one process, interleaved.

The full bench_trees.py runs each config once after another, and on a shared 2-core
machine configs that run the same passes move by 10-20% in tokens/s. This one runs a few
decoders on one prompt in turn (the order reversed every other round) and reports the
median tokens/s and the tokens per target pass of each: the best fixed chain, chain auto
(k="auto") and draft tree auto (k="auto", draft_branches=2). SmolLM2-135M in float32 as
the target, the same GGUF kept in Q4_1 as the draft (bench_trees.py --draft quantized),
greedy, --threads threads.

    .venv/bin/python bench/bench_tree_auto.py [--prompt "open chat"] [--rounds 4]

Prints a table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import verispec
from verispec.decoder import SpecDecoder
from verispec.models import load

from bench_trees import PROMPTS

CONFIGS = {"draft chain k=3": dict(k=3), "draft chain auto": dict(k="auto", max_k=6),
           "draft tree b=2 auto": dict(k="auto", max_k=6, draft_branches=2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", default="open chat", choices=sorted(PROMPTS))
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench/out/tree_auto.json"))
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.new_tokens < 1:
        ap.error(f"--rounds and --new-tokens must be >= 1, got {args.rounds}, {args.new_tokens}")
    torch.set_num_threads(args.threads)
    model, tok = load("smollm2", dtype=torch.float32)
    draft, _ = load("smollm2")
    eos = list(tok.eos_token_ids)
    ids = list(tok.apply_chat_template([{"role": "user", "content": PROMPTS[args.prompt]}],
                                       add_generation_prompt=True, tokenize=True))
    blocks = -(-(len(ids) + args.new_tokens + 16) // 16) + 1
    decs = {name: SpecDecoder(model, draft, num_blocks=blocks, block_size=16, **kw)
            for name, kw in CONFIGS.items()}
    for d in decs.values():  # first calls pay one-off setup
        d.generate([ids], max_new_tokens=8, greedy=True, eos_token_id=eos)
    rates = {name: [] for name in decs}
    per_pass, tokens = {}, {}
    for rnd in range(args.rounds):
        order = list(decs) if rnd % 2 == 0 else list(decs)[::-1]
        for name in order:
            start = time.perf_counter()
            r = decs[name].generate([ids], max_new_tokens=args.new_tokens, greedy=True,
                                    eos_token_id=eos)[0]
            rates[name].append(len(r.tokens) / (time.perf_counter() - start))
            per_pass[name] = r.stats["tokens_per_target_pass"]
            tokens[name] = list(r.tokens)
    if len({tuple(t) for t in tokens.values()}) != 1:
        raise SystemExit("bench_tree_auto: greedy tokens differ between configs")
    med = {name: statistics.median(v) for name, v in rates.items()}
    chain = med["draft chain k=3"]
    print(f"{args.prompt}, {args.new_tokens} new tokens, {args.rounds} rounds, "
          f"{args.threads} threads")
    print(f"{'config':22} {'tok/s':>7} {'x chain k=3':>12} {'tok/pass':>9}")
    for name in decs:
        print(f"{name:22} {med[name]:7.1f} {med[name] / chain:12.2f} {per_pass[name]:9.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(
        benchmark="bench_tree_auto", verispec=verispec.__version__, prompt=args.prompt,
        rounds=args.rounds, new_tokens=args.new_tokens, threads=args.threads,
        tokens_per_s=rates, median_tokens_per_s=med, tokens_per_target_pass=per_pass),
        indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
