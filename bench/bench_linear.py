"""verispec's CPU linear kernel vs torch.mm (MKL) on SmolLM2-135M's projections.

One "pass" = every product of one SmolLM2 forward of M tokens: per layer Wqkv [960, 576],
Wo [576, 576], Wgate_up [3072, 576], Wdown [576, 1536] (30 layers), then the LM head
[49152, 576]: 538 MB of float32 weights, random values (speed does not depend on them).
Both layouts of a Linear weight [out, in]: row-major (torch's default) and column-major
(``W.t()`` contiguous: what LlamaModel stores on CPU, so its verify passes are the
"column-major" columns). For each M the four engines alternate round by round and the
table gives the median pass time of each, verispec's speedup per layout, and the cost of
M rows relative to 1 row (what a verify pass of M - 1 drafts costs over a plain decoding
step). Writes JSON.

Then the quantized kernels (``--quant``, default every format): the same pass with the
matrices in each GGUF block format (random blocks), verispec's quantized kernel at every
M in each arithmetic, each on the layout a model keeps for it (``quant_<fmt>_ms``: int8,
the default, on the packed layout; ``quant_<fmt>_rows_ms``: int8 on the file's layout;
``quant_<fmt>_float_ms``: dequantized float32 on the file's layout; alternating with the
rest), and its weight bytes per pass. K-quants need K to be a multiple
of 256, so for them K = 576 is rounded up to 768 (their pass reads 4/3 of the inputs).

    .venv/bin/python bench/bench_linear.py --out bench/out/linear.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from kernel_env import cpu_kernel_environment

import verispec
from verispec import _C, ops
from verispec.models.testing import random_quant_blocks

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30
VOCAB = 49152


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench/out/linear.json"))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8, 12, 16])
    ap.add_argument("--rounds", type=int, default=7, help="alternating rounds per M (median)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--quant", nargs="*", default=list(_C.quant_formats()),
                    help="quantized formats to time (default: all)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()

    g = torch.Generator().manual_seed(0)
    # distinct matrices per layer: a pass streams its 538 MB from memory, as a model's does
    # (one set reused 30 times would sit in the last-level cache)
    rows_major = [torch.randn(n, k, generator=g) for _ in range(LAYERS) for n, k in SHAPES]
    rows_major.append(torch.randn(VOCAB, 576, generator=g))
    cols_major = [w.t().contiguous().t() for w in rows_major]
    weight_bytes = sum(w.numel() * 4 for w in rows_major)

    def torch_pass(weights):
        def run(xs):
            for w in weights:
                torch.mm(xs[w.shape[1]], w.t())
        return run

    def verispec_pass(weights, kn):
        def run(xs):
            native = _C._linear_unchecked
            for w in weights:
                x = xs[w.shape[1]]
                m, k = x.shape
                n = w.shape[0]
                out = torch.empty((m, n))
                native(x.data_ptr(), w.data_ptr(), out.data_ptr(), m, n, k, k,
                       w.stride(1) if kn else w.stride(0), n, threads, kn)
        return run

    engines = {"torch_row": torch_pass(rows_major), "verispec_row": verispec_pass(rows_major, False),
               "torch_col": torch_pass(cols_major), "verispec_col": verispec_pass(cols_major, True)}
    formats = _C.quant_formats()
    quant_bytes = {}
    for fmt in args.quant:
        tid, block, size = formats[fmt]
        mats = []
        for i, w in enumerate(rows_major):
            n, k = w.shape
            k = -(-k // block) * block
            mats.append((random_quant_blocks(fmt, n, k, seed=i), k))
        quant_bytes[fmt] = sum(d.numel() for d, _ in mats)
        packed = [(ops.quant_pack(d, fmt), k, d.shape[0], True) for d, k in mats]

        def quant_pass(mats, tid=tid, int8=True):
            def run(xs):
                native = _C._quant_linear_unchecked
                for data, k, n, is_packed in mats:
                    x = xs[k]
                    m = x.shape[0]
                    out = torch.empty((m, n))
                    native(x.data_ptr(), data.data_ptr(), out.data_ptr(), m, n, k, k,
                           data.stride(0), n, tid, threads, int8, is_packed)
            return run
        rows_layout = [(d, k, d.shape[0], False) for d, k in mats]
        engines[f"quant_{fmt}"] = quant_pass(packed)
        engines[f"quant_{fmt}_rows"] = quant_pass(rows_layout)
        engines[f"quant_{fmt}_float"] = quant_pass(rows_layout, int8=False)
    rows = []
    print(f"verispec {verispec.__version__}, torch {torch.__version__}, {threads} threads, "
          f"isa {_C.linear_best_isa()}, threads on {_C.linear_threads()}; "
          f"{weight_bytes / 1e6:.0f} MB of weights per pass", file=sys.stderr)
    for m in args.rows:
        xs = {k: torch.randn(m, k, generator=g) for k in (576, 768, 1536)}
        times = {name: [] for name in engines}
        for fn in engines.values():
            fn(xs)  # warm
        for _ in range(args.rounds):
            for name, fn in engines.items():
                t0 = time.perf_counter()
                fn(xs)
                times[name].append(time.perf_counter() - t0)
        row = {"rows": m, "seconds": times}
        for name, t in times.items():
            row[f"{name}_ms"] = statistics.median(t) * 1e3
        row["speedup_row"] = row["torch_row_ms"] / row["verispec_row_ms"]
        row["speedup_col"] = row["torch_col_ms"] / row["verispec_col_ms"]
        rows.append(row)
        print(f"M={m} done", file=sys.stderr)

    lines = ["| rows M | row-major: torch.mm ms | verispec ms | speedup | column-major: torch.mm ms | "
             "verispec ms | speedup | M rows / 1 row, column-major (torch, verispec) |",
             "|---:|---:|---:|---:|---:|---:|---:|---|"]
    base = rows[0] if args.rows[0] == 1 else None
    for r in rows:
        rel = "n/a"
        if base:
            r["torch_col_vs_1_row"] = r["torch_col_ms"] / base["torch_col_ms"]
            r["verispec_col_vs_1_row"] = r["verispec_col_ms"] / base["torch_col_ms"]
            rel = f"{r['torch_col_vs_1_row']:.2f}x, {r['verispec_col_vs_1_row']:.2f}x"
        lines.append(f"| {r['rows']} | {r['torch_row_ms']:.1f} | {r['verispec_row_ms']:.1f} | "
                     f"**{r['speedup_row']:.2f}x** | {r['torch_col_ms']:.1f} | {r['verispec_col_ms']:.1f} | "
                     f"**{r['speedup_col']:.2f}x** | {rel} |")
    if args.quant:
        lines += ["", "| rows M | " + " | ".join(f"{f} int8 packed / int8 / float ms" for f in args.quant)
                  + " | float32 column-major verispec/torch.mm ms |",
                  "|---:|" + "---:|" * (len(args.quant) + 1),
                  "| MB per pass | " + " | ".join(f"{quant_bytes[f] / 1e6:.0f}" for f in args.quant)
                  + f" | {weight_bytes / 1e6:.0f} |"]
        for r in rows:
            best_f32 = r["verispec_col_ms"] if r["rows"] > 1 else r["torch_col_ms"]
            lines.append(f"| {r['rows']} | " + " | ".join(
                f"{r[f'quant_{f}_ms']:.1f} / {r[f'quant_{f}_rows_ms']:.1f} / "
                f"{r[f'quant_{f}_float_ms']:.1f}" for f in args.quant)
                + f" | {best_f32:.1f} |")
    table = "\n".join(lines)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "CPU linear: verispec kernel vs torch.mm, SmolLM2-135M projections",
        "environment": cpu_kernel_environment(threads),
        "weight_bytes_per_pass": weight_bytes, "quant_weight_bytes_per_pass": quant_bytes,
        "rounds": args.rounds, "rows": rows,
        "markdown": table}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
