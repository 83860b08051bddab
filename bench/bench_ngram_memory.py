"""n-gram lookup with a memory across requests against prompt-only lookup, on repeated
agent-style requests (SmolLM2-135M-Instruct, CPU, batch 1, greedy).

Three request families written for this benchmark, each a series of requests whose
prompts vary (a tool-call JSON answer for different cities, edits of one file, answers
in one template for different products). For each family, in one run: the series
through prompt-only ``NGram`` (k auto), and through ``NGram(memory=NGramMemory())``
(k auto, one tenant), each request timed; the first request of a series has an empty
memory and is left out of the figures. Prints tokens per target pass, tokens/s and the
ratio per family, checks that both give the same tokens, and writes JSON.

llama.cpp's ngram-cache is not rerun here (its tools are not installed on this machine).

    python bench/bench_ngram_memory.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

import torch

import verispec
from verispec.decoder import SpecDecoder
from verispec.drafters import NGram, NGramMemory
from verispec.models import load

TOOL = ('You can call one tool. Answer with JSON only, in this form: {"tool": "get_weather", '
        '"arguments": {"city": "<city>", "unit": "celsius"}}.\nUser: What is the weather in ')
FILE = ("def total_price(items, tax):\n    subtotal = 0\n    for item in items:\n"
        "        subtotal = subtotal + item.price * item.quantity\n    return subtotal * (1 + tax)\n")
TEMPLATE = ("Describe the product in exactly this format:\nName: <name>\nPrice: <price>\n"
            "Summary: <one sentence>\nProduct: ")
FAMILIES = {
    "tool-call JSON": [TOOL + c + "?" for c in
                       ("Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Denver", "Hanoi", "Perth")],
    "edits of one file": [f"{e} Return the whole function.\n\n{FILE}" for e in (
        "Rename `subtotal` to `amount`.", "Rename `items` to `products`.",
        "Rename `tax` to `rate`.", "Add a docstring.", "Rename `item` to `entry`.",
        "Rename `total_price` to `price_with_tax`.", "Use `+=` in the loop.",
        "Rename `quantity` to `count`.")],
    "templated answers": [TEMPLATE + p for p in (
        "a red umbrella", "a steel water bottle", "a wool scarf", "a desk lamp",
        "a pair of running shoes", "a coffee grinder", "a paper notebook", "a phone case")],
}


def run_series(target, tok, drafter, prompts, new_tokens):
    dec = SpecDecoder(target, drafter, k="auto", num_blocks=512)
    eos = list(tok.eos_token_ids)
    out = []
    for p in prompts:
        ids = tok.apply_chat_template([{"role": "user", "content": p}],
                                      add_generation_prompt=True, tokenize=True)
        t0 = time.perf_counter()
        r = dec.generate([ids], max_new_tokens=new_tokens, greedy=True, eos_token_id=eos,
                         tenant="agent")[0]
        out.append(dict(seconds=time.perf_counter() - t0, tokens=list(r.tokens),
                        emitted=r.stats["emitted"], passes=r.stats["steps"],
                        accepted=r.stats["accepted"], proposed=r.stats["proposed"]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--memory-tokens", type=int, default=32768)
    ap.add_argument("--quick", action="store_true", help="3 requests a family, 24 tokens")
    ap.add_argument("--out", type=Path, default=Path("bench/out/ngram_memory.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    families = {k: v[:3] for k, v in FAMILIES.items()} if args.quick else FAMILIES
    if args.quick:
        args.new_tokens = 24
    target, tok = load("smollm2")
    run_series(target, tok, NGram(1, 3), ["warm up"], 8)
    rows = []
    for name, prompts in families.items():
        plain = run_series(target, tok, NGram(1, 3), prompts, args.new_tokens)
        memory = run_series(target, tok, NGram(1, 3, memory=NGramMemory(args.memory_tokens)),
                            prompts, args.new_tokens)
        row = dict(family=name, requests=len(prompts) - 1,
                   same_tokens=all(a["tokens"] == b["tokens"] for a, b in zip(plain, memory)))
        for label, series in (("prompt_only", plain), ("memory", memory)):
            later = series[1:]
            tokens = sum(s["emitted"] for s in later)
            row[label] = dict(tokens_per_target_pass=tokens / sum(s["passes"] for s in later),
                              tok_s=tokens / sum(s["seconds"] for s in later),
                              acceptance=(sum(s["accepted"] for s in later)
                                          / max(1, sum(s["proposed"] for s in later))))
        row["speedup"] = row["memory"]["tok_s"] / row["prompt_only"]["tok_s"]
        rows.append(row)
        print(f"{name:18s} prompt-only {row['prompt_only']['tokens_per_target_pass']:.2f} tok/pass "
              f"{row['prompt_only']['tok_s']:6.1f} tok/s | memory "
              f"{row['memory']['tokens_per_target_pass']:.2f} tok/pass "
              f"{row['memory']['tok_s']:6.1f} tok/s | x{row['speedup']:.2f} | same tokens "
              f"{row['same_tokens']}", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip() or None
    out = dict(bench="ngram_memory", commit=commit, machine=platform.machine(),
               threads=args.threads, new_tokens=args.new_tokens, verispec=verispec.__version__,
               date=time.strftime("%Y-%m-%d"), rows=rows,
               llama_cpp="not rerun: its tools are not installed on this machine")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return 0 if all(r["same_tokens"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
