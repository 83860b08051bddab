"""The program bench/gpu_check.sh profiles with Nsight Compute: verispec.ops.verify at
B=32, K=8, V=128256 (float32 logits, sampled drafts with their q), both policies.

    ncu --profile-from-start off --kernel-name regex:verify_ --set full -o verify \\
        python bench/ncu_verify.py --device cuda

One untimed call per policy warms up outside the profiled range; then --calls calls per
policy run between cudaProfilerStart and cudaProfilerStop (torch.cuda.profiler), so ncu
sees only those: each call launches verify_policy_kernel (one block per position,
B*(K+1); the filter-free variant at temperature 1) and verify_sample_kernel (one block a
row). Prints the wall time of each call. ``--device cpu`` runs the same calls on the CPU
kernels (a smoke test of this script).
"""

from __future__ import annotations

import argparse
import time

import torch

POLICIES = {
    "temperature_1": dict(temperature=1.0),
    "top_k50_top_p0.9": dict(temperature=1.0, top_k=50, top_p=0.9),
}


def inputs(b: int, k: int, v: int, device: torch.device, policy: dict):
    g = torch.Generator(device=device).manual_seed(0)
    target = 3.0 * torch.randn((b, k + 1, v), generator=g, device=device)
    draft_logits = target[:, :k] + 0.7 * torch.randn((b, k, v), generator=g, device=device)
    q = torch.softmax(draft_logits.reshape(b * k, v) / policy["temperature"], dim=-1)
    drafts = torch.multinomial(q, 1, generator=g).view(b, k).to(torch.int32)
    return target, drafts, q.view(b, k, v)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--calls", type=int, default=2, help="profiled calls per policy")
    args = ap.parse_args(argv)

    from verispec import ops

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    cases = {name: (policy, inputs(args.batch, args.k, args.vocab, device, policy))
             for name, policy in POLICIES.items()}
    for policy, (target, drafts, q) in cases.values():  # warm-up, not profiled
        ops.verify(target, drafts, q, seed=1, offset=0, **policy)
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.profiler.start()
    for name, (policy, (target, drafts, q)) in cases.items():
        for i in range(args.calls):
            t0 = time.perf_counter()
            _, _, accepted = ops.verify(target, drafts, q, seed=1, offset=1 + i, **policy)
            if cuda:
                torch.cuda.synchronize(device)
            ms = (time.perf_counter() - t0) * 1e3
            print(f"verify B={args.batch} K={args.k} V={args.vocab} {name} call {i}: {ms:.3f} ms "
                  f"(wall), mean accepted {accepted.float().mean().item():.2f}", flush=True)
    if cuda:
        torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
