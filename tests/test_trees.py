"""Trees in the decoder: n-gram tries verified in one target pass (NGram(branches > 1)).

The trie rule against a brute force; greedy tree speculation against plain greedy
decoding (toy models, the native Llama, the transformers adapter); the joint distribution
of the first tokens under sampling, with power tests (a wrong ancestor mask, K/V not
moved); cache truth after tree steps; no leaked blocks; failed steps change nothing.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_decoder import (ALPHA, assert_no_leaks, chi_square_pvalue, exact_continuations,
                          greedy_reference)
from test_step_contract import snapshot
from toymodels import CacheModel

from verispec import _C, reference
from verispec import ops as native_ops
from verispec.decoder import SpecDecoder
from verispec.drafters import NGram

V = 13
OPS = [pytest.param(native_ops, id="native"), pytest.param(reference, id="reference")]
# prompts whose suffixes recur with different continuations: the tries branch
PROMPTS = [[1, 2, 3, 1, 2, 4, 1, 2, 3, 5, 1, 2], [3, 3, 3, 1, 3, 3, 2, 3, 7, 3],
           [7, 8, 9, 7, 8, 10, 7, 8, 9, 7], [5]]


def check_cache_truth(dec: SpecDecoder, seq: int):
    """The target's cached K/V equal a fresh prefill of the committed tokens (the toy
    model stores (token, position) as K): the accepted path was moved into place."""
    committed = dec._core.committed(seq)
    n = dec._core.cache_len(seq, _C.ModelRole.target)
    assert n < len(committed), "the target may never cache past the committed tokens"
    table = dec._core.block_table(seq, _C.ModelRole.target)
    k = dec._pools[_C.ModelRole.target].k[0].view(-1, 2)
    bs = dec.block_size
    slots = [table[p // bs] * bs + p % bs for p in range(n)]
    got = k[slots].long().tolist() if slots else []
    assert got == [[committed[p], p] for p in range(n)], "target cache differs from a prefill"


# ---- the trie rule -----------------------------------------------------------------

def brute_force_tree(tokens, min_n, max_n, k, branches, max_matches=32, shares=False):
    """ngram.h's trie rule, written plainly: the continuations of the longest matching
    suffix's earlier occurrences (most recent first), best first by count, then recency,
    then creation order, at most `branches` children per node. shares=True: also each
    chosen node's count over its parent's children's counts, and the same along the most
    recent occurrence's continuation (propose(k)'s chain)."""
    L = len(tokens)
    froms = []
    for n in range(min(max_n, L), min_n - 1, -1):
        key = tokens[L - n:]
        froms = [e + 1 for e in range(L - 2, n - 2, -1) if tokens[e - n + 1:e + 1] == key]
        if froms:
            break
    froms = froms[:max_matches]
    if k <= 0 or not froms:
        return ([], [], [], []) if shares else ([], [])
    nodes = [dict(token=-1, count=0, recency=0, children={}, parent=None, out=-1, chosen=0)]
    for m, f in enumerate(froms):
        at = 0
        for t in tokens[f:f + k]:
            child = nodes[at]["children"].get(t)
            if child is None:
                child = len(nodes)
                nodes.append(dict(token=t, count=0, recency=m, children={}, parent=at, out=-1,
                                  chosen=0))
                nodes[at]["children"][t] = child
            nodes[child]["count"] += 1
            at = child
    out, parents, frontier = [], [], list(nodes[0]["children"].values())
    while len(out) < k:
        open_ = [c for c in frontier if nodes[nodes[c]["parent"]]["chosen"] < branches]
        if not open_:
            break
        best = min(open_, key=lambda c: (-nodes[c]["count"], nodes[c]["recency"], c))
        frontier.remove(best)
        parent = nodes[nodes[best]["parent"]]
        parent["chosen"] += 1
        nodes[best]["out"] = len(out)
        out.append(nodes[best]["token"])
        parents.append(parent["out"])
        frontier += list(nodes[best]["children"].values())
    if not shares:
        return out, parents

    def share(c):
        return nodes[c]["count"] / sum(nodes[x]["count"]
                                       for x in nodes[nodes[c]["parent"]]["children"].values())
    chosen = sorted((n for n in range(1, len(nodes)) if nodes[n]["out"] >= 0),
                    key=lambda n: nodes[n]["out"])
    chain, at = [], 0
    for t in tokens[froms[0]:froms[0] + k]:
        at = nodes[at]["children"][t]
        chain.append(share(at))
    return out, parents, [share(n) for n in chosen], chain


@settings(max_examples=300, deadline=None, derandomize=True)
@given(tokens=st.lists(st.integers(0, 3), max_size=30), min_n=st.integers(1, 2),
       extra=st.integers(0, 2), k=st.integers(0, 9), branches=st.integers(1, 4))
def test_trie_matches_brute_force(tokens, min_n, extra, k, branches):
    index = _C.NGramIndex(min_n, min_n + extra)
    index.extend(tokens)
    got = index.propose_tree(k, branches)
    assert (list(got[0]), list(got[1])) == brute_force_tree(tokens, min_n, min_n + extra, k,
                                                            branches)
    for i, parent in enumerate(got[1]):
        assert -1 <= parent < i
    # siblings distinct
    pairs = list(zip(got[1], got[0]))
    assert len(set(pairs)) == len(pairs)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(tokens=st.lists(st.integers(0, 3), max_size=30), k=st.integers(0, 9),
       branches=st.integers(1, 4))
def test_trie_shares_match_brute_force(tokens, k, branches):
    """A node's share: its continuations over its parent's (ngram.h), for the trie's nodes
    and along the chain propose(k) gives, which adaptive k scores (expected_trie_tokens)."""
    index = _C.NGramIndex(1, 2)
    index.extend(tokens)
    freqs, chain = index.tree_shares(k, branches)
    _, _, want, want_chain = brute_force_tree(tokens, 1, 2, k, branches, shares=True)
    assert freqs == pytest.approx(want, abs=1e-12) and chain == pytest.approx(want_chain, abs=1e-12)
    assert len(chain) == len(index.propose(k))


def test_trie_shares_example():
    index = _C.NGramIndex(1, 3)
    index.extend([1, 2, 3, 1, 2, 4, 1, 2, 3, 5, 1, 2])
    # after "1 2": 3 5 1 2, 4 1 2 3, 3 1 2 4 (most recent first); the chain is 3 5 1 2
    freqs, chain = index.tree_shares(6, 2)
    assert freqs == pytest.approx([2 / 3, 1 / 2, 1, 1, 1 / 3, 1])
    assert chain == pytest.approx([2 / 3, 1 / 2, 1, 1])


def test_expected_trie_tokens_matches_its_definition():
    """expected[m - 1] = 1 + sum_{i < m} P(i), P(i) = P(parent) a w(i) (adaptive_k.h);
    a chain of weights 1 is expected_tokens."""
    parents, weights, a = [-1, 0, 1, 0, 3, -1], [0.5, 1.0, 0.25, 0.5, 1.0, 0.5], 0.8
    reach, want = [], []
    for p, w in zip(parents, weights):
        reach.append((1.0 if p < 0 else reach[p]) * a * w)
        want.append(1 + sum(reach))
    assert _C.expected_trie_tokens(a, parents, weights) == pytest.approx(want, abs=1e-12)
    assert _C.expected_trie_tokens(a, [-1, 0, 1], [1.0] * 3)[-1] == pytest.approx(
        _C.expected_tokens(a, 3))


def test_trie_node_weights_example():
    """adaptive_k.h's w: 1 where the continuations agree; where they disagree, r for the
    most recent continuation's child and (1 - r) f / (1 - f_recent) for the others."""
    index = _C.NGramIndex(1, 3)
    index.extend([1, 2, 3, 1, 2, 4, 1, 2, 3, 5, 1, 2])
    tokens, parents = index.propose_tree(6, 2)
    freqs, chain_freqs = index.tree_shares(6, 2)
    w, recent = _C.trie_node_weights(0.8, tokens, parents, freqs, index.propose(6), chain_freqs)
    # 3 5 1 2 is the most recent continuation; 4 (a third of them) and its child are not
    assert recent == [True, True, True, True, False, False]
    assert w == pytest.approx([0.8, 0.8, 1.0, 1.0, 0.2 * (1 / 3) / (1 - 2 / 3), 1.0])
    w, _ = _C.trie_node_weights(0.8, [3, 5], [-1, 0], [2 / 3, 1 / 2], [], [])
    assert w == pytest.approx([2 / 3, 1 / 2])  # no recent continuation known: the shares


