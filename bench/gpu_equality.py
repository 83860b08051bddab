"""CPU against CUDA: the same inputs, seed and offset must give the same tokens.

    python bench/gpu_equality.py --out bench/out/gpu/equality_gpu.json   # needs a GPU
    python bench/gpu_equality.py --quick                                 # small shapes

Runs the native ops on both devices over the kernel benchmark's shapes (B 1/32/256, V
32000/128256/151936, K 4/8; bench_gpu_kernels.py) and counts what differs, per case:

    apply_policy   probabilities that are not bit for bit equal, of B x V
    sample         tokens of sample(apply_policy(logits)), of B
    verify         tokens and counts of verify (token and block methods, sampled and
                   one-hot drafts), of B x (K + 2)
    verify_tree    tokens, counts and nodes of verify_tree (deterministic candidates and
                   sampled children), of B x (2N + 2)

for float32, bfloat16 and float16 logits and the policies temperature 1 and
temperature 0.8 + top-k 50 + top-p 0.9 + min-p 0.02 (greedy for verify too). Every
count must be 0 (csrc/include/verispec/sampling_math.h: exact fixed-point sums and the
same float expressions on both devices). Prints a table and writes JSON, rewritten after
every case; exits 1 if anything differs. Verify runs at B <= 32 and the tree at B = 32
(the CPU side is the slow one), under --budget-s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import zlib
from pathlib import Path

import torch

POLICIES = {
    "temperature_1": dict(temperature=1.0),
    "all_knobs": dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FULL = dict(B=(1, 32, 256), V=(32000, 128256, 151936), K=(4, 8), verify_B=(1, 32), tree_B=32)
QUICK = dict(B=(1, 5), V=(1000, 5003), K=(2, 4), verify_B=(1, 5), tree_B=5)
TREE_PARENTS = (-1, -1, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6)  # a binary tree of 16 nodes


def differing(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements of a (on any device) and b that differ; float tensors bit for bit."""
    a = a.cpu()
    if a.dtype.is_floating_point:
        return int((a.view(torch.int32) != b.view(torch.int32)).sum())
    return int((a != b).sum())


def cases(shapes):
    for v in shapes["V"]:
        for dname in DTYPES:
            for pname in POLICIES:
                for b in shapes["B"]:
                    yield dict(op="apply_policy+sample", B=b, V=v, dtype=dname, policy=pname)
                for b in shapes["verify_B"]:
                    for k in shapes["K"]:
                        yield dict(op="verify", B=b, K=k, V=v, dtype=dname, policy=pname)
            yield dict(op="verify_tree", B=shapes["tree_B"], N=len(TREE_PARENTS), V=v,
                       dtype=dname, policy="all_knobs")
        for b in shapes["verify_B"]:
            yield dict(op="verify", B=b, K=shapes["K"][-1], V=v, dtype="float32", policy="greedy")


