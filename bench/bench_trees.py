"""n-gram chains against n-gram tries on SmolLM2-135M (CPU): tokens per target pass and
tokens/s.

Prompts: a copy-heavy rewrite, an open chat, and a text of repeated phrases whose
continuations differ (where a trie's other branches should pay). Drafts: plain
decoding, n-gram chains (NGram(1, 4), k in CHAIN_KS; the best chain is the one with the
highest tokens/s), and n-gram tries (NGram(1, 4, branches=b), k nodes). Greedy, so every
config emits the same tokens (checked). Each config runs `--repeats` times, interleaved
(plain, c1, ..., plain, c1, ...), and reports the median tokens/s; writes JSON and prints
a table.

    .venv/bin/python bench/bench_trees.py [--threads 2] [--new-tokens 96] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

import verispec
from verispec.decoder import SpecDecoder
from verispec.drafters import NGram
from verispec.models import load

PARAGRAPH = ("On Tuesday the city councel met to discuss the new park. Residents asked for more "
             "trees, a playground for the childrn, better lighting along the paths, and benches "
             "near the pond. The councel agreed to publish a plan next month and to hold another "
             "meeting in the libary.")
REPEATED = ("The red box holds the keys. The red box holds the maps. The red box sits on the "
            "shelf. The blue box holds the coins. The blue box sits under the desk. The red box "
            "holds the letters. The blue box holds the stamps.")
PROMPTS = {
    "rewrite (copy-heavy)": "Correct the spelling of 'libary' in this text and return the whole "
                            "text:\n\n" + PARAGRAPH,
    "open chat": "Tell me a short story about a robot who learns to paint.",
    "repeated phrases": "Continue this list of sentences in the same style, ten more:\n\n"
                        + REPEATED,
}
CHAIN_KS = (4, 8, 16)
TREES = ((2, 8), (4, 8), (4, 16))  # (branches, k nodes)


def configs():
    yield "plain", None, 0
    for k in CHAIN_KS:
        yield f"chain k={k}", NGram(1, 4), k
    for b, k in TREES:
        yield f"trie b={b} k={k}", NGram(1, 4, branches=b), k


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench/out/trees.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = load("smollm2")
    SpecDecoder(model, NGram(1, 4, branches=2), k=4, num_blocks=16).generate(
        [[1, 2, 3, 1, 2]], max_new_tokens=4)  # warm up
    rows = []
    for pname, text in PROMPTS.items():
        ids = list(tok.apply_chat_template([{"role": "user", "content": text}],
                                           add_generation_prompt=True, tokenize=True))
        decs = [(name, SpecDecoder(model, draft, k=k, num_blocks=128, block_size=16))
                for name, draft, k in configs()]
        rates = {name: [] for name, _ in decs}
        passes = {}
        tokens = {}
        for _ in range(args.repeats):
            for name, dec in decs:
                start = time.perf_counter()
                r = dec.generate([ids], max_new_tokens=args.new_tokens, greedy=True,
                                 eos_token_id=tok.eos_token_ids)[0]
                rates[name].append(len(r.tokens) / (time.perf_counter() - start))
                passes[name] = r.stats["tokens_per_target_pass"]
                tokens[name] = r.tokens
        for name, _ in decs:
            if tokens[name] != tokens["plain"]:
                raise SystemExit(f"{pname} / {name}: greedy tokens differ from plain decoding")
        plain = statistics.median(rates["plain"])
        for name, _ in decs:
            tps = statistics.median(rates[name])
            rows.append(dict(prompt=pname, draft=name, tokens=len(tokens[name]),
                             tokens_per_s=tps, speedup=tps / plain,
                             tokens_per_target_pass=passes[name]))
    best = {}
    for pname in PROMPTS:
        mine = [r for r in rows if r["prompt"] == pname]
        chain = max((r for r in mine if r["draft"].startswith("chain")), key=lambda r: r["tokens_per_s"])
        trie = max((r for r in mine if r["draft"].startswith("trie")), key=lambda r: r["tokens_per_s"])
        best[pname] = dict(best_chain=chain["draft"], best_trie=trie["draft"],
                           trie_over_chain=trie["tokens_per_s"] / chain["tokens_per_s"])
    print(f"{'prompt':22} {'draft':16} {'tok/s':>7} {'x plain':>8} {'tok/pass':>9}")
    for r in rows:
        print(f"{r['prompt']:22} {r['draft']:16} {r['tokens_per_s']:7.1f} {r['speedup']:8.2f} "
              f"{r['tokens_per_target_pass']:9.2f}")
    for pname, b in best.items():
        print(f"{pname}: best trie ({b['best_trie']}) / best chain ({b['best_chain']}) = "
              f"{b['trie_over_chain']:.2f}x tokens/s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(
        verispec=verispec.__version__, machine=platform.machine(), threads=args.threads,
        new_tokens=args.new_tokens, repeats=args.repeats, rows=rows, best=best), indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