def test_trie_example_and_the_chain_special_case():
    index = _C.NGramIndex(1, 3)
    index.extend([1, 2, 3, 1, 2, 4, 1, 2, 3, 5, 1, 2])
    # "1 2" was followed by 3 twice (3 5 1 2, 3 1 2 4) and by 4 once (4 1 2 3)
    assert index.propose_tree(6, 2) == ([3, 5, 1, 2, 4, 1], [-1, 0, 1, 2, -1, 4])
    assert index.propose_tree(6, 1) == ([3, 5, 1, 2], [-1, 0, 1, 2])
    one = _C.NGramIndex(1, 2)
    one.extend([4, 5, 6, 7, 4])  # one occurrence: exactly the chain propose() gives
    assert one.propose_tree(3, 3) == (one.propose(3), [-1, 0, 1])
    with pytest.raises(ValueError, match="branches must be >= 1, got 0"):
        index.propose_tree(3, 0)


# ---- greedy: the target's own tokens -------------------------------------------------

def _count_tree_passes(monkeypatch):
    seen = {"tree": 0}
    real = SpecDecoder._forward

    def counted(self, role, p, s, input_ids=None):
        seen["tree"] += bool(p.get("has_tree_mask"))
        return real(self, role, p, s, input_ids)

    monkeypatch.setattr(SpecDecoder, "_forward", counted)
    return seen


