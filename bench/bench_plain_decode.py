"""Plain greedy decoding of one GGUF, on whichever verispec this Python imports.

For before / after numbers of a change: the same file and settings timed on two builds
(e.g. PYTHONPATH=python with this tree's in-place build, then a venv holding another
commit's wheel). Loads the file as ``load()`` does (the CPU: quantized matrices), decodes
``--new-tokens`` tokens after a ``--prompt-tokens``-token prompt, greedy, plain
(SpecDecoder without a draft), ``--threads`` threads; the fastest of ``--runs`` runs
after a warm-up (the wall time includes the short prefill, so its tokens/s is a lower
bound on the generation rate): on a shared machine the fastest run is the one least
disturbed. Also prints how the model holds its matrices (formats kept, matrices
converted to float32, when this verispec records them). Writes JSON with ``--out``.

    PYTHONPATH=python .venv/bin/python bench/bench_plain_decode.py \
        bench/out/presets/360M-Q4_K_M-verispec-mix.gguf
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import verispec
from verispec.decoder import SpecDecoder
from verispec.models import load


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a GGUF path (or a known name)")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--prompt-tokens", type=int, default=12)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.new_tokens < 1 or args.runs < 1 or args.prompt_tokens < 1:
        ap.error("--new-tokens, --prompt-tokens and --runs must be >= 1")
    torch.set_num_threads(args.threads)
    model, tok = load(args.model)
    ids = (tok.encode("Tell me about the sea and the ships that sail on it, and their crews.")
           * args.prompt_tokens)[:args.prompt_tokens]
    blocks = (args.prompt_tokens + args.new_tokens) // 16 + 2

    def run() -> float:
        dec = SpecDecoder(model, None, k=1, num_blocks=blocks, block_size=16)
        t0 = time.perf_counter()
        dec.generate([ids], max_new_tokens=args.new_tokens, greedy=True, eos_token_id=[])
        return time.perf_counter() - t0

    run()  # warm-up
    times = sorted(run() for _ in range(args.runs))
    w = model.weights
    kept = sorted({f for lw in w.layers for m in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down)
                   for f in getattr(m, "formats", ())})
    converted = getattr(w, "converted", None)
    result = {"model": args.model, "verispec": verispec.__file__, "threads": args.threads,
              "new_tokens": args.new_tokens, "prompt_tokens": args.prompt_tokens,
              "seconds": times, "tok_s": args.new_tokens / times[0], "formats_kept": kept,
              "converted": None if converted is None else list(converted)}
    print(f"{args.model}: {args.new_tokens} tokens in {times[0]:.3f} s (fastest of {args.runs}) -> "
          f"{result['tok_s']:.1f} tok/s; verispec {verispec.__file__}; kept {'/'.join(kept) or 'none'}"
          f"; converted {'not recorded' if converted is None else len(converted)}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
