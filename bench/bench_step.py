"""What a decode step costs outside the models, and how often it crosses into native code.

For each draft source (n-gram lookup, a draft model = an early-exit draft of the target)
and batch size B, a few warm steps of `SpecDecoder.step()` are timed; the model forwards
are timed by wrapping them, so "outside" is everything else: the plan, the ops (policy,
sampling, verify), the commit and the Python glue. Counted per step, by wrapping the
objects the step calls: calls into the native core (`_C.SpecDecoder` methods), calls of
the ops, and on CUDA the host-device synchronisations torch reports
(`torch.cuda.set_sync_debug_mode`, "syncs", with their call sites), and on any device
the step's staging counters (verispec.models.staging: "reads" = blocking device -> host
reads per step, the design's one being the result download; "staged" = asynchronous
uploads per step) and a TransferAudit of two more steps ("unstg" = uploads that bypassed
the staging: each a synchronous copy on CUDA). The counts of the previous design (the native loop
calling up into a Python runner, at commit 5974844) are derived from its code and printed
beside them: 2K + 3 calls down and 2K + 2 calls up per step with a draft model, plus
about 18K + 26 property reads; with n-gram drafting 3 down and 2 up.

A second table runs many add/release cycles on a tiny model and times `has_running()` and
a step at the start and at the end: the ratios must stay near 1 (work proportional to the
running sequences, not to every sequence ever added).

    .venv/bin/python bench/bench_step.py --out bench/out/step.json
    .venv/bin/python bench/bench_step.py --device cuda --out bench/out/gpu/step.json

The same script measures an older build for a before/after comparison: install that
commit with `pip install --no-deps --target DIR .` from its checkout and run this script
with `PYTHONPATH=DIR` (the call counts then include its runner's calls as they happen).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from verispec import _C  # noqa: E402
from verispec.decoder import SpecDecoder  # noqa: E402
from verispec.drafters import EarlyExit, NGram  # noqa: E402
from verispec.models.staging import TransferAudit  # noqa: E402

OLD_CALLS = {  # the previous design's crossings per step (from its code), by draft source
    "ngram": lambda k: {"down": 3, "up": 2, "property_reads": 26},
    "draft_model": lambda k: {"down": 2 * k + 3, "up": 2 * k + 2, "property_reads": 18 * k + 26},
}


class Counting:
    """A proxy that counts the calls made through it."""

    def __init__(self, inner, counts: dict, prefix: str) -> None:
        self._inner, self._counts, self._prefix = inner, counts, prefix

    def __getattr__(self, name):
        value = getattr(self._inner, name)
        if not callable(value):
            return value
        counts, key = self._counts, f"{self._prefix}.{name}"

        def call(*args, **kwargs):
            counts[key] = counts.get(key, 0) + 1
            return value(*args, **kwargs)
        return call


class TimedModel:
    """Wraps a model's forward to add up its wall time (synchronised on CUDA)."""

    def __init__(self, model, clock: list) -> None:
        self.model, self.clock = model, clock
        self.tokens = 0  # new tokens run, summed over forwards
        self.geometry = model.geometry
        for name in ("num_layers", "early_exit"):
            if hasattr(model, name):
                setattr(self, name, getattr(model, name))

    def forward(self, batch):
        cuda = self.geometry.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = self.model.forward(batch)
        self.tokens += batch.input_ids.numel()
        if cuda:
            torch.cuda.synchronize()
        self.clock[0] += time.perf_counter() - t0
        return out


def build_model(device: str, dtype: torch.dtype, quick: bool):
    import tempfile

    import transformers

    from verispec.models.loaders import load_model
    from verispec.models.testing import randomize_weights
    if not quick:
        try:
            from verispec.models import load
            model, _ = load("smollm2", device=device, dtype=dtype)
            return model, "SmolLM2-135M"
        except Exception as e:  # noqa: BLE001 - not installed: a random model of its shape
            print(f"SmolLM2 unavailable ({type(e).__name__}); a random model instead", file=sys.stderr)
    layers = 4 if quick else 30
    cfg = transformers.LlamaConfig(
        hidden_size=64 if quick else 576, intermediate_size=128 if quick else 1536,
        num_hidden_layers=layers, num_attention_heads=4 if quick else 9,
        num_key_value_heads=2 if quick else 3, vocab_size=512 if quick else 49152,
        max_position_embeddings=2048, tie_word_embeddings=True)
    folder = tempfile.mkdtemp(prefix="bench_step_")
    randomize_weights(transformers.LlamaForCausalLM(cfg), 0).save_pretrained(folder)
    return load_model(folder, device=device, dtype=dtype), f"random Llama ({layers} layers)"