@pytest.mark.parametrize("ops", OPS)
@pytest.mark.parametrize("k,branches", [(3, 2), (6, 3), (8, 8)])
def test_greedy_trees_equal_plain_greedy_with_cache_truth(monkeypatch, ops, k, branches):
    seen = _count_tree_passes(monkeypatch)
    target = CacheModel(V, seed=1, table_rows=17)
    dec = SpecDecoder(target, NGram(1, 3, branches=branches), k=k, num_blocks=64, block_size=4,
                      ops=ops)
    seqs = [dec.add(p, max_new_tokens=24, greedy=True) for p in PROMPTS]
    while dec.has_running():
        dec.step()
        for s in seqs:
            if dec._core.finish_reason(s) == "running":
                check_cache_truth(dec, s)
    for p, s in zip(PROMPTS, seqs):
        r = dec.result(s)
        assert r.tokens == greedy_reference(target, p, 24)
        assert r.stats["accepted"] <= r.stats["proposed"]
        dec.release(s)
    assert seen["tree"] > 0, "no step verified a branching tree"
    assert_no_leaks(dec)


def test_trees_accept_more_than_the_chain_on_branching_text():
    """A target that continues a recurring phrase in a way the most recent occurrence did
    not: the trie's other branches hold it."""
    target = CacheModel(V, seed=1, table_rows=17)
    prompts = [p * 3 for p in PROMPTS[:3]]
    got = {}
    for branches in (1, 4):
        dec = SpecDecoder(target, NGram(1, 3, branches=branches), k=8, num_blocks=128,
                          block_size=4)
        rs = dec.generate(prompts, max_new_tokens=30, greedy=True)
        got[branches] = sum(r.stats["steps"] for r in rs)
        assert [r.tokens for r in rs] == [greedy_reference(target, p, 30) for p in prompts]
    assert got[4] <= got[1]


