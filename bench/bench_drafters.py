"""Draft sources side by side on SmolLM2-135M (CPU): where speculation pays.

For each prompt (a copy-heavy rewrite, a code edit, an open-ended chat) and each
sampling mode (greedy, temperature 1.0), in one run: plain decoding through the same
loop, n-gram lookup (fixed k and adaptive), self-speculation with the first 4 and 8
layers (fixed k and adaptive). Reports tokens/s, speedup over plain in the same run
(each config timed between two plain runs; the median of the paired ratios over the
rounds), acceptance rate and tokens per target pass; writes JSON and a PNG plot.

Goals (issue 5): on the copy-heavy prompt, greedy, n-gram >= 2.5x over plain; adaptive
k never more than 3% slower than plain. A row's median of 5 paired rounds still swings
by about +-5% on a shared 2-core machine, so the 3% goal is read from each adaptive
config pooled over the rows where every fixed k loses (geometric mean, 95% interval;
with 3 rounds that interval was about +-2%, with 5 about +-1.5%). ~28 minutes.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from pathlib import Path

import torch

import verispec
from verispec.decoder import SpecDecoder
from verispec.drafters import EarlyExit, NGram
from verispec.models import load

PARAGRAPH = ("On Tuesday the city councel met to discuss the new park. Residents asked for more "
             "trees, a playground for the childrn, better lighting along the paths, and benches "
             "near the pond. The councel agreed to publish a plan next month and to hold another "
             "meeting in the libary.")
PROMPTS = {
    "rewrite (copy-heavy)": "Correct the spelling of 'libary' in this text and return the whole text:\n\n"
                            + PARAGRAPH,
    "code edit": (
        "Rename the variable `total` to `result` in this function and return the code.\n\n"
        "def sum_list(values):\n    total = 0\n    for v in values:\n        total = total + v\n"
        "    return total\n"),
    "open chat": "Tell me a short story about a robot who learns to paint.",
}


# (name, draft: None | "ngram" | early-exit layers, k)
CONFIGS = [
    ("plain", None, 0),
    ("ngram k=5", "ngram", 5),
    ("ngram k=10", "ngram", 10),
    ("ngram auto", "ngram", "auto"),
    ("early-exit 4 k=3", 4, 3),
    ("early-exit 8 k=3", 8, 3),
    ("early-exit 4 auto", 4, "auto"),
    ("early-exit 8 auto", 8, "auto"),
]
MODES = {"greedy": dict(greedy=True), "t=1.0": dict(temperature=1.0)}


def configs(model):
    def draft(spec):
        if spec is None:
            return None
        return NGram(1, 4) if spec == "ngram" else EarlyExit(model, num_layers=spec)

    return [(name, draft(spec), k) for name, spec, k in CONFIGS]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=5, help="rounds: speedups are medians of paired ratios")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="one prompt, 16 tokens, 1 repeat")
    ap.add_argument("--only", default="", help="comma-separated substrings: run the prompts, modes "
                    "and drafts whose name contains one of them (plain always runs)")
    ap.add_argument("--out", type=Path, default=Path("bench/out/drafters.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    prompts = dict(list(PROMPTS.items())[:1]) if args.quick else PROMPTS
    n = 16 if args.quick else args.new_tokens
    repeats = 1 if args.quick else args.repeats

    only = [w for w in args.only.split(",") if w]

    def matches(name, words):
        return any(w in name for w in words)

    # Each word filters the axis it names (prompts, modes, drafts); an axis no word names
    # runs whole. Plain always runs: every speedup is relative to it.
    modes = list(MODES)
    draft_names = [c for c, _, _ in CONFIGS]
    axis_words = {axis: [w for w in only if any(w in n for n in names)]
                  for axis, names in (("prompt", prompts), ("mode", modes), ("draft", draft_names))}
    unknown = [w for w in only if not any(w in ws for ws in axis_words.values())]
    if unknown:
        ap.error(f"--only: {unknown} name no prompt ({list(prompts)}), mode ({list(modes)}) "
                 f"or draft ({draft_names})")

    def wanted(axis, name):
        return not axis_words[axis] or matches(name, axis_words[axis])

    model, tok = load("smollm2")
    rows = []
    for warm in (None, EarlyExit(model, num_layers=2)):  # warm up: first op calls, allocator
        SpecDecoder(model, warm, k=2 if warm else 0, num_blocks=16).generate([[1, 2, 3]], max_new_tokens=4)
    for pname, text in prompts.items():
        ids = list(tok.apply_chat_template([{"role": "user", "content": text}],
                                           add_generation_prompt=True, tokenize=True))
        for mode, kw in MODES.items():
            # greedy stops at EOS (every draft gives the same tokens); sampled runs
            # generate exactly n tokens so their rates compare.
            eos = tok.eos_token_ids if mode == "greedy" else None
            if not (wanted("prompt", pname) and wanted("mode", mode)):
                continue
            decs = [(cname, SpecDecoder(model, draft, k=k, max_k=16, num_blocks=128, block_size=16))
                    for cname, draft, k in configs(model) if cname == "plain" or wanted("draft", cname)]
            # Paired timing: every round runs plain, c1, plain, c2, ..., plain, so each
            # config sits between two plain runs; its speedup in that round is the mean
            # of its neighbours' plain times over its own, and the reported speedup is the
            # median over rounds. A config is never compared with a plain run made minutes
            # earlier (on a shared 2-core machine single runs drift by +-10%).
            times = {cname: [] for cname, _ in decs}
            ratios = {cname: [] for cname, _ in decs}
            results = {}

            def timed(cname, dec, rep):
                t0 = time.perf_counter()
                (results[cname],) = dec.generate([ids], max_new_tokens=n, seed=rep,
                                                 eos_token_id=eos, **kw)
                seconds = time.perf_counter() - t0
                times[cname].append(seconds)
                return seconds

            plain_dec = decs[0][1]
            for rep in range(repeats):
                before = timed("plain", plain_dec, rep)
                for cname, dec in decs[1:]:
                    own = timed(cname, dec, rep)
                    after = timed("plain", plain_dec, rep)
                    ratios[cname].append((before + after) / 2 / own)
                    before = after
            plain_tokens = len(results["plain"].tokens)
            for cname, _ in decs:
                res = results[cname]
                # greedy runs may stop at EOS: compare rates, not times, when lengths differ
                length_ratio = len(res.tokens) / plain_tokens
                speedup = (statistics.median(ratios[cname]) * length_ratio if ratios[cname]
                           else 1.0)
                spread = ([min(ratios[cname]) * length_ratio, max(ratios[cname]) * length_ratio]
                          if ratios[cname] else [1.0, 1.0])
                tps = len(res.tokens) / statistics.median(times[cname])
                st = res.stats
                rows.append({"prompt": pname, "mode": mode, "draft": cname, "tokens": len(res.tokens),
                             "tok_s": tps, "speedup": speedup, "speedup_range": spread,
                             "speedup_rounds": [x * length_ratio for x in ratios[cname]],
                             "acceptance": st["acceptance_rate"],
                             "tokens_per_target_pass": st["tokens_per_target_pass"],
                             "k_mean": statistics.fmean(st["k_history"]) if st["k_history"] else 0.0,
                             "time_split": st["time_split"]})
                r = rows[-1]
                acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
                lo, hi = r["speedup_range"]
                print(f"{pname:<22}{mode:<8}{cname:<20}{r['tok_s']:>7.1f} tok/s {r['speedup']:>5.2f}x "
                      f"[{lo:.2f}-{hi:.2f}] "
                      f"acc {acc:>5} tok/pass {r['tokens_per_target_pass']:.2f} k~{r['k_mean']:.1f}",
                      flush=True)

    copy_greedy = [r for r in rows if r["prompt"].startswith("rewrite") and r["mode"] == "greedy"]
    summary = {  # None where --only left nothing to measure
        "copy_heavy_greedy_ngram_speedup": max(
            (r["speedup"] for r in copy_greedy if r["draft"].startswith("ngram")), default=None),
        "adaptive_worst_speedup": min(
            (r["speedup"] for r in rows if r["draft"].endswith("auto")), default=None),
        "best_fixed_speedup": max(
            (r["speedup"] for r in rows if not r["draft"].endswith("auto")), default=None),
        "adaptive_where_speculation_loses": adaptive_where_speculation_loses(rows),
    }
    print()
    if summary["copy_heavy_greedy_ngram_speedup"] is not None:
        print(f"copy-heavy greedy n-gram speedup {summary['copy_heavy_greedy_ngram_speedup']:.2f}x "
              f"(goal >= 2.5x)")
    if summary["adaptive_worst_speedup"] is not None:
        print(f"worst adaptive speedup {summary['adaptive_worst_speedup']:.2f}x (goal >= 0.97x; "
              f"one row is a median of {repeats} paired rounds)")
    for name, st in summary["adaptive_where_speculation_loses"].items():
        print(f"{name}, pooled over the {st['rows']} rows where every fixed k loses to plain: "
              f"{st['speedup']:.3f}x (95% CI {st['ci95'][0]:.3f}-{st['ci95'][1]:.3f}, "
              f"{st['pairs']} paired rounds)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "bench_drafters", "new_tokens": n, "repeats": repeats,
                                    "threads": args.threads, "machine": platform.machine(),
                                    "build_info": verispec.build_info(), "rows": rows,
                                    "summary": summary}, indent=2) + "\n")
    print(f"wrote {args.out}")
    try:
        plot(rows, args.out.with_suffix(".png"))
        print(f"wrote {args.out.with_suffix('.png')}")
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
    return 0


def adaptive_where_speculation_loses(rows) -> dict:
    """Each adaptive config pooled over the rows (prompt, mode) where every fixed k of the
    same draft is slower than plain: there adaptive k should switch speculation off and
    match plain. One row's median of a few paired rounds swings by +-10% on a shared
    machine; the pooled geometric mean of all its rounds is the figure the <= 3% goal is
    read from, with a 95% interval (normal approximation on the log ratios).
    """
    out = {}
    for name in dict.fromkeys(r["draft"] for r in rows if r["draft"].endswith("auto")):
        family = name[:-len("auto")]
        logs, used = [], 0
        for g in dict.fromkeys((r["prompt"], r["mode"]) for r in rows):
            in_group = [r for r in rows if (r["prompt"], r["mode"]) == g]
            fixed = [r for r in in_group if r["draft"].startswith(family) and r["draft"] != name]
            auto = [r for r in in_group if r["draft"] == name]
            if fixed and auto and all(r["speedup"] < 1.0 for r in fixed):
                logs += [math.log(x) for x in auto[0]["speedup_rounds"]]
                used += 1
        if len(logs) < 2:
            continue
        mean = statistics.fmean(logs)
        half = 1.96 * statistics.stdev(logs) / math.sqrt(len(logs))
        out[name] = {"rows": used, "pairs": len(logs), "speedup": math.exp(mean),
                     "ci95": [math.exp(mean - half), math.exp(mean + half)]}
    return out


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["prompt"], r["mode"]) for r in rows}, key=lambda g: ([*PROMPTS].index(g[0]), g[1] != "greedy"))
    drafts = list(dict.fromkeys(r["draft"] for r in rows))
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(drafts)
    for i, d in enumerate(drafts):
        ys = [next((r["speedup"] for r in rows if (r["prompt"], r["mode"]) == g and r["draft"] == d), 0)
              for g in groups]
        ax.bar([x + i * width for x in range(len(groups))], ys, width, label=d)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(groups))])
    ax.set_xticklabels([f"{p}\n{m}" for p, m in groups], fontsize=8)
    ax.set_ylabel("speedup over plain decoding (same run)")
    ax.set_title("verispec draft sources on SmolLM2-135M, CPU")
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
