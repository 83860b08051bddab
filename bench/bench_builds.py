"""Plain decoding on two source trees, alternating in one run: did a change slow it?

Each round runs the same plain greedy decode once per tree, in a fresh process whose
PYTHONPATH is that tree's ``python/`` (both import the compiled module each tree holds,
or the venv's), in alternating order (A B, B A, ...), after one warm-up each. Cases:

- ``native``: the bundled SmolLM2-135M-Instruct as ``load()`` gives it on the CPU (the
  GGUF's quantized matrices, the fused native layers);
- ``float32``: the same weights dequantized (verispec's float32 kernels);
- ``hf``: the same weights in transformers' LlamaForCausalLM wrapped by HFModel (the
  adapter's path, captured programs).

Prints, per case, each tree's median tokens/s over the rounds, the ratio B / A of the
medians and the range of the per-round ratios, and writes JSON.

    .venv/bin/python bench/bench_builds.py --a /tmp/old --b . --rounds 7 \\
        --out bench/results/cpu-DATE-builds.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

WORKER = r"""
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[2]))
import verispec
from verispec.decoder import SpecDecoder
from verispec.models import load
case, new = sys.argv[1], int(sys.argv[3])
if case == "native":
    model, tok = load("smollm2")
elif case == "float32":
    model, tok = load("smollm2", dtype=torch.float32)
else:
    import transformers
    from verispec.models import HFModel
    native, tok = load("smollm2", dtype=torch.float32)
    c, w = native.config, native.weights
    cfg = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=True)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    h, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    sd = {"model.embed_tokens.weight": w.embed, "model.norm.weight": w.final_norm}
    for i, lw in enumerate(w.layers):
        p = f"model.layers.{i}."
        qkv, gu = lw.wqkv.contiguous(), lw.w_gate_up.contiguous()
        sd.update({p + "input_layernorm.weight": lw.attn_norm,
                   p + "post_attention_layernorm.weight": lw.mlp_norm,
                   p + "self_attn.q_proj.weight": qkv[:q], p + "self_attn.k_proj.weight": qkv[q:q + kv],
                   p + "self_attn.v_proj.weight": qkv[q + kv:], p + "self_attn.o_proj.weight": lw.wo,
                   p + "mlp.gate_proj.weight": gu[:c.intermediate_size],
                   p + "mlp.up_proj.weight": gu[c.intermediate_size:],
                   p + "mlp.down_proj.weight": lw.w_down})
    hf.load_state_dict({k: v.contiguous() for k, v in sd.items()}, strict=False)
    hf.tie_weights()
    model = HFModel(hf)
prompt = tok.apply_chat_template([{"role": "user", "content": "Tell me about the sea."}],
                                 tokenize=True)
def once():
    dec = SpecDecoder(model, None, num_blocks=64, block_size=16)
    t = time.perf_counter()
    (r,) = dec.generate([prompt], max_new_tokens=new, greedy=True)
    return len(r.tokens) / (time.perf_counter() - t), r.tokens
once()
rate, tokens = once()
print(json.dumps({"tokens_per_s": rate, "tokens": tokens, "version": verispec.__version__}))
"""


def run_one(tree: Path, case: str, threads: int, new_tokens: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree / "python"))
    out = subprocess.run([sys.executable, "-c", WORKER, case, str(threads), str(new_tokens)],
                         env=env, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{tree} {case}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", type=Path, required=True, help="the baseline tree (its python/)")
    ap.add_argument("--b", type=Path, required=True, help="the tree under test")
    ap.add_argument("--cases", nargs="+", default=["native", "float32", "hf"],
                    choices=["native", "float32", "hf"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    for name in ("a", "b"):
        tree = getattr(args, name)
        if not (tree / "python" / "verispec" / "__init__.py").is_file():
            ap.error(f"argument --{name}: expected a verispec source tree (python/verispec), "
                     f"got {tree}")
    results = {}
    for case in args.cases:
        rates = {"a": [], "b": []}
        same = True
        for r in range(args.rounds):
            order = ("a", "b") if r % 2 == 0 else ("b", "a")
            got = {}
            for name in order:
                got[name] = run_one(getattr(args, name), case, args.threads, args.new_tokens)
                rates[name].append(got[name]["tokens_per_s"])
            same = same and got["a"]["tokens"] == got["b"]["tokens"]
            print(f"{case} round {r + 1}: A {got['a']['tokens_per_s']:.1f}  "
                  f"B {got['b']['tokens_per_s']:.1f} tok/s", file=sys.stderr, flush=True)
        ratios = [b / a for a, b in zip(rates["a"], rates["b"])]
        results[case] = {"a_tokens_per_s": rates["a"], "b_tokens_per_s": rates["b"],
                         "a_median": statistics.median(rates["a"]),
                         "b_median": statistics.median(rates["b"]),
                         "ratio_of_medians": statistics.median(rates["b"]) / statistics.median(rates["a"]),
                         "round_ratios": ratios, "greedy_tokens_identical": same}
    print("| case | A tok/s | B tok/s | B / A | per-round B / A | same tokens |")
    print("|---|---:|---:|---:|---|---|")
    for case, r in results.items():
        print(f"| {case} | {r['a_median']:.1f} | {r['b_median']:.1f} | "
              f"{r['ratio_of_medians']:.3f} | {min(r['round_ratios']):.3f}-"
              f"{max(r['round_ratios']):.3f} | {'yes' if r['greedy_tokens_identical'] else 'NO'} |")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"a": str(args.a), "b": str(args.b),
                                        "threads": args.threads, "new_tokens": args.new_tokens,
                                        "rounds": args.rounds, "time": time.strftime("%Y-%m-%d %H:%M"),
                                        "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
