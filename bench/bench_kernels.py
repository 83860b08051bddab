"""Sampling-kernel benchmark: native verispec.ops against the PyTorch reference.

1. verify (fused policy + accept/reject + residual/bonus sample), float32 logits,
   sampled drafts (draft_probs = the policy applied to draft logits that track the
   target's), at
   (B, K, V) = (1, 4, 49152), (8, 4, 49152), (32, 8, 128256), for temperature 1.0 and
   for the policy temperature 1.0 + top_k 50 + top_p 0.9.
2. apply_policy at (N, V) = (8, 49152), top_k 50 + top_p 0.9: native, the reference,
   and a plain torch sort-based top-k/top-p (the usual Hugging Face-style warper).
3. verify_tree: binary trees of N nodes (two children per node, in breadth-first order)
   with children sampled i.i.d. from q, at B in {1, 32} and N in {16, 64}, temperature 1,
   V = --tree-vocab (default 128256; a smaller value keeps a CPU run short). The
   reference walks every row in Python and applies the policy to all B * (N + 1) rows; it
   is timed only up to 2**27 logits (reference_ms null above), where its sort of the
   vocabulary would need several GB.

Napkin math: verify reads each logit once and each q row at most once, so the
nominal traffic is B*(K+1)*V*4 + B*K*V*4 bytes. It is reported as GB/s against the
copy bandwidth measured in the same run (Tensor.copy_ of a large float32 buffer:
bytes moved = 2 x its size) and, on CUDA, against the H200's ~4.8 TB/s peak. The
native CPU kernels are single-threaded, so torch runs with --threads 1 by default:
the reference and the copy get one core as well. The native CPU walk reads every
logit (it checks each position for NaN/Inf) but a q row only where it rejects, so
the nominal figure overstates its traffic a little.

Timings are medians; CUDA times use torch.cuda.Event. ops.verify on CUDA reads its
error record back after each call (a stream synchronisation); the "graph" column is
the same op replayed in a CUDA graph, without that check.

Prints a table and writes JSON (--out). --quick runs tiny sizes (a smoke test).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import verispec
from verispec import ops, reference

H200_PEAK_GBPS = 4800.0  # HBM3e, NVIDIA's datasheet figure

POLICIES = {
    "temperature_1": dict(temperature=1.0),
    "top_k50_top_p0.9": dict(temperature=1.0, top_k=50, top_p=0.9),
}

# (B, K, V), then the timed calls (native, reference), each after one untimed warm-up
# call; the reference's largest case takes ~15 s a call on one core, so it is timed once.
FULL_CPU = [((1, 4, 49152), 21, 5), ((8, 4, 49152), 7, 3), ((32, 8, 128256), 3, 1)]
FULL_CUDA = [((1, 4, 49152), 50, 20), ((8, 4, 49152), 50, 20), ((32, 8, 128256), 30, 10)]
QUICK = [((1, 2, 1000), 3, 2), ((4, 3, 5000), 3, 2), ((2, 4, 3000), 3, 1)]
# verify_tree: (B, N), then the timed calls (native, reference).
TREE_FULL = [((1, 16), 11, 3), ((1, 64), 11, 3), ((32, 16), 5, 1), ((32, 64), 3, 1)]
TREE_QUICK = [((1, 4), 3, 2), ((2, 6), 3, 1)]
TREE_REFERENCE_MAX_LOGITS = 1 << 27


# --- timing -------------------------------------------------------------------------------


class Timer:
    """Median seconds per call of fn(i), i = call index, on the CPU clock or CUDA events."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn, repeats: int, warmup: int = 1) -> float:
        for i in range(warmup):
            fn(i)
        self.sync()
        samples = []
        for i in range(warmup, warmup + repeats):
            if self.cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn(i)
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn(i)
                samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()


