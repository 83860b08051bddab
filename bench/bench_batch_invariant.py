"""The batch-invariant mode's cost: plain greedy decoding (one token a pass per sequence)
and n-gram speculation (verify passes of k + 1 tokens) at batch 1 and 16, default vs
``batch_invariant=True``, on a random Llama (TinyLlama-1.1B's shape by default); plus
how many tokens speculative greedy got different from plain greedy in each mode.

    python bench/bench_batch_invariant.py --device cuda --dtype bfloat16 --out bi.json
    python bench/bench_batch_invariant.py --quick          # a small model on the CPU

Modes: ``default``; ``batch_invariant`` (on the GPU the fixed-shape torch ops, on a
float32 CPU model verispec's kernels, which are batch-invariant already); on the CPU
also ``batch_invariant_torch`` (the torch implementation forced on, as on a GPU).
Prints a table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch

from verispec.decoder import SpecDecoder
from verispec.drafters import NGram
from verispec.models.testing import random_llama

SHAPES = {
    "1b": dict(vocab=32000, hidden=2048, intermediate=5632, layers=22, heads=32, kv_heads=4,
               head_dim=64),
    "quick": dict(vocab=4096, hidden=256, intermediate=704, layers=4, heads=8, kv_heads=2,
                  head_dim=32),
}


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """n prompts, each a random segment of length // 4 tokens said four times (n-gram
    lookups find continuations in them)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length // 4,), generator=g).tolist() * 4 for _ in range(n)]


def generate(model, draft, batch: list[list[int]], n: int, k) -> tuple[list[list[int]], float]:
    """(tokens per prompt, seconds) of greedy decoding, the decoder set up outside the
    timing; a short warm-up run first (allocations, kernels' first calls)."""
    kw = dict(num_blocks=max(64, len(batch) * (-(-(len(batch[0]) + n + 16) // 16) + 4)),
              block_size=16)
    if draft is not None:
        kw.update(k=k, max_k=8)
    SpecDecoder(model, draft, **kw).generate(batch, max_new_tokens=4, greedy=True)
    dec = SpecDecoder(model, draft, **kw)
    sync()
    t0 = time.perf_counter()
    out = [r.tokens for r in dec.generate(batch, max_new_tokens=n, greedy=True)]
    sync()
    return out, time.perf_counter() - t0


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="default: bfloat16 on a GPU, float32 on the CPU")
    p.add_argument("--shape", default=None, choices=tuple(SHAPES),
                   help="default: 1b (quick with --quick)")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--tokens", type=int, default=None, help="new tokens per sequence (default 128; quick 16)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--k", default="4", help="draft tokens per verify pass, or auto")
    p.add_argument("--quick", action="store_true", help="a small model, 16 tokens")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None, help="JSON path")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("float32" if device.type == "cpu" else "bfloat16"))
    shape = SHAPES[args.shape or ("quick" if args.quick else "1b")]
    n = args.tokens or (16 if args.quick else 128)
    k = args.k if args.k == "auto" else int(args.k)
    batches = [int(b) for b in args.batches.split(",")]

    t0 = time.perf_counter()
    model = random_llama(**shape, device=args.device, dtype=dtype,
                         max_context=args.prompt_len + n + 64)
    load_s = time.perf_counter() - t0
    modes = ["default", "batch_invariant"] + (["batch_invariant_torch"] if device.type == "cpu"
                                              else [])
    rows = []
    for batch_size in batches:
        batch = prompts(batch_size, args.prompt_len, shape["vocab"], seed=batch_size)
        for mode in modes:
            model.batch_invariant = mode != "default"
            model.batch_invariant_torch = mode == "batch_invariant_torch"
            plain, plain_s = generate(model, None, batch, n, k)
            spec, spec_s = generate(model, NGram(1, 4), batch, n, k)
            differing = sum(a != b for x, y in zip(plain, spec) for a, b in zip(x, y))
            rows.append(dict(batch=batch_size, mode=mode, plain_s=plain_s, spec_s=spec_s,
                             plain_tok_s=batch_size * n / plain_s,
                             spec_tok_s=batch_size * n / spec_s,
                             spec_vs_plain_differing_tokens=differing,
                             tokens=batch_size * n))
            print(f"  batch {batch_size:3d} {mode:22s} plain {rows[-1]['plain_tok_s']:9.1f} tok/s"
                  f"  spec {rows[-1]['spec_tok_s']:9.1f} tok/s  differing {differing}",
                  file=sys.stderr, flush=True)
    model.batch_invariant = model.batch_invariant_torch = False
    base = {(r["batch"]): r for r in rows if r["mode"] == "default"}
    for r in rows:
        b = base[r["batch"]]
        r["plain_slowdown"] = r["plain_s"] / b["plain_s"]
        r["spec_slowdown"] = r["spec_s"] / b["spec_s"]

    print(f"\nbatch-invariant mode, random Llama {shape} {dtype} on {device} "
          f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else platform.processor() or 'cpu'}), "
          f"{n} new tokens, prompts {args.prompt_len}, k {k}; model made in {load_s:.1f} s")
    print(f"{'batch':>5} {'mode':22s} {'plain tok/s':>12} {'x default':>9} {'spec tok/s':>11} "
          f"{'x default':>9} {'spec!=plain':>11}")
    for r in rows:
        print(f"{r['batch']:5d} {r['mode']:22s} {r['plain_tok_s']:12.1f} "
              f"{r['plain_slowdown']:9.2f} {r['spec_tok_s']:11.1f} {r['spec_slowdown']:9.2f} "
              f"{r['spec_vs_plain_differing_tokens']:11d}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=str(device), dtype=str(dtype), shape=shape, tokens=n,
                           prompt_len=args.prompt_len, k=k, torch=torch.__version__,
                           gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                           threads=torch.get_num_threads(), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
