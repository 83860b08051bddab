"""The quantized kernels per format on one model shape: a decoding step's products.

One "pass" = every projection of one decoding step (M = 1 row, by default) of a
SmolLM2-360M-shaped model (``--shape``: hidden 960, intermediate 2560, 15 heads / 5 KV
heads of 64, 32 layers; no LM head), each matrix in the format under test, distinct
random matrices per layer so the pass streams them from memory as a model's does. That
is the shape whose Q4_K_M file holds 176 Q5_0 matrices (960 is not a multiple of 256,
so llama.cpp's quantizer falls back to Q5_0 for the K = 960 projections), which verispec
used to dequantize to float32: the "F32" row is that path (verispec's float32 linear
kernel, the same matrices converted). Formats alternate within each round; per format the
median and the best pass time over ``--rounds``, its weight bytes, the read rate of the
best pass, and its time relative to Q4_0's (its bytes relative to Q4_0's beside it:
at the bandwidth bound the two ratios match). Each format runs in the layout and
arithmetic a model loads it in (int8 on the packed layout; F16 / BF16 the float
arithmetic on the file's layout). Prints a markdown table and writes JSON.

    .venv/bin/python bench/bench_quant_formats.py --threads 2 --out bench/out/quant_formats.json

The 256-weight formats (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS) need every K a multiple of
256, which the 360M shape's 960 is not: compare them on the 1.7B shape,

    .venv/bin/python bench/bench_quant_formats.py --shape 1.7B --threads 2 --rounds 21 \
        --formats Q4_0 Q2_K Q3_K Q4_K

Streaming (without ``--from-cache``) each round also reads every format's weight bytes
alone, matrix by matrix in the pass's order and split over the same threads
(``_C.read_stream`` on each matrix's buffer: the pass's memory traffic, its calls and its
thread wake-ups without the arithmetic), and one 1 GiB buffer (the machine's bandwidth,
as ``bench_llamacpp.py`` samples it). "of read" is the median over rounds of the pass's
read rate over that of its bytes alone read next to it, so a change of the machine's
bandwidth state between rounds cancels; "read / long read" is how close reading the weights
matrix by matrix comes to one long read (``--bandwidth-mib``, 1 GiB by default).

``--from-cache`` times the arithmetic instead of the memory: one layer's matrices, each cut
to 256 rows, in every layer (a few MB, from cache); ``--threads 1 --from-cache`` is a
core's speed per format, which at 2 threads must exceed the machine's read bandwidth for
the streaming pass to reach it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from kernel_env import cpu_kernel_environment, write_result

from verispec import _C
from verispec.models.layers.quantized import FLOAT16_FORMATS, QuantizedMatrix
from verispec.models.testing import random_quant_blocks

# name -> (hidden, intermediate, heads, kv heads, head dim, layers)
SHAPES = {"360M": (960, 2560, 15, 5, 64, 32), "1.7B": (2048, 8192, 32, 32, 64, 24),
          "135M": (576, 1536, 9, 3, 64, 30)}
DEFAULT_FORMATS = ["Q4_0", "Q5_0", "Q5_1", "IQ4_NL", "Q8_0", "F16", "F32"]


def layer_matrices(shape: str) -> list[tuple[int, int]]:
    """[(N, K)] of one layer's projections: q, k, v, o, gate, up, down."""
    h, inter, heads, kv, hd, _ = SHAPES[shape]
    return [(heads * hd, h), (kv * hd, h), (kv * hd, h), (h, heads * hd), (inter, h), (inter, h),
            (h, inter)]


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A contiguous uint8 tensor's bytes as one flat view (read_stream's buffer)."""
    if t.dtype != torch.uint8 or not t.is_contiguous():
        raise ValueError(f"weight bytes: expected a contiguous uint8 tensor, got {t.dtype} "
                         f"with strides {t.stride()}")
    return t.view(-1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=list(SHAPES), default="360M")
    ap.add_argument("--formats", nargs="+", default=DEFAULT_FORMATS,
                    help="formats of verispec._C.quant_formats(), or F32 (the float32 kernel)")
    ap.add_argument("--rows", type=int, default=1, help="rows of x (tokens in the pass)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--from-cache", action="store_true",
                    help="the arithmetic's own speed: every layer reuses one layer's matrices, "
                         "each cut to its first 256 rows (a few MB, read from cache), so the "
                         "pass measures the kernels' arithmetic instead of this machine's memory")
    ap.add_argument("--bandwidth-mib", type=int, default=1024,
                    help="the long read's buffer (MiB) that samples the machine's bandwidth "
                         "each streaming round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench/out/quant_formats.json"))
    args = ap.parse_args(argv)
    known = set(_C.quant_formats()) | {"F32"}
    bad = [f for f in args.formats if f not in known]
    if bad:
        ap.error(f"--formats: {bad} are not among {sorted(known)}")
    if args.bandwidth_mib < 1:
        ap.error(f"--bandwidth-mib must be >= 1, got {args.bandwidth_mib}")
    if "Q4_0" not in args.formats:
        ap.error("--formats must include Q4_0 (the reference of the ratios)")
    layers = SHAPES[args.shape][5]
    shapes = layer_matrices(args.shape) * layers
    if args.from_cache:
        shapes = [(min(n, 256), k) for n, k in shapes]
    seeds = [i % 7 if args.from_cache else i for i in range(len(shapes))]  # 7 matrices a layer
    for fmt in args.formats:
        block = _C.quant_formats()[fmt][1] if fmt != "F32" else 1
        ks = sorted({k for _, k in shapes if k % block})
        if ks:
            ap.error(f"--formats: {fmt}'s blocks of {block} weights do not divide the "
                     f"{args.shape} shape's K = {ks} (a file of this shape falls back to another type)")
    threads = args.threads

    passes, nbytes, buffers = {}, {}, {}
    for fmt in args.formats:
        if fmt == "F32":
            mats = [torch.randn(n, k, generator=torch.Generator().manual_seed(i)) * 0.02
                    for i, (n, k) in zip(seeds, shapes)]
            nbytes[fmt] = sum(w.numel() * 4 for w in mats)
            buffers[fmt] = [w.view(-1).view(torch.uint8) for w in mats]

            def run(x, mats=mats):
                for w in mats:
                    n, k = w.shape
                    out = torch.empty((x[k].shape[0], n))
                    _C._linear_unchecked(x[k].data_ptr(), w.data_ptr(), out.data_ptr(),
                                         x[k].shape[0], n, k, k, k, n, threads, False)
        else:
            int8 = fmt not in FLOAT16_FORMATS  # F16 / BF16: the float arithmetic, file layout
            made = {}  # --from-cache: one object per distinct matrix, so the layers share it
            for i, (n, k) in zip(seeds, shapes):
                if (i, n, k) not in made:
                    made[i, n, k] = QuantizedMatrix.from_bytes(
                        random_quant_blocks(fmt, n, k, seed=i), fmt, k).for_arithmetic(
                        "int8" if int8 else "float")
            mats = [made[i, n, k] for i, (n, k) in zip(seeds, shapes)]
            nbytes[fmt] = sum(m.nbytes for m in mats)
            buffers[fmt] = [byte_view(m.parts[0].data) for m in mats]
            tid = _C.quant_formats()[fmt][0]

            def run(x, mats=mats, tid=tid, int8=int8):
                for m in mats:
                    p = m.parts[0]
                    xk = x[m.k]
                    out = torch.empty((xk.shape[0], p.rows))
                    _C._quant_linear_unchecked(xk.data_ptr(), p.data.data_ptr(), out.data_ptr(),
                                               xk.shape[0], p.rows, m.k, m.k, p.data.stride(0),
                                               p.rows, tid, threads, int8, p.packed)
        passes[fmt] = run
    g = torch.Generator().manual_seed(0)
    x = {k: torch.randn(args.rows, k, generator=g) for k in {k for _, k in shapes}}
    streaming = not args.from_cache
    big = torch.ones(args.bandwidth_mib << 20, dtype=torch.uint8) if streaming else None
    times = {f: [] for f in passes}
    reads = {f: [] for f in passes}  # the same bytes read alone, next to each pass
    big_gb_s = []

    def read_alone(bufs):
        t0 = time.perf_counter()
        for b in bufs:
            _C.read_stream(b, threads)
        return time.perf_counter() - t0

    for fn in passes.values():
        fn(x)  # warm
    for _ in range(args.rounds):
        if streaming:
            t0 = time.perf_counter()
            _C.read_stream(big, threads)
            big_gb_s.append(big.numel() / (time.perf_counter() - t0) / 1e9)
        for f, fn in passes.items():
            t0 = time.perf_counter()
            fn(x)
            times[f].append(time.perf_counter() - t0)
            if streaming:
                reads[f].append(read_alone(buffers[f]))
    rows = []
    for f in passes:
        best, med = min(times[f]), statistics.median(times[f])
        r = {"format": f, "bytes": nbytes[f], "best_ms": best * 1e3, "median_ms": med * 1e3,
             "best_gb_s": nbytes[f] / best / 1e9, "seconds": times[f]}
        if streaming:
            r["read_alone_seconds"] = reads[f]
            r["read_alone_median_gb_s"] = nbytes[f] / statistics.median(reads[f]) / 1e9
            r["of_read_alone"] = statistics.median(rd / t for rd, t in zip(reads[f], times[f]))
        rows.append(r)
    ref = next(r for r in rows if r["format"] == "Q4_0")
    for r in rows:
        r["time_vs_q4_0"] = r["best_ms"] / ref["best_ms"]
        r["bytes_vs_q4_0"] = r["bytes"] / ref["bytes"]
    h, inter, heads, kv, hd, _ = SHAPES[args.shape]
    title = (f"{args.shape}-shaped decoding pass (hidden {h}, intermediate {inter}, {heads}/{kv} "
             f"heads, {layers} layers, no head), M = {args.rows}, {threads} threads, "
             f"{args.rounds} rounds, int8 path {_C.quant_int8_path('auto')}"
             + (", from cache (one layer's matrices, 256 rows each, in every layer)"
                if args.from_cache else ""))
    head = "| format | MB | best ms | median ms | GB/s (best) | time / Q4_0 | bytes / Q4_0 |"
    rule = "|---|---:|---:|---:|---:|---:|---:|"
    if streaming:
        big_med = statistics.median(big_gb_s)
        title += f"; {args.bandwidth_mib} MiB read: median {big_med:.1f} GB/s ({min(big_gb_s):.1f}-{max(big_gb_s):.1f})"
        head += " read alone GB/s | of read | read / long read |"
        rule += "---:|---:|---:|"
    lines = [title, "", head, rule]
    for r in rows:
        line = (f"| {r['format']} | {r['bytes'] / 1e6:.0f} | {r['best_ms']:.2f} | "
                f"{r['median_ms']:.2f} | {r['best_gb_s']:.1f} | {r['time_vs_q4_0']:.2f} | "
                f"{r['bytes_vs_q4_0']:.2f} |")
        if streaming:
            line += (f" {r['read_alone_median_gb_s']:.1f} | {r['of_read_alone']:.2f} | "
                     f"{r['read_alone_median_gb_s'] / big_med:.2f} |")
        lines.append(line)
    write_result(args.out, {
        "benchmark": "quantized kernels per format, one decoding pass of a model shape",
        "shape": args.shape, "rows": args.rows, "rounds": args.rounds,
        "from_cache": args.from_cache,
        "bandwidth_mib": args.bandwidth_mib, "long_read_gb_s": big_gb_s,
        "environment": cpu_kernel_environment(threads), "results": rows}, "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