def copy_bandwidth_gbps(timer: Timer, device: torch.device, nbytes: int, repeats: int) -> float:
    """GB/s of dst.copy_(src) on float32 buffers of `nbytes` (read + write = 2 x nbytes)."""
    src = torch.rand(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    seconds = timer(lambda i: dst.copy_(src), repeats, warmup=2)
    return 2 * nbytes / seconds / 1e9


# --- inputs ------------------------------------------------------------------------------


def verify_inputs(b: int, k: int, v: int, device: torch.device, policy: dict, seed: int = 0):
    """Target logits [B, K+1, V], drafts [B, K] sampled from q, q [B, K, V] float32.

    The draft's logits are the target's plus noise, so acceptance is partial, as with
    a real draft model (about 70% per position; the mean is reported), and q is the
    draft's distribution under the same policy, as an engine would sample it.
    """
    gen = torch.Generator().manual_seed(seed)
    target = 3.0 * torch.randn(b, k + 1, v, generator=gen)
    draft_logits = target[:, :k] + 0.7 * torch.randn(b, k, v, generator=gen)
    q = ops.apply_policy(draft_logits.view(b * k, v), **policy)
    del draft_logits
    drafts = torch.multinomial(q, 1, generator=gen).view(b, k)
    return target.to(device), drafts.to(device), q.view(b, k, v).to(device)


def tree_inputs(b: int, n: int, v: int, device: torch.device, seed: int = 0):
    """A binary tree per row (parents: -1, -1, 0, 0, 1, 1, ...), children drawn i.i.d. from
    q = softmax(target + noise) at their parent: target [B, N+1, V], tokens and parents
    [B, N], q [B, N+1, V]."""
    gen = torch.Generator().manual_seed(seed)
    target = 3.0 * torch.randn(b, n + 1, v, generator=gen)
    q = torch.softmax(target + 0.7 * torch.randn(b, n + 1, v, generator=gen), dim=-1)
    parents = torch.tensor([-1 if i < 2 else (i - 2) // 2 for i in range(n)])
    tokens = torch.multinomial(q[:, parents + 1].reshape(b * n, v), 1, generator=gen).view(b, n)
    parents = parents.expand(b, n).contiguous()
    return target.to(device), tokens.to(device), parents.to(device), q.to(device)


# --- a plain torch top-k / top-p (what most inference code does) --------------------------


def torch_sort_top_k_top_p(logits, temperature=1.0, top_k=0, top_p=1.0):
    """Hugging Face-style warpers: top-k by torch.topk, top-p by a full sort + cumsum.

    Not tie-exact like verispec's policy (it keeps exactly k and drops tokens tied
    with the top-p threshold); the benchmark reports its difference from native.
    """
    x = logits.float() / temperature
    if 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=False)
        cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= 1 - top_p
        drop[..., -1] = False  # keep at least the most likely token
        x = x.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return x.softmax(dim=-1)


# --- the benchmarks --------------------------------------------------------------------


def bench_verify(timer: Timer, device: torch.device, cases, copy_gbps: float, peak_gbps):
    rows = []
    for (b, k, v), native_repeats, reference_repeats in cases:
        nominal_bytes = b * (k + 1) * v * 4 + b * k * v * 4
        for name, policy in POLICIES.items():
            target, drafts, q = verify_inputs(b, k, v, device, policy)

            def native(i, policy=policy):
                return ops.verify(target, drafts, q, seed=1, offset=i, **policy)

            def ref(i, policy=policy):
                return reference.verify(target, drafts, q, seed=1, offset=i, **policy)

            native_s = timer(native, native_repeats)
            graph_s = None
            if device.type == "cuda":
                graph_s = graph_seconds(timer, native, native_repeats)
            ref_s = timer(ref, reference_repeats)
            calls = range(10_000, 10_000 + max(1, 64 // b))  # fresh offsets, >= 64 rows
            accepted = statistics.fmean(native(i)[2].float().mean().item() for i in calls)
            gbps = nominal_bytes / native_s / 1e9
            row = dict(
                B=b, K=k, V=v, policy=name, policy_args=policy,
                nominal_bytes=nominal_bytes,
                native_ms=native_s * 1e3, reference_ms=ref_s * 1e3,
                ratio_reference_over_native=ref_s / native_s,
                native_gbps=gbps, native_fraction_of_copy=gbps / copy_gbps,
                repeats=dict(native=native_repeats, reference=reference_repeats),
                mean_accepted=accepted,
            )
            if graph_s is not None:
                row["native_graph_ms"] = graph_s * 1e3 if graph_s > 0 else None
                row["native_graph_gbps"] = nominal_bytes / graph_s / 1e9 if graph_s > 0 else None
            if peak_gbps:
                row["native_fraction_of_peak"] = gbps / peak_gbps
            rows.append(row)
            del target, drafts, q
    return rows


def bench_verify_tree(timer: Timer, device: torch.device, cases, vocab: int):
    rows = []
    for (b, n), native_repeats, reference_repeats in cases:
        target, tokens, parents, q = tree_inputs(b, n, vocab, device)

        def native(i):
            return ops.verify_tree(target, tokens, parents, q, seed=1, offset=i)

        def ref(i):
            return reference.verify_tree(target, tokens, parents, q, seed=1, offset=i)

        native_s = timer(native, native_repeats)
        ref_s = None
        if b * (n + 1) * vocab <= TREE_REFERENCE_MAX_LOGITS:
            ref_s = timer(ref, reference_repeats)
        calls = range(10_000, 10_000 + max(1, 64 // b))
        depth = statistics.fmean((native(i)[1].float() - 1).mean().item() for i in calls)
        rows.append(dict(
            B=b, N=n, V=vocab, native_ms=native_s * 1e3,
            reference_ms=None if ref_s is None else ref_s * 1e3,
            ratio_reference_over_native=None if ref_s is None else ref_s / native_s,
            repeats=dict(native=native_repeats, reference=reference_repeats),
            mean_accepted_depth=depth,
        ))
        del target, tokens, parents, q
    return rows


def graph_seconds(timer: Timer, fn, repeats: int) -> float:
    """Median seconds of fn replayed as a CUDA graph (no error read-back); -1 if capture fails."""
    try:
        fn(0)  # warm-up outside the graph
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(0)
        return timer(lambda i: graph.replay(), repeats, warmup=3)
    except Exception as e:  # noqa: BLE001 - reported, the rest of the run goes on
        print(f"warning: CUDA graph capture of verify failed: {type(e).__name__}: {e}",
              file=sys.stderr)
        return -1.0


def bench_apply_policy(timer: Timer, device: torch.device, n: int, v: int, repeats):
    gen = torch.Generator().manual_seed(1)
    logits = (3.0 * torch.randn(n, v, generator=gen)).to(device)
    policy = dict(temperature=1.0, top_k=50, top_p=0.9)
    impls = {
        "native": lambda i: ops.apply_policy(logits, **policy),
        "reference": lambda i: reference.apply_policy(logits, **policy),
        "torch_sort": lambda i: torch_sort_top_k_top_p(logits, **policy),
    }
    ms = {name: timer(fn, repeats[name]) * 1e3 for name, fn in impls.items()}
    native = impls["native"](0)
    diff = {name: (impls[name](0) - native).abs().max().item()
            for name in ("reference", "torch_sort")}
    return dict(
        N=n, V=v, policy_args=policy, ms=ms, repeats=repeats,
        ratio_over_native={name: ms[name] / ms["native"] for name in ("reference", "torch_sort")},
        max_abs_diff_vs_native=diff,
    )


# --- report ------------------------------------------------------------------------------


def print_report(result) -> None:
    cuda = result["device"] == "cuda"
    print(f"verispec {result['version']}  device={result['device_name']}  torch {result['torch']}  "
          f"threads={result['torch_threads']}  python {platform.python_version()}")
    copy = "  ".join(f"{k}={v:.1f}" for k, v in result["copy_bandwidth_gbps"].items())
    peak = result["peak_bandwidth_gbps"]
    print(f"copy bandwidth (GB/s, read + write): {copy}" + (f"  peak={peak:.0f}" if peak else ""))
    print("\nverify, float32 logits, sampled drafts (median ms per call)")
    head = (f"{'B':>3} {'K':>2} {'V':>6} | {'policy':<16} | {'native':>9} | {'reference':>10} | "
            f"{'ref/nat':>7} | {'GB/s':>7} | {'of copy':>7}")
    if cuda:
        head += f" | {'of peak':>7} | {'graph ms':>8}"
    head += f" | {'accepted':>8}"
    print(head)
    print("-" * len(head))
    for r in result["verify"]:
        line = (f"{r['B']:>3} {r['K']:>2} {r['V']:>6} | {r['policy']:<16} | "
                f"{r['native_ms']:>9.3f} | {r['reference_ms']:>10.3f} | "
                f"{r['ratio_reference_over_native']:>6.1f}x | {r['native_gbps']:>7.2f} | "
                f"{100 * r['native_fraction_of_copy']:>6.1f}%")
        if cuda:
            graph = r.get("native_graph_ms")
            line += (f" | {100 * r['native_fraction_of_peak']:>6.2f}% | "
                     + (f"{graph:>8.3f}" if graph else f"{'n/a':>8}"))
        line += f" | {r['mean_accepted']:>5.2f}/{r['K']}"
        print(line)
    a = result["apply_policy"]
    print(f"\napply_policy N={a['N']} V={a['V']} top_k=50 top_p=0.9 (median ms per call)")
    print(f"{'impl':>10} | {'ms':>9} | {'x native':>8} | {'max|diff|':>9}")
    for name, ms in a["ms"].items():
        ratio = a["ratio_over_native"].get(name, 1.0)
        diff = a["max_abs_diff_vs_native"].get(name, 0.0)
        print(f"{name:>10} | {ms:>9.3f} | {ratio:>7.1f}x | {diff:>9.2g}")
    print("\nverify_tree, float32 logits, binary trees sampled i.i.d. (median ms per call)")
    print(f"{'B':>3} {'N':>3} {'V':>6} | {'native':>9} | {'reference':>10} | {'ref/nat':>7} | "
          f"{'depth':>5}")
    for r in result["verify_tree"]:
        ref = f"{r['reference_ms']:>10.3f}" if r["reference_ms"] is not None else f"{'n/a':>10}"
        ratio = (f"{r['ratio_reference_over_native']:>6.1f}x"
                 if r["ratio_reference_over_native"] is not None else f"{'n/a':>7}")
        print(f"{r['B']:>3} {r['N']:>3} {r['V']:>6} | {r['native_ms']:>9.3f} | {ref} | {ratio} | "
              f"{r['mean_accepted_depth']:>5.2f}")
    verdict = "yes" if result["native_faster_everywhere"] else "NO"
    print(f"\nnative faster than the reference at every size: {verdict} "
          f"(smallest ratio {result['min_ratio_reference_over_native']:.2f}x)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench/out/kernels.json"))
    ap.add_argument("--quick", action="store_true", help="tiny sizes, few repeats (smoke run)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1, as the native CPU kernels use one)")
    ap.add_argument("--tree-vocab", type=int, default=128256,
                    help="V of the verify_tree rows (default 128256; smaller for a short CPU run)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_kernels: --device cuda needs a GPU (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    if device.type == "cuda" and not verispec.build_info()["cuda_compiled"]:
        print("bench_kernels: --device cuda needs a CUDA build of verispec "
              f"(build_info: {verispec.build_info()})", file=sys.stderr)
        return 2
    timer = Timer(device)

    started = time.perf_counter()
    if device.type == "cuda":
        nbytes = (16 if args.quick else 1024) << 20
        copy = {"cuda": copy_bandwidth_gbps(timer, device, nbytes, 20)}
        peak = H200_PEAK_GBPS
        device_name = torch.cuda.get_device_name(device)
    else:
        nbytes, repeats = (16 << 20, 3) if args.quick else (256 << 20, 5)
        copy = {"cpu": copy_bandwidth_gbps(timer, device, nbytes, repeats)}
        peak = None
        device_name = platform.processor() or platform.machine()
    copy_ref = copy[device.type]

    cases = QUICK if args.quick else (FULL_CUDA if device.type == "cuda" else FULL_CPU)
    verify_rows = bench_verify(timer, device, cases, copy_ref, peak)
    policy_repeats = (dict(native=3, reference=3, torch_sort=3) if args.quick
                      else dict(native=50, reference=10, torch_sort=20))
    n, v = (4, 2000) if args.quick else (8, 49152)
    policy = bench_apply_policy(timer, device, n, v, policy_repeats)

    tree_rows = bench_verify_tree(timer, device, TREE_QUICK if args.quick else TREE_FULL,
                                  1000 if args.quick else args.tree_vocab)

    ratios = [r["ratio_reference_over_native"] for r in verify_rows]
    ratios.append(policy["ratio_over_native"]["reference"])
    ratios += [r["ratio_reference_over_native"] for r in tree_rows
               if r["ratio_reference_over_native"] is not None]
    result = {
        "benchmark": "bench_kernels",
        "version": verispec.__version__,
        "build_info": verispec.build_info(),
        "device": device.type,
        "device_name": device_name,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "quick": args.quick,
        "copy_bandwidth_gbps": copy,
        "peak_bandwidth_gbps": peak,
        "verify": verify_rows,
        "apply_policy": policy,
        "verify_tree": tree_rows,
        "native_faster_everywhere": min(ratios) > 1.0,
        "min_ratio_reference_over_native": min(ratios),
        "seconds": time.perf_counter() - started,
        "argv": sys.argv[1:],
    }
    print_report(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out} ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
