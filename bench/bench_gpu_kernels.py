"""GPU sampling kernels: verispec's verify, apply_policy and sample vs FlashInfer and torch.

    python bench/bench_gpu_kernels.py --device cuda --out bench/out/gpu/kernels_gpu.json
    python bench/bench_gpu_kernels.py --device cpu --quick    # tiny shapes (a smoke run)

Shapes: B in {1, 32, 256}, V in {32000, 128256, 151936} (Llama-2, Llama-3, Qwen-2
vocabularies), K in {4, 8} for verify; float32 logits; policies temperature 1 and
temperature 1 + top-k 50 + top-p 0.9. apply_policy and sample run on N = B rows (a
decode step's draft sampling); K does not apply to them.

    op            verispec                     FlashInfer (flashinfer-python)          torch
    verify        ops.verify(logits, d, q)     chain_speculative_sampling(q, d, p):    verispec.reference.verify
                  (policy fused in)            "chain" given p = the policy's probs;   (sort-based policy,
                                               "pipeline" = FlashInfer's softmax       vectorised accept/reject)
                                               (+ top_k/top_p_renorm_probs) + chain
    apply_policy  ops.apply_policy(logits)     softmax (+ top_k_renorm + top_p_renorm) softmax / sort-based top-k/top-p
    sample        ops.sample(probs)            sampling_from_probs(probs)              torch.multinomial
    policy_sample ops.sample(ops.apply_policy) softmax + top_k_top_p_sampling_from_    the sort path + multinomial
                  (logits -> token)            probs (sampling_from_probs at temp. 1)

Each is timed eager (CUDA events around one call, median; verispec's eager CUDA ops read
their error record back, a stream synchronisation) and replayed from a CUDA graph (the
same call captured once; verispec skips the read-back under capture). GB/s = the bytes
the op must move (verify: the target logits and q read once, B(K+1)V + BKV floats;
apply_policy: logits read + probabilities written; sample: probabilities read;
policy_sample: logits read) / time, and as a fraction of the device copy bandwidth
measured in the same run (a 1 GiB device-to-device copy_, bytes read + written).

FlashInfer is optional. Its sampling module is JIT-compiled on first use (about a
minute); ``--flashinfer-prebuild STATUS.json`` does only that, without importing
verispec, and writes whether it worked, so bench/gpu_check.sh can start it in the
background while verispec builds; ``--flashinfer-status STATUS.json`` makes the
benchmark wait for that file instead of building itself. When FlashInfer cannot be
imported, built or run, the JSON says exactly why (``flashinfer.reason``) and the torch
columns are the comparison. verispec and torch are measured first (phase A) and
FlashInfer after (phase B), so a FlashInfer failure cannot cost verispec's numbers; the
JSON is rewritten after every case (``"complete": false`` until the end).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
import zlib
from pathlib import Path

import torch

POLICIES = {
    "temperature_1": dict(temperature=1.0),
    "top_k50_top_p0.9": dict(temperature=1.0, top_k=50, top_p=0.9),
}
FULL = dict(B=(1, 32, 256), K=(4, 8), V=(32000, 128256, 151936))
QUICK = dict(B=(1, 3), K=(2,), V=(500, 2000))
FI_FUNCTIONS = ("chain_speculative_sampling", "top_k_top_p_sampling_from_probs",
                "sampling_from_probs", "top_k_renorm_probs", "top_p_renorm_probs", "softmax")


def error_text(e: BaseException) -> str:
    """The exception, and the one it was raised while handling (a failed capture raises
    again on leaving torch.cuda.graph: the first error is the cause)."""
    text = f"{type(e).__name__}: {e}".strip()
    first = e.__cause__ or e.__context__
    if first is not None:
        text += f" (while handling {type(first).__name__}: {first})"
    return text[:2000]


# --- FlashInfer ------------------------------------------------------------------------


def flashinfer_warm_up(fi, device: torch.device) -> list[str]:
    """One tiny call of each function used (JIT-builds the sampling module); their names."""
    s = fi.sampling
    probs = torch.softmax(torch.randn(2, 3, 64, device=device), dim=-1)
    drafts = torch.randint(0, 64, (2, 2), dtype=torch.int32, device=device)
    s.chain_speculative_sampling(probs[:, :2].contiguous(), drafts, probs)
    flat = probs.view(6, 64)
    s.top_k_top_p_sampling_from_probs(flat, 5, 0.9)
    s.sampling_from_probs(flat)
    s.top_p_renorm_probs(s.top_k_renorm_probs(flat, 5), 0.9)
    used = list(FI_FUNCTIONS[:-1])
    if hasattr(s, "softmax"):
        s.softmax(flat)
        used.append("softmax")
    if hasattr(s, "top_k_top_p_sampling_from_logits"):
        logits = torch.randn(6, 64, device=device)
        s.top_k_top_p_sampling_from_logits(logits, 5, 0.9)
        s.sampling_from_logits(logits)
        used += ["top_k_top_p_sampling_from_logits", "sampling_from_logits"]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return used


def flashinfer_prebuild(status: Path) -> int:
    """Imports FlashInfer and JIT-builds its sampling module; writes STATUS.json. No verispec."""
    started = time.perf_counter()
    info = {"ok": False, "pid": os.getpid()}
    try:
        native_api = hasattr(torch.Tensor, "__dlpack_c_exchange_api__")
        import flashinfer

        info.update(version=getattr(flashinfer, "__version__", None),
                    file=getattr(flashinfer, "__file__", None),
                    torch_dlpack_c_exchange_api_before_import=native_api,
                    # tvm-ffi JIT-builds a torch add-on at import when torch lacks the API
                    torch_dlpack_c_exchange_api_after_import=hasattr(
                        torch.Tensor, "__dlpack_c_exchange_api__"))
        info["functions"] = flashinfer_warm_up(flashinfer, torch.device("cuda"))
        info["ok"] = True
    except BaseException as e:  # noqa: BLE001 - the reason is the product
        info.update(error=error_text(e), traceback=traceback.format_exc()[-3000:])
    info["seconds"] = time.perf_counter() - started
    tmp = status.with_suffix(".tmp")
    tmp.write_text(json.dumps(info, indent=2) + "\n")
    tmp.replace(status)
    print(json.dumps(info, indent=2))
    return 0 if info["ok"] else 1


def load_flashinfer(device: torch.device, status: Path | None, timeout: float,
                    allow_cpu: bool = False):
    """(flashinfer module or None, info dict with the reason when None)."""
    info = {"available": False, "reason": None}
    started = time.perf_counter()
    if status is not None:  # a --flashinfer-prebuild run's verdict comes first
        while not status.exists() and time.perf_counter() - started < timeout:
            time.sleep(0.5)
        if not status.exists():
            info["reason"] = (f"the FlashInfer prebuild had not written {status} after "
                              f"{timeout:g} s (its JIT build is still running or died)")
            return None, info
        prebuilt = json.loads(status.read_text())
        info["prebuild"] = {k: prebuilt.get(k) for k in ("ok", "version", "seconds", "error")}
        info["waited_s"] = time.perf_counter() - started
        if not prebuilt.get("ok"):
            info["reason"] = f"the FlashInfer prebuild failed: {prebuilt.get('error')}"
            return None, info
        if prebuilt.get("torch_dlpack_c_exchange_api_after_import") is False:
            # tvm-ffi's torch add-on did not build there: do not spend the time again
            os.environ.setdefault("TVM_FFI_DISABLE_TORCH_C_DLPACK", "1")
            info["tvm_ffi_torch_addon"] = "failed in the prebuild: disabled"
    if importlib.util.find_spec("flashinfer") is None:
        info["reason"] = ("flashinfer is not installed: no module named 'flashinfer' "
                          "(pip install flashinfer-python; bench/gpu_check.sh installs it from "
                          "WHEELHOUSE, see `make gpu-wheelhouse`)")
        return None, info
    if device.type != "cuda" and not allow_cpu:
        info["reason"] = "FlashInfer's kernels need CUDA; this run is --device cpu"
        return None, info
    info["torch_dlpack_c_exchange_api_before_import"] = hasattr(
        torch.Tensor, "__dlpack_c_exchange_api__")
    try:
        import flashinfer

        info["version"] = getattr(flashinfer, "__version__", None)
        info["functions"] = flashinfer_warm_up(flashinfer, device)
    except BaseException as e:  # noqa: BLE001
        info["reason"] = f"FlashInfer failed to import, build or run: {error_text(e)}"
        info["traceback"] = traceback.format_exc()[-3000:]
        return None, info
    info["torch_dlpack_c_exchange_api_after_import"] = hasattr(
        torch.Tensor, "__dlpack_c_exchange_api__")
    info["available"] = True
    info["load_s"] = time.perf_counter() - started
    return flashinfer, info


# --- timing ------------------------------------------------------------------------------


class Clock:
    """Median seconds of fn(i) eager, and of its CUDA graph replayed (CUDA only)."""

    def __init__(self, device: torch.device, repeats: int):
        self.device, self.repeats = device, repeats
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _time(self, call, repeats) -> float:
        samples = []
        for i in range(repeats):
            if self.cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                call(i)
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                call(i)
                samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    def eager(self, fn, repeats=None, warmup=2) -> float:
        for i in range(warmup):
            fn(i)
        self.sync()
        return self._time(lambda i: fn(warmup + i), repeats or self.repeats)

    def graph(self, fn, repeats=None) -> float:
        """Raises when the capture or the replay fails (the caller records why)."""
        if not self.cuda:
            raise RuntimeError("CUDA graphs need CUDA")
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up off the default stream, as torch advises
            fn(0)
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.sync()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(0)
        graph.replay()
        self.sync()
        try:
            return self._time(lambda i: graph.replay(), repeats or self.repeats)
        finally:
            del graph


def copy_bandwidth(clock: Clock, nbytes: int) -> dict:
    src = torch.rand(nbytes // 4, device=clock.device)
    dst = torch.empty_like(src)
    seconds = clock.eager(lambda i: dst.copy_(src), warmup=3)
    return {"bytes": nbytes, "seconds": seconds, "gbps": 2 * nbytes / seconds / 1e9}


# --- inputs (deterministic per case, so phase B sees phase A's inputs) --------------------


def generator(device, seed):
    return torch.Generator(device=device).manual_seed(seed)


def make_logits(shape, device, seed):
    return 3.0 * torch.randn(shape, generator=generator(device, seed), device=device)


def verify_inputs(b, k, v, policy, device, seed, sort_policy):
    """Target logits [B, K+1, V]; drafts [B, K] drawn from q; q [B, K, V] (the draft's
    logits = the target's + noise, under the same policy: partial acceptance)."""
    g = generator(device, seed + 1)
    target = make_logits((b, k + 1, v), device, seed)
    draft_logits = target[:, :k] + 0.7 * torch.randn((b, k, v), generator=g, device=device)
    q = sort_policy(draft_logits.reshape(b * k, v), **policy)
    del draft_logits
    drafts = torch.multinomial(q, 1, generator=g).view(b, k).to(torch.int32)
    return target, drafts, q.view(b, k, v)


# --- the measurements ---------------------------------------------------------------------


class Bench:
    def __init__(self, args, device, clock, copy_gbps, result, write):
        self.args, self.device, self.clock = args, device, clock
        self.copy_gbps, self.result, self.write = copy_gbps, result, write
        self.started = time.perf_counter()
        from bench_kernels import torch_sort_top_k_top_p

        self.sort_policy = torch_sort_top_k_top_p

    def over_budget(self) -> bool:
        budget = self.args.budget_s
        return budget is not None and time.perf_counter() - self.started > budget

    def measure(self, fn, nbytes, *, graph=True, graph_reason=None, repeats=None) -> dict:
        """Eager and graph timings of fn(i) with bandwidth figures; errors recorded."""
        out = {}
        try:
            s = self.clock.eager(fn, repeats)
            out.update(eager_us=s * 1e6, eager_gbps=nbytes / s / 1e9,
                       eager_of_copy=nbytes / s / 1e9 / self.copy_gbps)
        except Exception as e:  # noqa: BLE001
            out["error"] = error_text(e)
            return out
        if not self.clock.cuda:
            out["graph_error"] = "CUDA graphs need CUDA"
        elif not graph:
            out["graph_error"] = f"not attempted: {graph_reason}"
        else:
            try:
                s = self.clock.graph(fn, repeats)
                out.update(graph_us=s * 1e6, graph_gbps=nbytes / s / 1e9,
                           graph_of_copy=nbytes / s / 1e9 / self.copy_gbps)
            except Exception as e:  # noqa: BLE001
                out["graph_error"] = error_text(e)
                self.clock.sync()
        return out

    # Each op: cases(), then for a case, inputs(case) and impls(case, inputs, phase).

    def cases(self, op):
        shapes = QUICK if self.args.quick else FULL
        if op == "verify":
            return [dict(B=b, K=k, V=v, policy=p) for v in shapes["V"] for b in shapes["B"]
                    for k in shapes["K"] for p in POLICIES]
        if op == "sample":
            return [dict(B=b, V=v, policy="temperature_1") for v in shapes["V"] for b in shapes["B"]]
        return [dict(B=b, V=v, policy=p) for v in shapes["V"] for b in shapes["B"] for p in POLICIES]

    def run_op(self, op, phase, fi=None):
        rows = self.result[op]
        for index, case in enumerate(self.cases(op)):
            if phase == "A":
                row = dict(case, op=op, impls={})
                rows.append(row)
            else:
                row = rows[index]
                if "error" in row:
                    continue
            if self.over_budget():
                row.setdefault("skipped", []).append(f"phase {phase}: over --budget-s")
                continue
            try:
                self.run_case(op, row, phase, fi)
            except Exception as e:  # noqa: BLE001 - e.g. out of memory: the next case runs
                row["error" if phase == "A" else "flashinfer_error"] = error_text(e)
            if self.clock.cuda:
                torch.cuda.empty_cache()
            self.write()
            if phase == "A":
                print_row(op, row, flush=True)

    def run_case(self, op, row, phase, fi):
        from verispec import ops, reference

        dev, policy = self.device, POLICIES[row["policy"]]
        b, v = row["B"], row["V"]
        seed = zlib.crc32(repr((op, b, row.get("K"), v, row["policy"])).encode())
        reps = self.args.repeats
        slow = max(2, reps // 5)  # the torch reference's verify is slow
        impls = row["impls"]
        if op == "verify":
            k = row["K"]
            target, drafts, q = verify_inputs(b, k, v, policy, dev, seed, self.sort_policy)
            nbytes = target.numel() * target.element_size() + q.numel() * 4
            row["bytes"] = nbytes
            if phase == "A":
                impls["verispec"] = self.measure(
                    lambda i: ops.verify(target, drafts, q, seed=1, offset=i, **policy), nbytes)
                if b <= 32:  # at B = 256 the reference alone took most of the phase's budget
                    impls["torch_reference"] = self.measure(
                        lambda i: reference.verify(target, drafts, q, seed=1, offset=i, **policy),
                        nbytes, graph=False, repeats=slow,
                        graph_reason="reference.verify makes a torch.Generator per call")
                calls = range(10_000, 10_000 + max(1, 64 // b))
                row["mean_accepted"] = {"verispec": statistics.fmean(
                    ops.verify(target, drafts, q, seed=1, offset=i, **policy)[2].float().mean().item()
                    for i in calls)}
            else:
                s, gen = fi.sampling, generator(dev, 7)
                p = ops.apply_policy(target.view(-1, v), **policy).view(b, k + 1, v)
                impls["flashinfer_chain"] = self.measure(
                    lambda i: s.chain_speculative_sampling(q, drafts, p, generator=gen), nbytes)
                impls["flashinfer_pipeline"] = self.measure(
                    lambda i: s.chain_speculative_sampling(
                        q, drafts, fi_policy(fi, target.view(-1, v), policy).view(b, k + 1, v),
                        generator=gen),
                    nbytes)
                accepted = [s.chain_speculative_sampling(q, drafts, p, generator=gen)[2]
                            .float().mean().item() for _ in range(max(1, 64 // b))]
                row.setdefault("mean_accepted", {})["flashinfer"] = statistics.fmean(accepted)
            return

        logits = make_logits((b, v), dev, seed)
        if op == "apply_policy":
            nbytes = logits.numel() * logits.element_size() + logits.numel() * 4
            row["bytes"] = nbytes
            if phase == "A":
                impls["verispec"] = self.measure(lambda i: ops.apply_policy(logits, **policy), nbytes)
                impls["torch"] = self.measure(lambda i: torch_policy(self, logits, policy), nbytes)
                row["max_abs_diff_torch_vs_verispec"] = (
                    torch_policy(self, logits, policy) - ops.apply_policy(logits, **policy)
                ).abs().max().item()
            else:
                impls["flashinfer"] = self.measure(lambda i: fi_policy(fi, logits, policy), nbytes)
                row["max_abs_diff_flashinfer_vs_verispec"] = (
                    fi_policy(fi, logits, policy) - ops.apply_policy(logits, **policy)
                ).abs().max().item()
        elif op == "sample":
            probs = torch.softmax(logits, dim=-1)
            nbytes = probs.numel() * 4
            row["bytes"] = nbytes
            if phase == "A":
                impls["verispec"] = self.measure(lambda i: ops.sample(probs, seed=1, offset=i), nbytes)
                impls["torch"] = self.measure(lambda i: torch.multinomial(probs, 1), nbytes)
            else:
                gen = generator(dev, 7)
                impls["flashinfer"] = self.measure(
                    lambda i: fi.sampling.sampling_from_probs(probs, generator=gen), nbytes)
        else:  # policy_sample: logits -> one token a row
            nbytes = logits.numel() * logits.element_size()
            row["bytes"] = nbytes
            if phase == "A":
                impls["verispec"] = self.measure(
                    lambda i: ops.sample(ops.apply_policy(logits, **policy), seed=1, offset=i), nbytes)
                impls["torch"] = self.measure(
                    lambda i: torch.multinomial(torch_policy(self, logits, policy), 1), nbytes)
            else:
                gen = generator(dev, 7)
                impls["flashinfer"] = self.measure(lambda i: fi_sample(fi, logits, policy, gen),
                                                   nbytes)
                if hasattr(fi.sampling, "top_k_top_p_sampling_from_logits"):
                    # FlashInfer's logits path ("top-k first" at top-k/top-p): its fastest route
                    impls["flashinfer_logits"] = self.measure(
                        lambda i: fi_sample_logits(fi, logits, policy, gen), nbytes)


def torch_policy(bench: Bench, logits, policy):
    if "top_k" in policy or "top_p" in policy:
        return bench.sort_policy(logits, **policy)
    return torch.softmax(logits.float() / policy["temperature"], dim=-1)


def fi_softmax(fi, logits, temperature=1.0):
    s = fi.sampling
    if hasattr(s, "softmax"):
        return s.softmax(logits, temperature)
    return torch.softmax(logits.float() / temperature, dim=-1)


def fi_policy(fi, logits, policy):
    """The policy's probabilities the FlashInfer way: softmax, then renormalised top-k, top-p."""
    probs = fi_softmax(fi, logits, policy["temperature"])
    if "top_k" in policy:
        probs = fi.sampling.top_k_renorm_probs(probs, policy["top_k"])
    if "top_p" in policy:
        probs = fi.sampling.top_p_renorm_probs(probs, policy["top_p"])
    return probs


def fi_sample_logits(fi, logits, policy, gen):
    """FlashInfer from logits directly (no probabilities written first)."""
    scaled = logits if policy["temperature"] == 1.0 else logits / policy["temperature"]
    if "top_k" in policy:
        return fi.sampling.top_k_top_p_sampling_from_logits(scaled, policy["top_k"],
                                                            policy["top_p"], generator=gen)
    return fi.sampling.sampling_from_logits(scaled, generator=gen)


def fi_sample(fi, logits, policy, gen):
    probs = fi_softmax(fi, logits, policy["temperature"])
    if "top_k" in policy:
        return fi.sampling.top_k_top_p_sampling_from_probs(probs, policy["top_k"], policy["top_p"],
                                                           generator=gen)
    return fi.sampling.sampling_from_probs(probs, generator=gen)


# --- report ---------------------------------------------------------------------------------


def add_ratios(row: dict) -> None:
    """row["time_over_verispec"][impl] = {"eager", "graph"}: the other's time / verispec's
    (> 1: verispec is faster), where both were measured."""
    ours = row.get("impls", {}).get("verispec", {})
    ratios = {}
    for name, impl in row.get("impls", {}).items():
        if name == "verispec":
            continue
        r = {mode: impl[f"{mode}_us"] / ours[f"{mode}_us"] for mode in ("eager", "graph")
             if f"{mode}_us" in impl and f"{mode}_us" in ours}
        if r:
            ratios[name] = r
    row["time_over_verispec"] = ratios
    # verispec's time over FlashInfer's best route to the same result (< 1: verispec is
    # faster): verify against its whole pipeline from logits, policy_sample against the
    # faster of sampling from probabilities and from logits.
    names = {"verify": ["flashinfer_pipeline"],
             "policy_sample": ["flashinfer", "flashinfer_logits"]}.get(row.get("op"), ["flashinfer"])
    over = {}
    for mode in ("eager", "graph"):
        theirs = [row["impls"][n][f"{mode}_us"] for n in names
                  if f"{mode}_us" in row.get("impls", {}).get(n, {})]
        if theirs and f"{mode}_us" in ours:
            over[mode] = ours[f"{mode}_us"] / min(theirs)
    if over:
        row["verispec_over_flashinfer"] = over


def fmt(x, spec=".1f"):
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def cell(impl: dict | None) -> str:
    if not impl:
        return f"{'':>20}"
    if "error" in impl:
        return f"{'error':>20}"
    return (f"{fmt(impl.get('eager_us')):>8} {fmt(impl.get('graph_us')):>7} "
            f"{fmt(100 * impl['graph_of_copy'] if 'graph_of_copy' in impl else None, '.0f'):>3}%")


def print_row(op, row, flush=False):
    shape = f"{row['B']:>3} {row.get('K', '-'):>2} {row['V']:>6} {row['policy']:<16}"
    names = [n for n in row["impls"]]
    print(f"{op:<13} {shape} | " + " | ".join(f"{n}: {cell(row['impls'][n])}" for n in names)
          + (f" | ERROR {row['error']}" if "error" in row else ""), flush=flush)


def print_report(result):
    print(f"\ncopy bandwidth: {result['copy']['gbps']:.0f} GB/s (read + write); "
          f"FlashInfer: {'yes ' + str(result['flashinfer'].get('version')) if result['flashinfer']['available'] else 'no: ' + str(result['flashinfer']['reason'])}")
    print("each cell: eager us, graph us, graph GB/s as % of copy bandwidth")
    for op in ("verify", "policy_sample", "apply_policy", "sample"):
        for row in result.get(op, []):
            print_row(op, row)
    cells = [(op, row) for op in ("verify", "policy_sample", "apply_policy", "sample")
             for row in result.get(op, []) if "verispec_over_flashinfer" in row]
    if cells:
        print("\nverispec's time / FlashInfer's (verify: its pipeline from logits; policy_sample: "
              "its faster route); <= 1: at or ahead of FlashInfer")
        for op, row in cells:
            r = row["verispec_over_flashinfer"]
            shape = f"{row['B']:>3} {row.get('K', '-'):>2} {row['V']:>6} {row['policy']:<16}"
            print(f"{op:<13} {shape} | eager {fmt(r.get('eager'), '.2f'):>6} | "
                  f"graph {fmt(r.get('graph'), '.2f'):>6}")
        graph = [row["verispec_over_flashinfer"].get("graph") for _, row in cells]
        ahead = sum(1 for g in graph if g is not None and g <= 1.0)
        print(f"at or ahead of FlashInfer in a CUDA graph: {ahead} of {len(cells)} cells")


def environment(device):
    import verispec

    env = {"verispec": verispec.__version__, "build_info": verispec.build_info(),
           "torch": torch.__version__, "python": platform.python_version(),
           "torch_threads": torch.get_num_threads(),
           "torch_dlpack_c_exchange_api": hasattr(torch.Tensor, "__dlpack_c_exchange_api__")}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(device_name=props.name, sm_count=props.multi_processor_count,
                   cuda=torch.version.cuda, capability=f"{props.major}.{props.minor}")
    else:
        env.update(device_name=platform.processor() or platform.machine())
    return env


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, few repeats (a smoke run)")
    ap.add_argument("--out", type=Path, default=Path("bench/out/gpu/kernels_gpu.json"))
    ap.add_argument("--repeats", type=int, default=None, help="timed calls per measurement "
                    "(default 20; --quick 3); the torch reference's verify gets a fifth")
    ap.add_argument("--ops", default="verify,policy_sample,apply_policy,sample")
    ap.add_argument("--flashinfer", choices=["auto", "off"], default="auto")
    ap.add_argument("--flashinfer-status", type=Path, default=None,
                    help="wait for this file of a --flashinfer-prebuild run instead of building")
    ap.add_argument("--flashinfer-timeout", type=float, default=240.0,
                    help="seconds to wait for --flashinfer-status (default 240)")
    ap.add_argument("--flashinfer-prebuild", type=Path, default=None, metavar="STATUS",
                    help="only import FlashInfer and JIT-build its sampling module; write STATUS")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no new case after this many seconds (the JSON marks the rest)")
    ap.add_argument("--flashinfer-allow-cpu", action="store_true",
                    help="run the FlashInfer phase on CPU tensors too: only for a stand-in "
                         "flashinfer module (the tests'); FlashInfer's kernels need CUDA")
    args = ap.parse_args(argv)
    if args.flashinfer_prebuild is not None:
        return flashinfer_prebuild(args.flashinfer_prebuild)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_gpu_kernels: --device cuda needs a GPU", file=sys.stderr)
        return 2
    import verispec

    if device.type == "cuda" and not verispec.build_info()["cuda_compiled"]:
        print(f"bench_gpu_kernels: --device cuda needs a CUDA build of verispec "
              f"({verispec.build_info()})", file=sys.stderr)
        return 2
    ops_wanted = [o.strip() for o in args.ops.split(",") if o.strip()]
    for o in ops_wanted:
        if o not in ("verify", "policy_sample", "apply_policy", "sample"):
            ap.error(f"unknown op {o!r}")
    args.repeats = args.repeats or (3 if args.quick else 20)
    if device.type == "cpu":
        torch.set_num_threads(1)  # as verispec's CPU kernels

    started = time.perf_counter()
    clock = Clock(device, args.repeats)
    copy = copy_bandwidth(clock, (16 << 20) if args.quick or device.type == "cpu" else (1 << 30))
    result = {"benchmark": "bench_gpu_kernels", "device": device.type, "quick": args.quick,
              "environment": environment(device), "copy": copy,
              "policies": POLICIES, "shapes": QUICK if args.quick else FULL,
              "repeats": args.repeats, "flashinfer": {"available": False, "reason": "not loaded yet"},
              "complete": False, "argv": sys.argv[1:]}
    for op in ops_wanted:
        result[op] = []

    def write():
        result["seconds"] = time.perf_counter() - started
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        tmp.replace(args.out)

    write()
    bench = Bench(args, device, clock, copy["gbps"], result, write)
    print(f"copy bandwidth {copy['gbps']:.0f} GB/s; phase A: verispec and torch", flush=True)
    for op in ops_wanted:
        bench.run_op(op, "A")

    if args.flashinfer == "off":
        fi, info = None, {"available": False, "reason": "--flashinfer off"}
    else:
        fi, info = load_flashinfer(device, args.flashinfer_status, args.flashinfer_timeout,
                                   args.flashinfer_allow_cpu)
    result["flashinfer"] = info
    result["comparison"] = "flashinfer and torch" if fi is not None else "torch"
    write()
    if fi is not None:
        print(f"phase B: FlashInfer {info.get('version')}", flush=True)
        for op in ops_wanted:
            bench.run_op(op, "B", fi)
    else:
        print(f"FlashInfer not compared: {info['reason']}", flush=True)
    for op in ops_wanted:
        for row in result[op]:
            add_ratios(row)
    result["complete"] = True
    write()
    print_report(result)
    print(f"\nwrote {args.out} ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
