"""What bounds n-gram speculation's speed-up at concurrency 1 on this machine.

A speculative step that emits ``a + 1`` tokens from a pass over ``T`` tokens beats plain
decoding by ``(a + 1) * c(1) / c(T)``, where ``c(T)`` is what a whole decoder step of a
``T``-token target pass costs (drafting, the pass, verify, commit). Two things fix the
ratio: the text (how many of the drafter's proposals the target accepts) and the
machine (how ``c(T)`` grows with ``T``). This separates them, in one process, for one
greedy request (no HTTP; ``bench_serve.py`` serves the same prompts):

1. The plain greedy text of --prompt (default: bench_serve's copy-heavy rewrite).
2. ``c(T)``: every decoder step of plain decoding and of n-gram chains of each k in
   --cost-ks is timed by itself (``SpecDecoder.step``), keyed by the tokens its target
   pass carried (1 + the step's proposals); the table gives the median per T, the
   prefill step left out. The configurations run interleaved, --rounds times.
3. The n-gram proposals on that text, replayed with the native index
   (``_C.NGramIndex``, the decoder's own rule; the replay's passes must equal the
   decoder's, which is checked): for chain k = --k, the passes and the ratio the costs
   predict, beside the measured one; and for an oracle that cuts each proposal to what
   the target will accept (0 where nothing is), the best any choice of k can do with
   these proposals on this machine.
4. What ``c(k + 1) / c(1)`` would have to be for chain k to reach --target over plain
   on this text.

    .venv/bin/python bench/bench_ceiling.py                  # SmolLM2 Q4_1, ~2 min
    .venv/bin/python bench/bench_ceiling.py --dtype float32  # the dequantized weights

Prints the tables and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

from verispec import _C
from verispec.decoder import SpecDecoder
from verispec.drafters import NGram
from verispec.models import load

from bench_serve import PROMPTS

ROOT = Path(__file__).resolve().parents[1]


def timed_decode(dec: SpecDecoder, ids: list[int], new_tokens: int, eos: list[int]):
    """One greedy request, each step timed: (tokens, [(target pass tokens, seconds)], stats).
    The first step (the prefill) is not among the samples."""
    seq = dec.add(ids, max_new_tokens=new_tokens, greedy=True, eos_token_id=eos)
    seconds = []
    try:
        while dec.has_running():
            t0 = time.perf_counter()
            dec.step()
            seconds.append(time.perf_counter() - t0)
        result = dec.result(seq)
    finally:
        dec.release(seq)
    ks = result.stats["k_history"]
    if len(ks) != len(seconds):
        raise RuntimeError(f"k_history has {len(ks)} steps, {len(seconds)} were timed")
    samples = [(k + 1, s) for k, s in zip(ks[1:], seconds[1:])]
    return result.tokens, samples, result.stats, sum(seconds)


def replay(ids: list[int], text: list[int], k: int, max_n: int,
           max_new_tokens: int) -> list[tuple[int, int]]:
    """The n-gram chain's steps on ``text``: (proposed, accepted) per target pass. As the
    decoder, a pass proposes no more than the length limit leaves room for."""
    index = _C.NGramIndex(1, max_n)
    index.extend(list(ids))
    steps, i = [], 0
    while i < len(text):
        proposal = index.propose(min(k, max_new_tokens - i - 1))
        a = 0
        while a < len(proposal) and i + a < len(text) and proposal[a] == text[i + a]:
            a += 1
        steps.append((len(proposal), a))
        index.extend(text[i:i + a + 1])
        i += a + 1
    return steps


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", default="rewrite (copy-heavy)", choices=sorted(PROMPTS))
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32"),
                    help="auto: the GGUF's Q4_1 kept quantized; float32: dequantized")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=5, help="the chain whose ceiling is shown")
    ap.add_argument("--ngram-max", type=int, default=3)
    ap.add_argument("--cost-ks", type=int, nargs="+", default=[1, 2, 3, 4, 5, 8, 16])
    ap.add_argument("--target", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench/out/ceiling.json"))
    args = ap.parse_args(argv)
    for name in ("new_tokens", "k", "ngram_max", "rounds", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(k < 1 for k in args.cost_ks):
        ap.error(f"--cost-ks must all be >= 1, got {args.cost_ks}")
    if args.target <= 0:
        ap.error(f"--target must be > 0, got {args.target}")
    torch.set_num_threads(args.threads)
    model, tok = load("smollm2", dtype=torch.float32 if args.dtype == "float32" else None)
    eos = list(tok.eos_token_ids)
    ids = list(tok.apply_chat_template([{"role": "user", "content": PROMPTS[args.prompt]}],
                                       add_generation_prompt=True, tokenize=True))
    blocks = -(-(len(ids) + args.new_tokens + max(args.cost_ks) + 16) // 16) + 4
    ks = sorted(set(args.cost_ks) | {args.k})
    decs = {"plain": SpecDecoder(model, None, k=0, num_blocks=blocks)}
    for k in ks:
        decs[f"n-gram k={k}"] = SpecDecoder(model, NGram(1, args.ngram_max), k=k,
                                            num_blocks=blocks)
    decs["n-gram auto"] = SpecDecoder(model, NGram(1, args.ngram_max), k="auto",
                                      num_blocks=blocks)
    for dec in decs.values():  # first calls pay one-off setup
        dec.generate([ids], max_new_tokens=4, greedy=True, eos_token_id=eos)

    by_tokens: dict[int, list[float]] = {}
    wall: dict[str, list[float]] = {n: [] for n in decs}
    stats, text = {}, None
    for r in range(args.rounds):
        for name in (list(decs) if r % 2 == 0 else list(decs)[::-1]):
            tokens, samples, st, seconds = timed_decode(decs[name], ids, args.new_tokens, eos)
            if text is None:
                text = tokens
            elif tokens != text:  # greedy: every configuration returns the same tokens
                raise RuntimeError(f"{name}: greedy tokens differ from plain decoding's")
            for t, s in samples:
                by_tokens.setdefault(t, []).append(s)
            wall[name].append(seconds)
            stats[name] = {"steps": st["steps"], "k_history": st["k_history"],
                           "tokens_per_target_pass": st["tokens_per_target_pass"]}
    cost = {t: statistics.median(v) for t, v in sorted(by_tokens.items())}
    if 1 not in cost:
        raise RuntimeError("no one-token step was timed")
    c1 = cost[1]

    def c(t: int) -> float:  # a pass size never timed: the next larger one timed
        larger = [u for u in cost if u >= t]
        return cost[min(larger)] if larger else cost[max(cost)]

    n = len(text)
    chain = replay(ids, text, args.k, args.ngram_max, args.new_tokens)
    decoded = stats[f"n-gram k={args.k}"]["k_history"]
    if [p for p, _ in chain] != decoded:
        raise RuntimeError(f"the replay proposed {[p for p, _ in chain]} tokens a pass, the "
                           f"decoder {decoded}")
    plain_cost = n * c1
    chain_cost = sum(c(p + 1) for p, _ in chain)
    oracle_cost = sum(c(a + 1) for _, a in chain)
    # c(T) / c(1) that every pass with proposals may cost for the target (those without
    # cost c(1)): n c(1) / (n0 c(1) + (passes - n0) x c(1)) = target
    n0 = sum(1 for p, _ in chain if p == 0)
    needed = (n / args.target - n0) / (len(chain) - n0) if len(chain) > n0 else float("inf")
    med = {name: statistics.median(v) for name, v in wall.items()}
    rows = []
    for name, passes, predicted in (
            ("plain", n, 1.0),
            (f"n-gram k={args.k}", len(chain), plain_cost / chain_cost),
            ("oracle k (n-gram proposals cut to what is accepted)", len(chain),
             plain_cost / oracle_cost)):
        measured = med["plain"] / med[name] if name in med else None
        rows.append({"config": name, "passes": passes, "tokens_per_pass": n / passes,
                     "predicted_vs_plain": predicted, "measured_vs_plain": measured})
    rows.append({"config": "n-gram auto", "passes": stats["n-gram auto"]["steps"],
                 "tokens_per_pass": stats["n-gram auto"]["tokens_per_target_pass"],
                 "predicted_vs_plain": None,
                 "measured_vs_plain": med["plain"] / med["n-gram auto"]})

    print(f"\n{args.prompt}, {args.dtype} weights, {n} greedy tokens, {args.threads} threads, "
          f"{args.rounds} rounds, commit {commit()}")
    print("\n| target pass tokens T | steps timed | median ms a step | c(T) / c(1) |")
    print("|---:|---:|---:|---:|")
    for t, v in cost.items():
        print(f"| {t} | {len(by_tokens[t])} | {v * 1e3:.2f} | {v / c1:.2f} |")
    print("\n| config | target passes | tokens / pass | predicted vs plain | measured vs plain |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        pred, meas = (("" if row[key] is None else f"{row[key]:.2f}x")
                      for key in ("predicted_vs_plain", "measured_vs_plain"))
        print(f"| {row['config']} | {row['passes']} | {row['tokens_per_pass']:.2f} | {pred} | "
              f"{meas} |")
    print(f"\nFor {args.target}x over plain at k = {args.k} on this text ({n0} of its "
          f"{len(chain)} passes propose nothing), a step with proposals may cost at most "
          f"{needed:.2f} one-token steps; a {args.k + 1}-token step measured "
          f"{c(args.k + 1) / c1:.2f}.")
    report = {
        "settings": vars(args) | {"out": str(args.out)},
        "commit": commit(), "machine": platform.processor() or platform.machine(),
        "text_tokens": n,
        "cost_by_pass_tokens_s": {str(t): v for t, v in cost.items()},
        "steps_timed": {str(t): len(v) for t, v in by_tokens.items()},
        "chain_steps": [{"proposed": p, "accepted": a} for p, a in chain],
        "rows": rows,
        "wall_s": wall,
        "max_cost_ratio_for_target": needed,
        "cost_ratio_measured": c(args.k + 1) / c1,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