def measure(model, source: str, B: int, k: int, steps: int, device: str) -> dict:
    clock = [0.0]
    timed = TimedModel(model, clock)
    if source == "ngram":
        draft = NGram(1, 3)
    else:
        draft = EarlyExit(timed, num_layers=max(1, model.geometry.num_layers // 4))
        draft.model = TimedModel(draft.model, clock)
    dec = SpecDecoder(timed, draft, k=k, num_blocks=64 * B + 64, block_size=16)
    counts: dict = {}
    dec._core = Counting(dec._core, counts, "core")
    dec._ops = Counting(dec._ops, counts, "ops")
    V = model.geometry.vocab_size
    g = torch.Generator().manual_seed(B)
    base = torch.randint(0, V, (24,), generator=g).tolist()
    seqs = [dec.add((base * 3)[b:b + 48], max_new_tokens=(steps + 2) * (k + 1) + 8, temperature=1.0)
            for b in range(B)]  # repetitive prompts: n-gram lookup finds proposals
    for _ in range(2):  # warm up (prefill, first passes)
        dec.step()
    tokens_before = timed.tokens + (draft.model.tokens if source != "ngram" else 0)
    emitted_before = sum(len(dec.result(s).tokens) for s in seqs)
    counts.clear()
    clock[0] = 0.0
    syncs = 0
    sync_sites: dict = {}
    cuda = device == "cuda"
    total = 0.0
    n = 0
    staged_before = dec.staging.stats()
    # CUDA graphs (LlamaModel.cuda_graphs): a step that captures one waits for its check
    caches = [c for c in (getattr(model, "graphs", None),
                          getattr(getattr(getattr(draft, "model", None), "model", None),
                                  "graphs", None)) if c is not None]

    def graph_events() -> int:
        return sum(c.stats()["captures"] + c.stats()["refused"] for c in caches)

    capture_steps, plain_syncs = 0, 0
    for _ in range(steps):
        if not dec.has_running():
            break
        events = graph_events()
        syncs_before = syncs
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t0 = time.perf_counter()
            dec.step()
            if cuda:
                torch.cuda.set_sync_debug_mode(0)
                torch.cuda.synchronize()
            total += time.perf_counter() - t0
        for w in caught:
            if "synchroniz" in str(w.message):
                syncs += 1
                site = f"{Path(w.filename).name}:{w.lineno}"
                sync_sites[site] = sync_sites.get(site, 0) + 1
        if graph_events() != events:
            capture_steps += 1
        else:
            plain_syncs += syncs - syncs_before
        n += 1
    staged = {k: v - staged_before[k] for k, v in dec.staging.stats().items()
              if k in ("uploads", "upload_bytes", "blocking_reads", "host_rollovers")}
    counts = dict(counts)  # the step's calls only (the counting below reads results)
    counts.pop("core.has_running", None)
    counts.pop("ops.deferred_errors", None)  # a context manager, no op call
    forward_tokens = timed.tokens + (draft.model.tokens if source != "ngram" else 0) - tokens_before
    emitted = sum(len(dec.result(s).tokens) for s in seqs) - emitted_before
    core_calls = sum(v for key, v in counts.items() if key.startswith("core."))
    op_calls = sum(v for key, v in counts.items() if key.startswith("ops."))
    forward_s = clock[0]
    outside = total - forward_s
    # The transfers the step would block on, on any device (the audit slows the step, so
    # it runs on steps of its own, after the timed ones).
    audit = TransferAudit(device, dec.staging)
    audited = 0
    for _ in range(2):
        if not dec.has_running():
            break
        with audit:
            dec.step()
        audited += 1
    return {
        "source": source, "batch": B, "k": k, "steps": n,
        "step_ms": 1e3 * total / n, "forward_ms": 1e3 * forward_s / n,
        "outside_share": outside / total,
        "forward_tokens_per_step": forward_tokens / n, "emitted_per_step": emitted / n,
        "native_calls_per_step": core_calls / n, "op_calls_per_step": op_calls / n,
        "calls": {key: v / n for key, v in sorted(counts.items())},
        "syncs_per_step": syncs / n if cuda else None,
        "sync_sites": sync_sites if cuda else None,
        # steps that captured a CUDA graph (each waits for its bit check), and the syncs
        # per step of the others
        "graph_capture_steps": capture_steps,
        "syncs_per_step_without_capture": (plain_syncs / (n - capture_steps)
                                           if cuda and n > capture_steps else None),
        "graphs": [c.stats() for c in caches],
        # through the step's PlanStaging (models/staging.py): the one blocking read is
        # the result download; uploads are asynchronous (pinned on CUDA)
        "staged_uploads_per_step": staged["uploads"] / n,
        "staged_upload_bytes_per_step": staged["upload_bytes"] / n,
        "blocking_reads_per_step": staged["blocking_reads"] / n,
        "host_rollovers": staged["host_rollovers"],
        # TransferAudit: device -> host reads and uploads outside the staging per step,
        # on any device (on CUDA each is a synchronisation)
        "audited_steps": audited,
        "audited_reads_per_step": audit.reads / audited if audited else None,
        "audited_unstaged_uploads_per_step": audit.unstaged_uploads / audited if audited else None,
        "audited_sites": audit.sites,
        "old_design": OLD_CALLS["draft_model" if source == "draft" else "ngram"](k),
    }


def lifetime(cycles: int) -> dict:
    """has_running() and a step with one live sequence, before and after `cycles`
    add/release cycles (the old design scanned every id ever added)."""
    from toymodels import CacheModel
    target = CacheModel(13, seed=1, max_context=4096)
    dec = SpecDecoder(target, None, num_blocks=64, block_size=4)

    def cost():  # a fresh live sequence each time: the same work per step
        live = dec.add([1, 2], max_new_tokens=200, greedy=True)
        t0 = time.perf_counter()
        for _ in range(2000):
            dec.has_running()
        has = (time.perf_counter() - t0) / 2000
        times = []
        for _ in range(50):
            t0 = time.perf_counter()
            dec.step()
            times.append(time.perf_counter() - t0)
        dec.release(live)
        return has, statistics.median(times)

    has0, step0 = cost()
    t0 = time.perf_counter()
    for _ in range(cycles):
        dec.release(dec.add([3, 4], max_new_tokens=4))
    churn = time.perf_counter() - t0
    has1, step1 = cost()
    return {"cycles": cycles, "has_running_us": [1e6 * has0, 1e6 * has1],
            "has_running_ratio": has1 / has0, "step_us": [1e6 * step0, 1e6 * step1],
            "step_ratio": step1 / step0, "add_release_us": 1e6 * churn / cycles,
            # 0: every record was reclaimed (None: a build without the count)
            "records_held": getattr(dec._core, "num_sequences", lambda: None)()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--cycles", type=int, default=300_000)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="a tiny random model (smoke test)")
    ap.add_argument("--torch-plan", action="store_true",
                    help="CPU: run the torch attention plan (the GPU's path: _AttentionPlan, "
                         "KVWrite, their uploads) instead of verispec's CPU layer kernels")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "step.json"))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    model, name = build_model(args.device, dtype, args.quick)
    if args.torch_plan:
        if not hasattr(model, "native_layer_ops"):
            ap.error(f"--torch-plan: {type(model).__name__} has no native_layer_ops switch")
        model.native_layer_ops = False
        name += ", torch plan"
    rows = []
    print(f"{name} on {args.device} ({dtype}), k={args.k}, {args.steps} steps each")
    print(f"{'source':<6} {'B':>3} {'step ms':>9} {'fwd ms':>9} {'fwd tok':>8} {'emitted':>8} {'outside':>8} "
          f"{'native/step':>12} {'ops/step':>9} {'syncs':>6} {'reads':>6} {'unstg':>6} {'staged':>7}"
          f"   old design: down/up/reads")
    for source in ("ngram", "draft"):
        for B in [int(b) for b in args.batches.split(",")]:
            r = measure(model, source, B, args.k, args.steps, args.device)
            rows.append(r)
            old = r["old_design"]
            syncs = "-" if r["syncs_per_step"] is None else f"{r['syncs_per_step']:.1f}"
            print(f"{source:<6} {B:>3} {r['step_ms']:>9.2f} {r['forward_ms']:>9.2f} "
                  f"{r['forward_tokens_per_step']:>8.1f} {r['emitted_per_step']:>8.1f} "
                  f"{100 * r['outside_share']:>7.1f}% {r['native_calls_per_step']:>12.1f} "
                  f"{r['op_calls_per_step']:>9.1f} {syncs:>6} "
                  f"{r['blocking_reads_per_step']:>6.1f} "
                  f"{r['audited_unstaged_uploads_per_step'] or 0:>6.1f} "
                  f"{r['staged_uploads_per_step']:>7.1f}   "
                  f"{old['down']}/{old['up']}/~{old['property_reads']}")
    life = lifetime(args.cycles)
    print(f"\nafter {life['cycles']} add/release cycles: has_running() "
          f"{life['has_running_us'][0]:.2f} -> {life['has_running_us'][1]:.2f} us "
          f"(x{life['has_running_ratio']:.2f}), step {life['step_us'][0]:.0f} -> "
          f"{life['step_us'][1]:.0f} us (x{life['step_ratio']:.2f}), records held "
          f"{life['records_held']}")
    import verispec
    out = {"model": name, "device": args.device, "verispec": verispec.__file__, "dtype": str(dtype), "k": args.k,
           "torch": torch.__version__, "python": platform.python_version(),
           "threads": torch.get_num_threads(), "rows": rows, "lifetime": life}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