def test_adaptive_k_with_trees_keeps_greedy_output():
    target = CacheModel(V, seed=1, table_rows=17)
    dec = SpecDecoder(target, NGram(1, 3, branches=3), k="auto", max_k=6, num_blocks=64,
                      block_size=4)
    rs = dec.generate(PROMPTS, max_new_tokens=20, greedy=True)
    assert [r.tokens for r in rs] == [greedy_reference(target, p, 20) for p in PROMPTS]
    assert_no_leaks(dec)


class ScriptModel(CacheModel):
    """A target whose greedy text is a fixed script: after a prefix of the script it puts
    all its mass on the script's next token (elsewhere: CacheModel's table)."""

    def __init__(self, vocab, script):
        super().__init__(vocab, seed=3, table_rows=17)
        self.script = list(script)

    def logits_for(self, prefix):
        n = len(prefix)
        if n < len(self.script) and list(prefix) == self.script[:n]:
            return torch.nn.functional.one_hot(torch.tensor(self.script[n]), self.table.shape[1]).float() * 30.0
        return super().logits_for(prefix)


def _phrases(middle, n):
    """n phrases 1 2 c 5, the j-th c given by middle(j)."""
    return [t for j in range(n) for t in (1, 2, middle(j), 5)]


def test_adaptive_k_runs_an_ngram_trie_only_where_its_branches_pay(monkeypatch):
    """k="auto" with NGram(1, 1, branches=2): a row runs the trie's first m nodes or the
    chain of the most recent continuation, whichever the continuations' shares at each node
    (adaptive_k.h, expected_trie_tokens) and the measured pass costs make the faster step.
    Scripts of phrases 1 2 c 5. With c drawn from {3, 4} the most recent phrase's c is
    right half the time and the trie's two branches always: most steady steps are trees
    (a step whose first disagreement lies deep may still run the chain), and the run
    emits more tokens per pass than with chains. With a new c in every phrase no
    branch is ever right (each earlier c is 1 / n of the continuations): the steps are
    chains. Each target row costs 10% of a one-row pass, on a SyntheticClock (the same
    decisions on every run). Greedy output is the script either way."""
    from test_adaptive_k import Slow, SyntheticClock
    clock = SyntheticClock(monkeypatch)
    passes = []
    real_forward = SpecDecoder._forward

    def forward(self, role, p, s, input_ids=None):
        if role == _C.ModelRole.target:
            passes.append(bool(p.get("has_tree_mask")))
        return real_forward(self, role, p, s, input_ids)

    monkeypatch.setattr(SpecDecoder, "_forward", forward)
    coin = torch.randint(2, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    scripts = {"two middles": _phrases(lambda j: 3 + coin[j], 48),
               "a new middle each time": _phrases(lambda j: 6 + j, 48)}
    tail, per_pass = {}, {}
    for name, script in scripts.items():
        prompt = script[:24]
        got = {}
        for branches in (1, 2):
            target = Slow(ScriptModel(64, script), 0.02, 0.002, clock)
            passes.clear()
            dec = SpecDecoder(target, NGram(1, 1, branches=branches), k="auto", max_k=16,
                              num_blocks=128, block_size=4)
            (r,) = dec.generate([prompt], max_new_tokens=120, greedy=True)
            assert r.tokens == script[24:144]
            assert_no_leaks(dec)
            got[branches] = r.stats["tokens_per_target_pass"]
        # the second half of the trie run's passes: past the first steps, where the
        # acceptance is still near its prior 0.5 and deep nodes are not worth their rows
        tail[name] = [int(v) for v in passes[len(passes) // 2:-1]]
        per_pass[name] = got
    assert len(tail["two middles"]) >= 8 and len(tail["a new middle each time"]) >= 8, tail
    assert sum(tail["two middles"]) >= 0.5 * len(tail["two middles"]), (tail, per_pass)
    assert sum(tail["a new middle each time"]) == 0, (tail, per_pass)
    assert per_pass["two middles"][2] > 1.15 * per_pass["two middles"][1], per_pass
    assert per_pass["a new middle each time"][2] == per_pass["a new middle each time"][1]


def test_trees_with_a_token_budget_chunked_prefill_and_keyed_rows():
    """Prefill rows and keyed rows (chains) share a tree step's verify pass."""
    target = CacheModel(V, seed=1, table_rows=17)
    dec = SpecDecoder(target, NGram(1, 3, branches=3), k=5, num_blocks=64, block_size=4,
                      max_tokens_per_step=9)
    rs = dec.generate(PROMPTS, max_new_tokens=16, greedy=True)
    assert [r.tokens for r in rs] == [greedy_reference(target, p, 16) for p in PROMPTS]
    assert_no_leaks(dec)
    rs = dec.generate(PROMPTS, max_new_tokens=16, greedy=True, seed=7)
    assert [r.tokens for r in rs] == [greedy_reference(target, p, 16) for p in PROMPTS]
    assert_no_leaks(dec)


# ---- sampling: the joint distribution of the first tokens ----------------------------

SV = 5
DEPTH = 3
# NGram(1, 1): the last token "1" is the key; it was followed by 2 0, 3 1, 2 4, 4 1, so
# the prompt's own step (2 nodes: max_new_tokens - 1) drafts siblings 2 and 4 (count 2,
# then the most recent), and later steps draft tries too
TREE_PROMPT = [1, 2, 0, 1, 3, 1, 2, 4, 1, 4, 1]


def _tree_counts(dec, n, policy):
    """Counts of the first DEPTH tokens of n runs of DEPTH tokens."""
    counts: dict = {}
    for _ in range(n // 200):  # small batches: the tree mask is [T, T] over the step
        for r in dec.generate([TREE_PROMPT] * 200, max_new_tokens=DEPTH, **policy):
            counts[tuple(r.tokens)] = counts.get(tuple(r.tokens), 0) + 1
    return counts


def _sampling_target(strict=True):
    return CacheModel(SV, seed=3, table_rows=53, scale=1.5, strict=strict)


@pytest.mark.parametrize("policy", [dict(temperature=1.0), dict(temperature=0.7, top_k=3)],
                         ids=["t1", "t0.7-topk3"])
def test_tree_decoding_matches_the_enumerated_target_distribution(monkeypatch, policy):
    seen = _count_tree_passes(monkeypatch)
    target = _sampling_target()
    dec = SpecDecoder(target, NGram(1, 1, branches=3), k=4, num_blocks=4000, block_size=2,
                      seed=100)
    probs = exact_continuations(target, TREE_PROMPT, policy)
    assert chi_square_pvalue(_tree_counts(dec, 6000, policy), probs) > ALPHA
    assert seen["tree"] > 0


def test_power_a_chain_mask_instead_of_the_ancestor_mask_fails(monkeypatch):
    """Every new token of a row sees all the row's earlier new tokens (siblings and their
    subtrees included): the target reads wrong prefixes and the test must reject it."""
    real = SpecDecoder._forward

    def causal_mask(self, role, p, s, input_ids=None):
        if p.get("has_tree_mask"):
            host, inputs = s.host, s.inputs
            T = p["num_tokens"]
            p = dict(p)
            mask = torch.ones(T, T, dtype=torch.bool).tril()
            qs = host[p["query_start"]:p["query_start"] + 8 * (p["num_rows"] + 1)]
            starts = qs.view(torch.int64).tolist()
            row = torch.zeros(T, dtype=torch.long)
            for r in range(p["num_rows"]):
                row[starts[r]:starts[r + 1]] = r
            mask &= row[:, None] == row[None, :]
            offset = len(host)
            inputs = torch.cat([inputs, mask.view(-1).to(torch.uint8)])
            s = dataclasses.replace(s, host=inputs, inputs=inputs)
            p["tree_mask"] = offset
        return real(self, role, p, s, input_ids)

    monkeypatch.setattr(SpecDecoder, "_forward", causal_mask)
    policy = dict(temperature=1.0)
    target = _sampling_target(strict=False)
    dec = SpecDecoder(target, NGram(1, 1, branches=3), k=4, num_blocks=4000, block_size=2,
                      seed=100)
    probs = exact_continuations(target, TREE_PROMPT, policy)
    assert chi_square_pvalue(_tree_counts(dec, 6000, policy), probs) < ALPHA


def test_power_kv_not_moved_fails(monkeypatch):
    """Skipping the accepted path's K/V move leaves the next step reading the nodes in
    cache order: the test must reject it."""
    monkeypatch.setattr(SpecDecoder, "_move_accepted", lambda self, *a: None)
    policy = dict(temperature=1.0)
    target = _sampling_target(strict=False)
    dec = SpecDecoder(target, NGram(1, 1, branches=3), k=4, num_blocks=4000, block_size=2,
                      seed=100)
    probs = exact_continuations(target, TREE_PROMPT, policy)
    assert chi_square_pvalue(_tree_counts(dec, 6000, policy), probs) < ALPHA


def test_strict_toy_model_catches_kv_not_moved(monkeypatch):
    monkeypatch.setattr(SpecDecoder, "_move_accepted", lambda self, *a: None)
    target = CacheModel(V, seed=1, table_rows=17)
    dec = SpecDecoder(target, NGram(1, 3, branches=4), k=8, num_blocks=64, block_size=4)
    with pytest.raises(AssertionError, match="cache corrupt"):
        dec.generate(PROMPTS, max_new_tokens=24, greedy=True)


# ---- failed and cancelled tree steps -------------------------------------------------

class BadTreeOps:
    """verispec.ops whose verify_tree reports an accepted path that is not one."""

    def __init__(self, kind):
        self.kind = kind
        self.apply_policy, self.sample = native_ops.apply_policy, native_ops.sample
        self.verify = native_ops.verify

    def verify_tree(self, logits, tokens, parents, q, **kw):
        out, emitted, nodes = (t.clone() for t in native_ops.verify_tree(
            logits, tokens, parents, q, **kw))
        n = kw["num_nodes"]
        for b in range(out.shape[0]):
            children_of_0 = (parents[b, :int(n[b])] == 0).nonzero()
            if self.kind == "not_a_path" and len(children_of_0):
                # accept a child of node 0 at depth 1, as if it hung from the root
                nodes[b, 0] = int(children_of_0[0])
                emitted[b] = 2
                out[b, 0] = tokens[b, nodes[b, 0]]
                out[b, 1] = 0
                break
            if int(n[b]) >= 2 and self.kind != "not_a_path":
                if self.kind == "wrong_token":
                    nodes[b, 0] = 0
                    emitted[b] = 2
                    out[b, 0] = (int(tokens[b, 0]) + 1) % V
                    out[b, 1] = 0
                elif self.kind == "wrong_shape":
                    nodes = nodes[:, :1]
                break
        return out, emitted, nodes


BAD_TREE = {
    "not_a_path": r"accepted_nodes\[\d+, 0\] must be a node in \[0, \d+\) whose parent is the "
                  r"root, got \d+ \(parent 0\)",
    "wrong_token": r"tokens\[\d+, 0\] is accepted node 0, so it must equal its token",
    "wrong_shape": r"ops.verify_tree must return an integer tensor \[\d+, \d+\] as accepted_nodes",
}


@pytest.mark.parametrize("kind", sorted(BAD_TREE))
def test_a_bad_tree_result_changes_nothing_and_the_run_continues(kind):
    target = CacheModel(V, seed=1, table_rows=17)
    want = [r.tokens for r in SpecDecoder(target, NGram(1, 3, branches=3), k=5, num_blocks=64,
                                          block_size=4, seed=5)
            .generate(PROMPTS[:3], max_new_tokens=14, temperature=1.0)]
    dec = SpecDecoder(target, NGram(1, 3, branches=3), k=5, num_blocks=64, block_size=4)
    dec._core.reseed(5)
    seqs = [dec.add(p, max_new_tokens=14, temperature=1.0) for p in PROMPTS[:3]]
    dec.step()
    good = dec._ops
    # a step whose tries all came out as chains runs as a chain step (no verify_tree):
    # the bad ops go in until a tree step calls them and fails
    for _ in range(14):
        before = snapshot(dec, seqs)
        dec._ops = BadTreeOps(kind)
        try:
            dec.step()
        except ValueError as e:
            assert re.search(BAD_TREE[kind], str(e)), e
            break
        finally:
            dec._ops = good
    else:
        pytest.fail("no step verified a tree")
    assert snapshot(dec, seqs) == before
    assert not dec._core.step_open
    while dec.has_running():
        dec.step()
    assert [dec.result(s).tokens for s in seqs] == want
    for s in seqs:
        dec.release(s)
    assert_no_leaks(dec)


def test_a_model_error_in_a_tree_step_restores_everything():
    target = CacheModel(V, seed=1, table_rows=17)
    dec = SpecDecoder(target, NGram(1, 3, branches=3), k=5, num_blocks=64, block_size=4)
    seqs = [dec.add(p, max_new_tokens=14, greedy=True) for p in PROMPTS[:3]]
    dec.step()
    before = snapshot(dec, seqs)
    real = target.forward

    def boom(batch):
        raise RuntimeError("model failed")

    target.forward = boom
    with pytest.raises(RuntimeError, match="model failed"):
        dec.step()
    assert snapshot(dec, seqs) == before
    target.forward = real
    while dec.has_running():
        dec.step()
    assert [dec.result(s).tokens for s in seqs] == [greedy_reference(target, p, 14)
                                                     for p in PROMPTS[:3]]


def test_tree_options_are_validated():
    with pytest.raises(ValueError, match=r"NGram: branches must be an int in \[1, 64\], got 0"):
        NGram(1, 3, branches=0)
    with pytest.raises(ValueError, match="ngram_branches = 2 \\(trees\\) needs n-gram drafting"):
        _C.SpecDecoder(k=0, has_draft_model=False, target_num_blocks=4, draft_num_blocks=0,
                       block_size=4, vocab_size=5, max_context=16, seed=0, ngram_branches=2)


def test_ops_without_verify_tree_are_refused_clearly():
    from types import SimpleNamespace
    chain_ops = SimpleNamespace(apply_policy=native_ops.apply_policy, sample=native_ops.sample,
                                verify=native_ops.verify)
    target = CacheModel(V, seed=1, table_rows=17)
    with pytest.raises(ValueError, match="need ops with verify_tree"):
        SpecDecoder(target, NGram(1, 3, branches=2), k=3, ops=chain_ops)
    dec = SpecDecoder(target, NGram(1, 3), k=3, ops=chain_ops)  # chains need no verify_tree
    assert dec.generate(PROMPTS[:1], max_new_tokens=4, greedy=True)[0].tokens
    assert_no_leaks(dec)


# ---- real models ---------------------------------------------------------------------

def test_native_llama_attends_with_the_tree_mask_like_hf(tmp_path):
    """LlamaModel's logits over a tree batch equal its own logits of each node's path
    decoded as a chain; and a wrong mask changes them (power)."""
    import transformers
    from test_decode_llama import tiny_llama

    from verispec.models.base import KVPools, PagedBatch
    model = tiny_llama(tmp_path, seed=0, layers=2)
    g = model.geometry
    prompt = [5, 17, 42, 9]
    nodes, parents = [7, 8, 9, 10, 11], [-1, 0, -1, 2, 0]
    depth = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)

    def path(i):
        out = []
        while i >= 0:
            out.append(nodes[i])
            i = parents[i]
        return out[::-1]

    def batch_of(ids, positions, mask, pools, ctx):
        T = len(ids)
        return PagedBatch(
            input_ids=torch.tensor(ids), positions=torch.tensor(positions),
            slot_mapping=torch.arange(ctx - T, ctx, dtype=torch.int32),
            block_tables=torch.arange(4, dtype=torch.int32)[None],
            context_lens=torch.tensor([ctx], dtype=torch.int32),
            query_start=torch.tensor([0, T]), logits_indices=torch.arange(T), kv=pools,
            tree_mask=mask)

    ids = prompt + nodes
    T = len(ids)
    mask = torch.zeros(T, T, dtype=torch.bool)
    for t in range(len(prompt)):
        mask[t, :t + 1] = True
    for i in range(len(nodes)):
        mask[len(prompt) + i, :len(prompt)] = True
        j = i
        while j >= 0:
            mask[len(prompt) + i, len(prompt) + j] = True
            j = parents[j]
    positions = list(range(len(prompt))) + [len(prompt) + d - 1 for d in depth]
    pools = KVPools.allocate(g, 4, 16)
    tree_logits = model.forward(batch_of(ids, positions, mask, pools, T))
    for i in range(len(nodes)):
        chain = prompt + path(i)
        fresh = KVPools.allocate(g, 4, 16)
        want = model.forward(batch_of(chain, list(range(len(chain))), None, fresh, len(chain)))
        torch.testing.assert_close(tree_logits[len(prompt) + i], want[-1], rtol=1e-5, atol=1e-5)
    wrong = torch.ones(T, T, dtype=torch.bool).tril()
    bad = model.forward(batch_of(ids, positions, wrong, KVPools.allocate(g, 4, 16), T))
    assert (bad[len(prompt) + 2] - tree_logits[len(prompt) + 2]).abs().max() > 1e-3
    del transformers


@pytest.mark.parametrize("batched", [False, True])
def test_greedy_trees_on_the_native_llama(monkeypatch, tmp_path, batched):
    from test_decode_llama import plain_greedy, tiny_llama
    seen = _count_tree_passes(monkeypatch)
    target = tiny_llama(tmp_path, seed=0)
    prompts = [[5, 17, 42, 5, 17, 9, 5, 17, 100, 5, 17, 42, 5, 17], [4, 4, 4, 9, 4, 4, 8, 4]]
    prompts = prompts if batched else prompts[:1]
    dec = SpecDecoder(target, NGram(1, 3, branches=3), k=6, num_blocks=64, block_size=4)
    got = [r.tokens for r in dec.generate(prompts, max_new_tokens=20, greedy=True)]
    assert got == plain_greedy(target, prompts, 20)
    assert seen["tree"] > 0
    assert dec.num_free_blocks() == dec.num_blocks()


def test_greedy_trees_on_the_hf_adapter(monkeypatch):
    import transformers
    from verispec.models import HFModel
    from verispec.models.testing import randomize_weights
    seen = _count_tree_passes(monkeypatch)
    cfg = transformers.AutoConfig.for_model(
        "llama", vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    randomize_weights(hf, seed=1)
    model = HFModel(hf)
    prompts = [[5, 17, 42, 5, 17, 9, 5, 17, 60, 5, 17, 42, 5, 17], [4, 4, 4, 9, 4, 4, 8, 4]]
    plain = SpecDecoder(model, None, num_blocks=64, block_size=4)
    want = [r.tokens for r in plain.generate(prompts, max_new_tokens=16, greedy=True)]
    del plain
    dec = SpecDecoder(model, NGram(1, 3, branches=3), k=6, num_blocks=64, block_size=4)
    got = [r.tokens for r in dec.generate(prompts, max_new_tokens=16, greedy=True)]
    assert got == want
    assert seen["tree"] > 0
    assert dec.num_free_blocks() == dec.num_blocks()


def test_logprobs_of_tree_steps_are_the_tokens_own(monkeypatch):
    """Logprobs read the logits along the accepted path: equal to plain decoding's."""
    target = CacheModel(V, seed=1, table_rows=17)
    plain = SpecDecoder(target, None, num_blocks=64, block_size=4).generate(
        PROMPTS[:2], max_new_tokens=12, greedy=True, logprobs=2)
    dec = SpecDecoder(target, NGram(1, 3, branches=3), k=5, num_blocks=64, block_size=4)
    got = dec.generate(PROMPTS[:2], max_new_tokens=12, greedy=True, logprobs=2)
    for a, b in zip(plain, got):
        assert a.tokens == b.tokens
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.token == y.token
            assert x.raw_logprob == pytest.approx(y.raw_logprob, abs=1e-5)
            assert [t for t, _, _ in x.top] == [t for t, _, _ in y.top]
