"""Chains against trees on SmolLM2-135M (CPU): n-gram tries and draft-model trees, and
block verification against token-wise: tokens per target pass, acceptance and tokens/s.

Prompts: a copy-heavy rewrite, an open chat, a text of repeated phrases whose
continuations differ, and a longer one of many such phrases (where a tree's other
branches should pay).

Greedy section (every config emits plain decoding's tokens: checked): plain; n-gram
chains (NGram(1, 4), k in CHAIN_KS) and tries (NGram(1, 4, branches=b), k nodes); a
draft model (--draft quantized: the float32 target's own GGUF kept in Q4_1, a close and
cheaper copy; --draft early-exit: the target's first --early-exit-layers layers) as
chains (k in DRAFT_KS, and k="auto") and as draft trees (draft_branches=b, k nodes; and
k="auto"). The best chain of a family is its fastest fixed-k chain.

Sampled section (temperature 0.7, --sampled-seqs sequences per run from the decoder's
seeded stream): n-gram chains and tries (sampled text need not follow the most recent
occurrence of a phrase, so a trie's other branches can hold it); the draft model's chain
verified token-wise and by block verification
(SpecDecoder(verify_method="block")), and draft trees with i.i.d. and distinct
siblings: accepted proposals per step and tokens/s. Block verification's guarantee is
per step (on the same draft and distributions its expected accepted length is at least
token-wise's), while two whole decodes walk different texts; so the section also runs the
token-wise chain once more (untimed) with PairedVerify, which computes for every step's
inputs what each method accepts in expectation (exactly, expected_accepted): the two
methods on the same steps, with the paired difference's z-score over the steps.

Each config runs --repeats times, interleaved (plain, c1, ..., plain, c1, ...), and
reports the median tokens/s; writes JSON (--out) and a PNG beside it, prints a table.

    .venv/bin/python bench/bench_trees.py [--threads 2] [--new-tokens 96] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

import verispec
from verispec import reference
from verispec.decoder import SpecDecoder
from verispec.drafters import EarlyExit, NGram
from verispec.models import load

PARAGRAPH = ("On Tuesday the city councel met to discuss the new park. Residents asked for more "
             "trees, a playground for the childrn, better lighting along the paths, and benches "
             "near the pond. The councel agreed to publish a plan next month and to hold another "
             "meeting in the libary.")
REPEATED = ("The red box holds the keys. The red box holds the maps. The red box sits on the "
            "shelf. The blue box holds the coins. The blue box sits under the desk. The red box "
            "holds the letters. The blue box holds the stamps.")
MANY = ("Tom went to the market and bought apples. Tom went to the market and sold pears. Tom "
        "went to the park and read a book. Anna went to the market and bought bread. Anna went "
        "to the park and met Tom. Tom went to the market and bought milk. Anna went to the "
        "station and took the train. Tom went to the station and missed the train. Anna went to "
        "the market and sold apples. Tom went to the park and fed the ducks.")
PROMPTS = {
    "rewrite (copy-heavy)": "Correct the spelling of 'libary' in this text and return the whole "
                            "text:\n\n" + PARAGRAPH,
    "open chat": "Tell me a short story about a robot who learns to paint.",
    "repeated phrases": "Continue this list of sentences in the same style, ten more:\n\n"
                        + REPEATED,
    "many repeated phrases": "Continue this diary in the same style, twenty more sentences, each "
                             "starting with Tom or Anna:\n\n" + MANY,
}
CHAIN_KS = (4, 8, 16)
TREES = ((2, 8), (4, 8), (4, 16))  # n-gram tries: (branches, k nodes)
DRAFT_KS = (2, 3, 4)
DRAFT_TREES = ((2, 4), (2, 6), (3, 6))  # draft trees: (branches, k nodes)
SAMPLED = dict(temperature=0.7)
SAMPLED_NGRAM_KS = (4, 8)
SAMPLED_TRIES = ((2, 8), (4, 16))


def greedy_configs(ee):
    """(name, family, draft, decoder keywords)."""
    yield "plain", "plain", None, dict(k=0)
    for k in CHAIN_KS:
        yield f"ngram chain k={k}", "ngram chain", NGram(1, 4), dict(k=k)
    for b, k in TREES:
        yield f"ngram trie b={b} k={k}", "ngram tree", NGram(1, 4, branches=b), dict(k=k)
    for k in DRAFT_KS:
        yield f"draft chain k={k}", "draft chain", ee, dict(k=k)
    yield "draft chain auto", "draft auto", ee, dict(k="auto", max_k=6)
    for b, k in DRAFT_TREES:
        yield f"draft tree b={b} k={k}", "draft tree", ee, dict(k=k, draft_branches=b)
    yield "draft tree b=2 auto", "draft tree auto", ee, dict(k="auto", max_k=6, draft_branches=2)


def sampled_configs(ee):
    yield "plain", "plain", None, dict(k=0)
    for k in SAMPLED_NGRAM_KS:  # sampled text leaves the most recent occurrence: tries
        yield f"ngram chain k={k}", "ngram chain", NGram(1, 4), dict(k=k)
    for b, k in SAMPLED_TRIES:
        yield f"ngram trie b={b} k={k}", "ngram tree", NGram(1, 4, branches=b), dict(k=k)
    for k in (2, 4):
        yield f"draft chain k={k} token", "token", ee, dict(k=k)
        yield f"draft chain k={k} block", "block", ee, dict(k=k, verify_method="block")
    yield "draft tree b=2 k=6 iid", "draft tree", ee, dict(k=6, draft_branches=2)
    yield "draft tree b=2 k=6 distinct", "draft tree", ee, dict(k=6, draft_branches=2,
                                                          draft_replacement=False)


def run_section(model, ids, configs, *, greedy, repeats, new_tokens, seqs, eos):
    """Median tokens/s and the statistics of each config on one prompt."""
    # each sequence's blocks: its prompt, the new tokens and a step's proposals (a fixed 96
    # blocks a sequence held 2 GB of cache per decoder at 32 sequences)
    per_seq = -(-(len(ids) + new_tokens + 32) // 16) + 1
    decs = [(name, family, SpecDecoder(model, draft, num_blocks=per_seq * seqs, block_size=16,
                                       seed=7, **kw))
            for name, family, draft, kw in configs]
    rates = {name: [] for name, _, _ in decs}
    out = {}
    policy = dict(greedy=True) if greedy else SAMPLED
    for _ in range(repeats):
        for name, family, dec in decs:
            dec._core.reseed(7)
            start = time.perf_counter()
            rs = dec.generate([ids] * seqs, max_new_tokens=new_tokens, eos_token_id=eos, **policy)
            n = sum(len(r.tokens) for r in rs)
            rates[name].append(n / (time.perf_counter() - start))
            steps = sum(r.stats["steps"] for r in rs)
            out[name] = dict(family=family, tokens=[r.tokens for r in rs],
                             tokens_per_target_pass=n / max(steps, 1),
                             accepted_per_step=sum(r.stats["accepted"] for r in rs) / max(steps, 1),
                             acceptance_rate=(sum(r.stats["accepted"] for r in rs)
                                              / max(1, sum(r.stats["proposed"] for r in rs))))
    for name, _, _ in decs:
        out[name]["tokens_per_s"] = statistics.median(rates[name])
    return out


def expected_accepted(target, draft_tokens, draft_probs, num_draft, policy):
    """Each row's expected accepted proposals under token-wise and block verification of
    the same draft (exact, no coins): token-wise sum_i prod_{j <= i} min(1, p_j / q_j) at
    the drafted tokens; block, with its keep probabilities h (verispec.reference's),
    sum_i P(tau >= i) = sum_i (1 - prod_{j = i..n} (1 - h_j)), as tau is the largest i whose
    coin falls below h_i. p is the target after the policy, as verify applies it."""
    b, k1, v = target.shape
    k = k1 - 1

    def per_position(x):
        return x.repeat_interleave(k1) if torch.is_tensor(x) and x.dim() == 1 else x

    p = verispec.ops.apply_policy(target.reshape(b * k1, v).float(),
                                  **{n: per_position(x) for n, x in policy.items()}).view(b, k1, v)
    q = torch.cat([draft_probs.float(), draft_probs.new_zeros(b, 1, v).float()], dim=1)
    nd = torch.full((b,), k, dtype=torch.long) if num_draft is None else num_draft.long().cpu()
    y = torch.where(torch.arange(k)[None] < nd[:, None], draft_tokens.long(), 0)
    p_y = p[:, :k].gather(-1, y[..., None]).squeeze(-1).double()
    q_y = q[:, :k].gather(-1, y[..., None]).squeeze(-1).double()
    accept = torch.where(q_y > 0, (p_y / q_y.clamp(min=1e-300)).clamp(max=1.0),
                         (p_y > 0).double())
    live = torch.arange(k)[None] < nd[:, None]
    token = (accept.cumprod(dim=-1) * live).sum(dim=-1)
    w = reference._block_weights(p_y.float(), q_y.float())
    h = reference._block_keep_probabilities(p, q, w, nd).double()            # [B, K]
    miss = (1.0 - h).flip(-1).cumprod(dim=-1).flip(-1)   # prod_{j >= i} (1 - h_j), 0 past n
    block = ((1.0 - miss) * live).sum(dim=-1)
    return token, block


class PairedVerify:
    """verispec.ops for a token-wise decoder that, at each chain verify of a sampled draft
    (draft_probs given), also computes what token-wise and block verification accept on
    those very inputs in expectation (expected_accepted: exact, no coins) and keeps, per
    step, the two sums over the batch's rows (self.steps: (token, block, proposing rows)).
    The decoder goes on with its own result."""

    POLICY = ("temperature", "top_k", "top_p", "min_p")

    def __init__(self) -> None:
        self.steps: list[tuple[float, float, int]] = []

    def __getattr__(self, name):
        return getattr(verispec.ops, name)

    def verify(self, target, draft_tokens, draft_probs=None, **kw):
        out = verispec.ops.verify(target, draft_tokens, draft_probs, **kw)
        greedy = kw.get("greedy", False)
        if (draft_probs is not None and kw.get("method", "token") == "token"
                and not (torch.is_tensor(greedy) and bool(greedy.any())) and greedy is not True):
            nd = kw.get("num_draft")
            token, block = expected_accepted(target, draft_tokens, draft_probs, nd,
                                             {n: kw[n] for n in self.POLICY if n in kw})
            rows = int((nd > 0).sum()) if nd is not None else target.shape[0]
            self.steps.append((float(token.sum()), float(block.sum()), rows))
        return out

    def summary(self) -> dict:
        """Expected accepted proposals per proposing row-step of each method on the same
        steps, and the z-score of the summed paired difference (block - token) over the
        steps (what is left of chance: which drafts were drawn)."""
        n = len(self.steps)
        rows = sum(r for _, _, r in self.steps)
        tok = sum(t for t, _, _ in self.steps)
        blk = sum(b for _, b, _ in self.steps)
        diffs = [b - t for t, b, _ in self.steps]
        sd = statistics.stdev(diffs) if n > 1 else 0.0
        z = sum(diffs) / (sd * n ** 0.5) if sd > 0 else 0.0
        return dict(steps=n, row_steps=rows, token=tok / max(rows, 1), block=blk / max(rows, 1),
                    z=z)


def paired_block_token(model, ids, ee, k, *, seqs, new_tokens, eos) -> dict:
    """PairedVerify's summary over one token-wise sampled decode of `seqs` sequences."""
    paired = PairedVerify()
    per_seq = -(-(len(ids) + new_tokens + 32) // 16) + 1
    SpecDecoder(model, ee, k=k, num_blocks=per_seq * seqs, block_size=16, seed=7,
                ops=paired).generate([ids] * seqs, max_new_tokens=new_tokens, eos_token_id=eos,
                                     **SAMPLED)
    return paired.summary()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--draft", choices=("quantized", "early-exit"), default="quantized",
                    help="the draft model: the same GGUF kept quantized (Q4_1 kernels) for a "
                         "float32 target, or the target's first --early-exit-layers layers")
    ap.add_argument("--early-exit-layers", type=int, default=8)
    ap.add_argument("--sampled-seqs", type=int, default=4,
                    help="sequences per sampled run (acceptance is averaged over them)")
    ap.add_argument("--prompts", default=",".join(PROMPTS),
                    help="comma-separated prompt names (default: all)")
    ap.add_argument("--sections", default="greedy,sampled")
    ap.add_argument("--out", type=Path, default=Path("bench/out/trees.json"))
    args = ap.parse_args(argv)
    names = [p.strip() for p in args.prompts.split(",")]
    unknown = [p for p in names if p not in PROMPTS]
    if unknown:
        raise SystemExit(f"--prompts: expected names among {list(PROMPTS)}, got {unknown}")
    sections = [x.strip() for x in args.sections.split(",")]
    if not set(sections) <= {"greedy", "sampled"}:
        raise SystemExit(f"--sections: expected greedy and/or sampled, got {args.sections!r}")
    torch.set_num_threads(args.threads)
    if args.draft == "quantized":
        model, tok = load("smollm2", dtype=torch.float32)
        ee, _ = load("smollm2")  # the same weights in Q4_1: close to the target, cheaper
    else:
        model, tok = load("smollm2")
        ee = EarlyExit(model, num_layers=args.early_exit_layers)
    SpecDecoder(model, ee, k=4, num_blocks=16, draft_branches=2).generate(
        [[1, 2, 3, 1, 2]], max_new_tokens=4)  # warm up
    eos = list(tok.eos_token_ids)
    rows, summary, paired = [], {}, {}
    for pname in names:
        ids = list(tok.apply_chat_template([{"role": "user", "content": PROMPTS[pname]}],
                                           add_generation_prompt=True, tokenize=True))
        for section in sections:
            greedy = section == "greedy"
            configs = list(greedy_configs(ee) if greedy else sampled_configs(ee))
            got = run_section(model, ids, configs, greedy=greedy, repeats=args.repeats,
                              new_tokens=args.new_tokens, seqs=1 if greedy else args.sampled_seqs,
                              eos=eos)
            if greedy:
                for name, r in got.items():
                    if r["tokens"] != got["plain"]["tokens"]:
                        raise SystemExit(f"{pname} / {name}: greedy tokens differ from plain")
            plain = got["plain"]["tokens_per_s"]
            for name, r in got.items():
                rows.append(dict(prompt=pname, section=section, draft=name, family=r["family"],
                                 tokens=sum(len(t) for t in r["tokens"]),
                                 tokens_per_s=r["tokens_per_s"], speedup=r["tokens_per_s"] / plain,
                                 tokens_per_target_pass=r["tokens_per_target_pass"],
                                 accepted_per_step=r["accepted_per_step"],
                                 acceptance_rate=r["acceptance_rate"]))
            summary.setdefault(pname, {}).update(summarize(rows, pname, section))
            if not greedy:
                for k in (2, 4):
                    ps = paired_block_token(model, ids, ee, k, seqs=args.sampled_seqs,
                                            new_tokens=args.new_tokens, eos=eos)
                    paired[(pname, k)] = ps
                    summary[pname][f"block / token expected accepted per step, same steps, "
                                   f"k={k}"] = (f"{ps['block']:.3f} / {ps['token']:.3f} "
                                                f"(z = {ps['z']:.1f}, {ps['row_steps']} "
                                                f"row-steps)")
    print(f"{'prompt':22} {'section':8} {'draft':26} {'tok/s':>7} {'x plain':>8} {'tok/pass':>9} "
          f"{'acc/step':>9}")
    for r in rows:
        print(f"{r['prompt']:22} {r['section']:8} {r['draft']:26} {r['tokens_per_s']:7.1f} "
              f"{r['speedup']:8.2f} {r['tokens_per_target_pass']:9.2f} {r['accepted_per_step']:9.2f}")
    for pname, s in summary.items():
        for key, value in s.items():
            print(f"{pname}: {key} = {value}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(
        benchmark="bench_trees", verispec=verispec.__version__, machine=platform.machine(),
        threads=args.threads, new_tokens=args.new_tokens, repeats=args.repeats,
        draft=args.draft, early_exit_layers=args.early_exit_layers if args.draft == "early-exit"
        else None, sampled_seqs=args.sampled_seqs,
        sampled_policy=SAMPLED, rows=rows, summary=summary,
        paired_block_token=[dict(prompt=pn, k=k, **ps) for (pn, k), ps in paired.items()],
        block_at_least_token_on_the_same_steps=(all(ps["block"] >= ps["token"]
                                                     for ps in paired.values())
                                                 if paired else None)), indent=2) + "\n")
    print(f"wrote {args.out}")
    plot(rows, args.out.with_suffix(".png"))
    print(f"wrote {args.out.with_suffix('.png')}")
    return 0


