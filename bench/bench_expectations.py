"""What a user can expect over plain decoding: the README's table, per drafter and prompt.

SmolLM2-135M-Instruct (the bundled model, its Q4_1 GGUF kept quantized), greedy, one
sequence, through the same code as ``verispec generate``: the drafter a user gets (the
CLI's own _make_draft, so early exit picks its depth the way the CLI does), the same
warm-up, the same timed runs (cli.generate._decode_run: only step() is timed), and the
same verdict (verispec.cli.speed.judge). For each prompt and drafter, speculative and
plain runs alternate back to back over --rounds rounds (the order flipping each round),
so drifting load hits both sides of a round alike. Each cell is the median of the per-round ratios, its range, the noise
of the same runs (the larger relative spread of the plain and speculative rates), the
tokens per target pass and the verdict's kind ("measured", "within noise", "above the
cap", "nothing drafted"). Greedy outputs must equal plain decoding's (checked).

    .venv/bin/python bench/bench_expectations.py [--rounds 3] [--new-tokens 96] [--threads 2]

Prints a Markdown table and writes JSON (with the commit, the machine and its load
average before and after) to --out, by default bench/results/cpu-<date>-expectations-<commit>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import types
from pathlib import Path

import torch

from verispec.cli import common
from verispec.cli.generate import _decode_run
from verispec.cli.speed import judge, median, spread
from verispec.models import load

ROOT = Path(__file__).resolve().parent.parent

# The demo's paragraph (Makefile: DEMO_TEXT): a rewrite, so the answer repeats the prompt.
PARAGRAPH = ("On Tuesday the city councel met to discuss the new park. Residents asked for "
             "more trees, a playground for the childrn, better lighting along the paths, and "
             "benches near the pond. The councel agreed to publish a plan next month and to "
             "hold another meeting in the libary.")
PROMPTS = {
    "rewrite (copy-heavy)": "Correct the spelling of 'libary' in this text and return the "
                            "whole text:\n\n" + PARAGRAPH,
    "code": "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "open chat": "Tell me about the history of the printing press.",
}
# (name, the CLI options a user would pass)
DRAFTERS = {
    "n-gram, k auto (the default)": dict(draft="ngram"),
    "n-gram, k 4": dict(draft="ngram", k=4),
    "early exit (depth calibrated), k auto": dict(draft="early-exit"),
}


def _args(new_tokens: int, **options) -> types.SimpleNamespace:
    """The namespace `verispec generate` would parse for these options."""
    args = types.SimpleNamespace(
        draft=None, draft_model=None, ngram_min=None, ngram_max=None, early_exit_layers=None,
        k=None, max_k=None, max_new_tokens=new_tokens, seed=0, verify="token", branches=1,
        distinct_siblings=False, cuda_graphs=True)
    for key, value in options.items():
        setattr(args, key, value)
    return args


def _commit() -> str:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=30)
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--",
                                "python", "csrc"], capture_output=True, text=True, timeout=30)
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", nargs="+", choices=sorted(PROMPTS), default=list(PROMPTS))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.new_tokens < 1 or args.threads < 1:
        ap.error(f"--rounds, --new-tokens and --threads must be >= 1, got {args.rounds}, "
                 f"{args.new_tokens}, {args.threads}")
    torch.set_num_threads(args.threads)
    commit = _commit()
    date = datetime.date.today().isoformat()
    load_before = os.getloadavg()
    model, tok = load("smollm2")
    eos = list(tok.eos_token_ids)
    policy = dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0)
    cells = []
    for prompt_name in args.prompts:
        ids = list(tok.apply_chat_template([{"role": "user", "content": PROMPTS[prompt_name]}],
                                           add_generation_prompt=True, tokenize=True))
        runners: dict = {"plain": (None, 0, _args(args.new_tokens, draft="none"))}
        for name, options in DRAFTERS.items():
            a = _args(args.new_tokens, **options)
            draft, desc, _ = common._make_draft(a, model, tok, "cpu", None, ids)
            runners[name] = (draft, a.k, a, desc)
        for draft, *_ in runners.values():
            common._warm_up(model, draft, ids)
        # each drafter against its own plain runs, back to back, the order flipping each
        # round (as `verispec generate` alternates them): a round's ratio compares runs
        # seconds apart
        runs: dict = {name: [] for name in runners}
        plain_of: dict = {name: [] for name in DRAFTERS}
        for r in range(args.rounds):
            for name in DRAFTERS:
                for who in ((name, "plain") if r % 2 == 0 else ("plain", name)):
                    draft, k, a = runners[who][:3]
                    run = _decode_run(model, draft, k, a.max_k or 8, ids, policy, a, eos=eos)
                    (plain_of[name] if who == "plain" else runs[name]).append(run)
                    print(f"  {prompt_name} | {name} | round {r + 1} | {who}: "
                          f"{len(run['tokens']) / run['seconds']:.1f} tok/s",
                          file=sys.stderr, flush=True)
        for name in DRAFTERS:
            spec, plain = runs[name], plain_of[name]
            plain_rates = [len(x["tokens"]) / x["seconds"] for x in plain]
            rates = [len(x["tokens"]) / x["seconds"] for x in spec]
            stats = spec[-1]["stats"]
            verdict = judge(rates, plain_rates,
                            tokens_per_pass=float(stats["tokens_per_target_pass"]),
                            plain_tokens_per_pass=float(plain[-1]["stats"]["tokens_per_target_pass"]),
                            proposed=int(stats["proposed"]))
            k_hist = stats.get("k_history") or []
            cells.append(dict(
                prompt=prompt_name, drafter=name, draft=runners[name][3],
                plain_tokens_per_s=median(plain_rates), tokens_per_s=median(rates),
                ratios=verdict.ratios, speedup=verdict.median, low=min(verdict.ratios),
                high=max(verdict.ratios), noise=verdict.noise, kind=verdict.kind,
                verdict=verdict.line(), tokens=len(spec[-1]["tokens"]),
                tokens_per_target_pass=stats["tokens_per_target_pass"],
                acceptance_rate=stats["acceptance_rate"],
                mean_k=sum(k_hist) / len(k_hist) if k_hist else 0.0,
                plain_spread=spread(plain_rates),
                greedy_identical=all(x["tokens"] == plain[0]["tokens"] for x in spec + plain)))
    load_after = os.getloadavg()
    record = dict(
        bench="expectations", date=date, commit=commit, model="smollm2 (SmolLM2-135M-Instruct "
        "Q4_1 GGUF, quantized kernels)", greedy=True, new_tokens=args.new_tokens,
        rounds=args.rounds, threads=args.threads,
        machine=dict(cpu=_cpu_model(), cpus=os.cpu_count(), platform=platform.platform(),
                     load_average_before=load_before, load_average_after=load_after),
        command=" ".join([".venv/bin/python", "bench/bench_expectations.py"] + list(
            argv if argv is not None else sys.argv[1:])),
        cells=cells)
    out = args.out or ROOT / "bench" / "results" / f"cpu-{date}-expectations-{commit}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")

    print(f"| prompt | drafter | plain tok/s | speedup (median, range) | tokens per pass | verdict |")
    print("|---|---|---:|---:|---:|---|")
    for c in cells:
        print(f"| {c['prompt']} | {c['drafter']} | {c['plain_tokens_per_s']:.0f} | "
              f"{c['speedup']:.2f}x ({c['low']:.2f}-{c['high']:.2f}) | "
              f"{c['tokens_per_target_pass']:.2f} | {c['kind']}"
              f"{'' if c['greedy_identical'] else ', OUTPUTS DIFFER'} |")
    print(f"\nload average {load_before[0]:.1f} before, {load_after[0]:.1f} after; wrote {out}")
    return 0 if all(c["greedy_identical"] for c in cells) else 1


if __name__ == "__main__":
    raise SystemExit(main())
