"""verispec's CPU paged attention: a verify row's tokens sharing their key reads, or not.

One "pass" = the attention of every layer of one forward: 30 layers (SmolLM2-135M: 9
query heads, 3 KV heads of 64) or 32 (a Llama-3-8B-shaped cache: 32 and 8 of 128), each
layer its own K/V pools (a pass streams its cache from memory, as a model's does: one
layer's pools reused would sit in the last-level cache), one row of M new tokens at the
end of C cached ones, blocks of 16 in shuffled order. Two layouts of the same kernel,
which compute the same bits (tests/test_decode_ops.py):

- ``shared`` (the default): the tokens of a chain row are cut into runs that read each
  key once for all their tokens and the KV head's query heads (a decode token: its KV
  head's query heads together once there are as many items as threads);
- ``per_token`` (``share_keys=False``, the layout before): each token reads its keys for
  itself, a query head each when tokens x KV heads < 2 x threads.

For each (cache, C, M) the two alternate round by round; the table gives the median pass
time of each and shared's speedup. Writes JSON.

    .venv/bin/python bench/bench_attention.py --out bench/out/attention.json
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

import torch

from kernel_env import cpu_kernel_environment, write_result

from verispec import _C

CACHES = {  # name: (layers, query heads, KV heads, head size)
    "SmolLM2-135M": (30, 9, 3, 64),
    "Llama-3-8B": (32, 32, 8, 128),
    "SmolLM2-1.7B": (24, 32, 32, 64),
}
BLOCK = 16


class Pass:
    """Pools of every layer and one row of M new tokens after C - M cached keys."""

    def __init__(self, cache: str, ctx: int, m: int, seed: int = 0):
        layers, nh, nkv, hd = CACHES[cache]
        g = torch.Generator().manual_seed(seed)
        blocks = -(-ctx // BLOCK)
        self.nh, self.nkv, self.hd, self.m = nh, nkv, hd, m
        self.slots = blocks * BLOCK
        self.k = [torch.randn(self.slots, nkv, hd, generator=g) for _ in range(layers)]
        self.v = [torch.randn(self.slots, nkv, hd, generator=g) for _ in range(layers)]
        self.q = torch.randn(m, nh * hd, generator=g)
        self.out = torch.empty(m, nh * hd)
        self.qs = torch.tensor([0, m], dtype=torch.int64)
        self.pos = torch.arange(ctx - m, ctx, dtype=torch.int64)
        self.ctx = torch.tensor([ctx], dtype=torch.int32)
        self.tables = torch.randperm(blocks, generator=g).to(torch.int32).view(1, blocks)

    def run(self, threads: int, share_keys: bool) -> None:
        for k, v in zip(self.k, self.v):
            _C._paged_attention_unchecked(
                self.q.data_ptr(), k.data_ptr(), v.data_ptr(), self.slots, self.m, self.nh,
                self.nkv, self.hd, 1, self.qs.data_ptr(), self.pos.data_ptr(), self.ctx.data_ptr(),
                self.tables.data_ptr(), self.tables.stride(0), self.tables.shape[1], 0, BLOCK,
                1.0 / math.sqrt(self.hd), self.out.data_ptr(), 0, threads, share_keys=share_keys)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench/out/attention.json"))
    ap.add_argument("--caches", nargs="+", default=list(CACHES), choices=list(CACHES))
    ap.add_argument("--contexts", type=int, nargs="+", default=[150, 600, 2000, 8000])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 6, 16],
                    help="new tokens of the row (1: decode; k + 1: a verify pass)")
    ap.add_argument("--rounds", type=int, default=9, help="alternating rounds (median)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="a smoke run: small sizes, 3 rounds")
    args = ap.parse_args(argv)
    if args.quick:
        args.caches, args.contexts, args.tokens, args.rounds = ["SmolLM2-135M"], [150], [1, 6], 3
    bad = [f"--{n} must be >= 1, got {v}" for n, vs in
           (("contexts", args.contexts), ("tokens", args.tokens), ("rounds", [args.rounds]),
            ("threads", [args.threads])) for v in vs if v < 1]
    if bad:
        ap.error("; ".join(bad))
    if any(m > c for c in args.contexts for m in args.tokens):
        ap.error(f"--tokens must be <= every --contexts value, got {args.tokens} and {args.contexts}")

    rows = []
    for cache in args.caches:
        for ctx in args.contexts:
            for m in args.tokens:
                p = Pass(cache, ctx, m)
                times: dict[bool, list[float]] = {True: [], False: []}
                outs = {}
                for share in (True, False):  # warm up, and the bits of each
                    p.run(args.threads, share)
                    outs[share] = p.out.clone()
                for _ in range(args.rounds):
                    for share in (True, False):
                        t0 = time.perf_counter()
                        p.run(args.threads, share)
                        times[share].append(time.perf_counter() - t0)
                shared = statistics.median(times[True]) * 1e3
                per_token = statistics.median(times[False]) * 1e3
                rows.append({"cache": cache, "context": ctx, "tokens": m,
                             "shared_ms": shared, "per_token_ms": per_token,
                             "speedup": per_token / shared,
                             "same_bits": bool(torch.equal(outs[True], outs[False]))})
                print(f"{cache} C={ctx} M={m}: shared {shared:.2f} ms, per token "
                      f"{per_token:.2f} ms ({per_token / shared:.2f}x)", flush=True)
    lines = ["| cache | context | new tokens | shared (ms) | per token (ms) | speedup | same bits |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['cache']} | {r['context']} | {r['tokens']} | {r['shared_ms']:.2f} | "
                     f"{r['per_token_ms']:.2f} | {r['speedup']:.2f}x | {r['same_bits']} |")
    write_result(args.out, {
        "benchmark": "CPU paged attention per pass: shared key reads vs per token",
        "environment": cpu_kernel_environment(args.threads),
        "caches": {c: dict(zip(("layers", "query_heads", "kv_heads", "head_size"), CACHES[c]))
                   for c in args.caches},
        "block_size": BLOCK, "rounds": args.rounds, "quick": args.quick, "rows": rows},
        "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