def summarize(rows, pname, section) -> dict:
    """The issue's ratios for one prompt and section (tokens/s unless said)."""
    mine = [r for r in rows if r["prompt"] == pname and r["section"] == section]

    def best(family):
        fam = [r for r in mine if r["family"] == family]
        return max(fam, key=lambda r: r["tokens_per_s"]) if fam else None

    def tree_vs_chain(chain, tree):
        c, t = best(chain), best(tree)
        out[f"{tree} / best {chain}"] = (f"{t['tokens_per_s'] / c['tokens_per_s']:.2f}x "
                                         f"({t['draft']} vs {c['draft']})")
        # tokens per target pass does not move with the machine's load
        tp = max(r["tokens_per_target_pass"] for r in mine if r["family"] == tree)
        cp = max(r["tokens_per_target_pass"] for r in mine if r["family"] == chain)
        out[f"{tree} / {chain}, best tokens per target pass"] = f"{tp:.2f} / {cp:.2f}"
        return c

    out = {}
    if section == "greedy":
        tree_vs_chain("ngram chain", "ngram tree")
        c = tree_vs_chain("draft chain", "draft tree")
        a = best("draft tree auto")
        out["draft tree auto / best draft chain"] = f"{a['tokens_per_s'] / c['tokens_per_s']:.2f}x"
        a = best("draft auto")
        out["draft chain auto / best draft chain"] = (
            f"{a['tokens_per_s'] / best('draft chain')['tokens_per_s']:.2f}x")
    else:
        tree_vs_chain("ngram chain", "ngram tree")
        tree_vs_chain("token", "draft tree")  # the draft's chains verified token-wise
        for k in (2, 4):
            tok = next(r for r in mine if r["draft"] == f"draft chain k={k} token")
            blk = next(r for r in mine if r["draft"] == f"draft chain k={k} block")
            out[f"block / token accepted per step, k={k}"] = (
                f"{blk['accepted_per_step']:.3f} / {tok['accepted_per_step']:.3f}")
    return out


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((r["prompt"], r["section"]) for r in rows))
    fig, axes = plt.subplots(len(groups), 1, figsize=(11, 2.6 * len(groups)), squeeze=False)
    for ax, g in zip(axes[:, 0], groups):
        mine = [r for r in rows if (r["prompt"], r["section"]) == g]
        colors = ["tab:green" if "tree" in r["family"] or "trie" in r["draft"] else
                  "tab:orange" if r["family"] == "block" else "tab:blue" for r in mine]
        ax.bar(range(len(mine)), [r["speedup"] for r in mine], color=colors)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(mine)))
        ax.set_xticklabels([r["draft"] for r in mine], rotation=30, ha="right", fontsize=7)
        ax.set_ylabel("x plain")
        ax.set_title(f"{g[0]}, {g[1]}", fontsize=9)
    fig.suptitle("chains (blue), trees (green), block verification (orange): SmolLM2-135M, CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