def run_case(case, dev):
    from verispec import ops

    gen = torch.Generator().manual_seed(zlib.crc32(repr(sorted(case.items())).encode()))
    b, v, dtype = case["B"], case["V"], DTYPES[case["dtype"]]
    policy = dict(greedy=True) if case["policy"] == "greedy" else POLICIES[case["policy"]]
    out = {}
    if case["op"] == "apply_policy+sample":
        logits = (3.0 * torch.randn(b, v, generator=gen)).to(dtype)
        probs = ops.apply_policy(logits, **policy)
        probs_dev = ops.apply_policy(logits.to(dev), **policy)
        out["apply_policy"] = (differing(probs_dev, probs), b * v)
        tokens = ops.sample(probs, seed=7, offset=b)
        out["sample"] = (differing(ops.sample(probs_dev, seed=7, offset=b), tokens), b)
        return out
    if case["op"] == "verify":
        k = case["K"]
        target = (3.0 * torch.randn(b, k + 1, v, generator=gen))
        draft_logits = target[:, :k] + 0.9 * torch.randn(b, k, v, generator=gen)
        q = torch.softmax(draft_logits, dim=-1)
        sampled = torch.multinomial(q.view(-1, v), 1, generator=gen).view(b, k)
        onehot = draft_logits.argmax(dim=-1)
        num_draft = torch.randint(0, k + 1, (b,), generator=gen)
        target = target.to(dtype)
        for draft, (d, qq) in {"sampled": (sampled, q), "onehot": (onehot, None)}.items():
            for method in ("token", "block"):
                args = dict(seed=11, offset=v + b, method=method, **policy)
                want = ops.verify(target, d, qq, num_draft=num_draft, **args)
                got = ops.verify(target.to(dev), d.to(dev), None if qq is None else qq.to(dev),
                                 num_draft=num_draft.to(dev), **args)
                out[f"{draft}_{method}"] = (sum(differing(x, y) for x, y in zip(got, want)),
                                            b * (k + 3))
        return out
    # verify_tree
    n = case["N"]
    parents = torch.tensor(TREE_PARENTS, dtype=torch.int32).expand(b, n).contiguous()
    target = 3.0 * torch.randn(b, n + 1, v, generator=gen)
    q = torch.softmax(target + 0.9 * torch.randn(b, n + 1, v, generator=gen), dim=-1)
    tokens = torch.empty(b, n, dtype=torch.int64)
    for node in range(0, n, 2):  # siblings 2 at a time from q at their parent, distinct
        parent = TREE_PARENTS[node]
        tokens[:, node:node + 2] = torch.multinomial(q[:, parent + 1], 2, generator=gen)
    num_nodes = torch.randint(0, n + 1, (b,), generator=gen)
    target = target.to(dtype)
    for mode, qq in {"candidates": None, "sampled": q}.items():
        args = dict(seed=3, offset=v, replacement=False, **policy)
        want = ops.verify_tree(target, tokens, parents, qq, num_nodes=num_nodes, **args)
        got = ops.verify_tree(target.to(dev), tokens.to(dev), parents.to(dev),
                              None if qq is None else qq.to(dev), num_nodes=num_nodes.to(dev),
                              **args)
        out[mode] = (sum(differing(x, y) for x, y in zip(got, want)), b * (2 * n + 2))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="small shapes (any device, even cpu)")
    ap.add_argument("--out", type=Path, default=Path("bench/out/gpu/equality_gpu.json"))
    ap.add_argument("--budget-s", type=float, default=120.0,
                    help="start no new case after this many seconds (default 120)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_equality: no CUDA device", file=sys.stderr)
        return 2
    torch.set_num_threads(max(1, torch.get_num_threads()))
    shapes = QUICK if args.quick else FULL
    result = {"device": args.device, "shapes": {k: list(v) if isinstance(v, tuple) else v
                                                for k, v in shapes.items()},
              "cases": [], "complete": False}
    if args.device == "cuda":
        result["device_name"] = torch.cuda.get_device_name()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    total_diff = 0
    print(f"{'op':<20} {'B':>3} {'K/N':>3} {'V':>6} {'dtype':<8} {'policy':<13} differing")
    for case in cases(shapes):
        if time.perf_counter() - start > args.budget_s:
            case["skipped"] = "over --budget-s"
            result["cases"].append(case)
            continue
        t0 = time.perf_counter()
        counts = run_case(case, torch.device(args.device))
        case["differing"] = {name: dict(differ=d, of=n) for name, (d, n) in counts.items()}
        case["seconds"] = round(time.perf_counter() - t0, 3)
        total_diff += sum(d for d, _ in counts.values())
        result["cases"].append(case)
        kn = case.get("K", case.get("N", "-"))
        print(f"{case['op']:<20} {case['B']:>3} {kn:>3} {case['V']:>6} {case['dtype']:<8} "
              f"{case['policy']:<13} " + ", ".join(f"{k} {d}/{n}" for k, (d, n) in counts.items()),
              flush=True)
        result["total_differing"] = total_diff
        args.out.write_text(json.dumps(result, indent=1))
    result["complete"] = not any("skipped" in c for c in result["cases"])
    result["total_differing"] = total_diff
    args.out.write_text(json.dumps(result, indent=1))
    ran = sum("differing" in c for c in result["cases"])
    print(f"\n{ran} cases run, {len(result['cases']) - ran} skipped; differing: {total_diff}; "
          f"wrote {args.out}")
    return 1 if total_diff else 0


if __name__ == "__main__":
    sys.exit(main())
