"""Draft-model trees (SpecDecoder(draft_branches=f > 1)): a draft model proposes f
children per level from its own q (sampled i.i.d. or without replacement; greedy rows:
its top f), the target verifies the tree in one pass with ops.verify_tree(draft_probs=q).

Greedy trees against plain greedy decoding (toy models, the native Llama, early exit);
the joint distribution of the first tokens under sampling, with power (a wrong q, and
siblings drawn without replacement verified as i.i.d.); cache truth of target and draft
after every step; failed steps change nothing; argument errors.
"""

from __future__ import annotations

import pytest
import torch
from test_decoder import (ALPHA, SV, assert_no_leaks, check_cache_truth, chi_square_pvalue,
                          exact_continuations, greedy_reference)
from test_step_contract import snapshot
from toymodels import CacheModel

from verispec import _C, reference
from verispec import ops as native_ops
from verispec.decoder import SpecDecoder
from verispec.drafters import EarlyExit, NGram

V = 13
OPS = [pytest.param(native_ops, id="native"), pytest.param(reference, id="reference")]
PROMPTS = [[1, 2, 3, 1, 2, 4], [3, 3, 7], [7, 8, 9, 7, 8, 10, 7], [5]]


def models(noise=1.2, vocab=V, **kw):
    target = CacheModel(vocab, seed=1, table_rows=17, **kw)
    return target, CacheModel(vocab, base=target, noise=noise, seed=2, **kw)


class Watch:
    """Counts tree verify passes and accepted off-spine nodes (a sibling other than the
    first: only a tree can accept those)."""

    def __init__(self, monkeypatch):
        self.tree_passes = self.off_spine = 0
        self.verify_passes = []  # per target pass: whether it carried a tree
        real_forward, real_verify = SpecDecoder._forward, SpecDecoder._verify_tree
        watch = self

        def forward(self, role, p, s, input_ids=None):
            watch.tree_passes += bool(p.get("has_tree_mask"))
            if role == _C.ModelRole.target:
                watch.verify_passes.append(bool(p.get("has_tree_mask")))
            return real_forward(self, role, p, s, input_ids)

        def verify_tree(self, s, *args):
            tokens, emitted, accepted, nodes = real_verify(self, s, *args)
            f = self.draft_branches
            j = torch.arange(nodes.shape[1])
            off = (j[None, :] < accepted[:, None]) & (nodes.long() % f != 0)
            watch.off_spine += int(off.sum())
            return tokens, emitted, accepted, nodes

        monkeypatch.setattr(SpecDecoder, "_forward", forward)
        monkeypatch.setattr(SpecDecoder, "_verify_tree", verify_tree)


# ---- the core's plan of a draft-tree step ----------------------------------------------

def _ints(buf, offset, n, dtype):
    size = torch.tensor([], dtype=dtype).element_size()
    return torch.frombuffer(buf, dtype=torch.uint8)[offset:offset + n * size].view(dtype).tolist()


def test_the_core_plans_the_draft_tree_shape():
    """k = 7, f = 3: nodes in levels of 3 (the last of 1), level l >= 1 hanging from node
    (l - 1) * 3; 3 draft passes whose children go to b * K + 3 j, with q rows 0, 1, 4; a
    keyed row beside it is a chain (7 passes of 1 child, q rows j)."""
    core = _C.SpecDecoder(k=7, has_draft_model=True, target_num_blocks=64, draft_num_blocks=64,
                          block_size=4, vocab_size=V, max_context=256, seed=0,
                          draft_branches=3)
    core.add([1, 2, 3], 20, 1.0, 0, 1.0, 0.0, [], [])
    core.add([4, 5], 20, 1.0, 0, 1.0, 0.0, [], [], seed=9)  # keyed: a chain
    plan = core.begin_step()
    buf, K = plan["inputs"], plan["k"]
    assert plan["tree"] and plan["draft_tree"] and K == 7 and plan["row_k"] == [7, 7]
    parents = _ints(buf, plan["tree_parents"], 2 * K, torch.int32)
    assert parents[:K] == [-1, -1, -1, 0, 0, 0, 3]
    assert parents[K:] == [-1, 0, 1, 2, 3, 4, 5]
    drafts = plan["passes"][:-1]
    assert len(drafts) == 7
    for j, p in enumerate(drafts):
        n = p["num_rows"]
        rows = _ints(buf, p["rows"], n, torch.int64)
        index = dict(zip(rows, _ints(buf, p["draft_index"], n, torch.int64)))
        children = dict(zip(rows, _ints(buf, p["num_children"], n, torch.int64)))
        q_rows = dict(zip(rows, _ints(buf, p["q_index"], n, torch.int64)))
        if j < 3:
            assert index[0] == 3 * j and children[0] == [3, 3, 1][j]
            assert q_rows[0] == [0, 1, 4][j]
        else:
            assert 0 not in rows  # the tree row's passes are done
        assert index[1] == K + j and children[1] == 1 and q_rows[1] == (K + 1) + j
    core.cancel_step(plan["step_id"])


# ---- greedy: the target's own tokens, the draft's top f as candidates -----------------

@pytest.mark.parametrize("ops", OPS)
@pytest.mark.parametrize("k,branches", [(4, 2), (6, 3), (8, 4), (3, 5)])
def test_greedy_draft_trees_equal_plain_greedy_with_cache_truth(monkeypatch, ops, k, branches):
    watch = Watch(monkeypatch)
    target, draft = models()
    dec = SpecDecoder(target, draft, k=k, num_blocks=64, block_size=4, ops=ops,
                      draft_branches=branches)
    seqs = [dec.add(p, max_new_tokens=24, greedy=True) for p in PROMPTS]
    while dec.has_running():
        dec.step()
        for s in seqs:
            if dec._core.finish_reason(s) == "running":
                check_cache_truth(dec, s)  # target and draft
    for p, s in zip(PROMPTS, seqs):
        r = dec.result(s)
        assert r.tokens == greedy_reference(target, p, 24)
        dec.release(s)
    assert watch.tree_passes > 0
    assert watch.off_spine > 0, "no step accepted a sibling other than the first"
    assert_no_leaks(dec)


def test_greedy_draft_tree_candidates_are_the_drafts_top_f(monkeypatch):
    """Greedy rows propose the draft's f most likely tokens at each level, most likely
    first, and one draft pass per level (depth = ceil(k / f))."""
    target, draft = models()
    passes = []
    real = SpecDecoder._draft_tree_passes

    def spy(self, s):
        q = real(self, s)
        passes.append((len(s.plan["passes"]) - 1, s.plan["row_k"], s.draft_tokens.clone()))
        return q

    monkeypatch.setattr(SpecDecoder, "_draft_tree_passes", spy)
    dec = SpecDecoder(target, draft, k=5, num_blocks=64, block_size=4, draft_branches=2)
    prompt = [4, 6]
    dec.generate([prompt], max_new_tokens=2 + 6, greedy=True)
    n, row_k, tokens = passes[0]
    assert row_k == [5] and n == 3  # levels of 2, 2 and 1 nodes
    top = torch.topk(draft.logits_for(prompt), 2).indices.tolist()
    assert tokens[0, :2].tolist() == top
    spine = prompt + [top[0]]
    assert tokens[0, 2:4].tolist() == torch.topk(draft.logits_for(spine), 2).indices.tolist()
    spine.append(int(tokens[0, 2]))
    assert int(tokens[0, 4]) == int(torch.argmax(draft.logits_for(spine)))


def test_draft_trees_with_a_token_budget_chunked_prefill_and_keyed_rows():
    target, draft = models()
    dec = SpecDecoder(target, draft, k=6, num_blocks=64, block_size=4, draft_branches=3,
                      max_tokens_per_step=9)
    long_prompt = list(range(V)) * 6  # > kTreeMaxUncached: its first step is a chain
    prompts = PROMPTS + [long_prompt]
    rs = dec.generate(prompts, max_new_tokens=16, greedy=True)
    assert [r.tokens for r in rs] == [greedy_reference(target, p, 16) for p in prompts]
    assert_no_leaks(dec)
    rs = dec.generate(prompts, max_new_tokens=16, greedy=True, seed=7)  # keyed: chains
    assert [r.tokens for r in rs] == [greedy_reference(target, p, 16) for p in prompts]
    assert_no_leaks(dec)


def test_adaptive_k_with_draft_trees_keeps_greedy_output():
    target, draft = models()
    dec = SpecDecoder(target, draft, k="auto", max_k=6, num_blocks=64, block_size=4,
                      draft_branches=2)
    rs = dec.generate(PROMPTS, max_new_tokens=20, greedy=True)
    assert [r.tokens for r in rs] == [greedy_reference(target, p, 20) for p in PROMPTS]
    assert_no_leaks(dec)


def _wrong_first(target, bad_rows, second: bool):
    """A draft equal to `target` but at the table rows `bad_rows`, where the target's
    greedy token is the draft's second most likely (second=True: there the spine node
    is rejected and its sibling accepted) or its least likely (second=False: the spine
    node and its sibling are rejected). Elsewhere the spine node is accepted."""
    draft = CacheModel(target.table.shape[1], base=target, noise=0.0, seed=3, table_rows=17)
    for r in bad_rows:
        t = int(torch.argmax(target.table[r]))
        others = torch.cat([draft.table[r, :t], draft.table[r, t + 1:]])
        draft.table[r, t] = others.max() - 0.5 if second else -100.0
    return draft


def test_adaptive_draft_trees_widen_only_where_the_siblings_pay(monkeypatch):
    """k="auto" with draft_branches = 2: a row's depth is chosen as a chain's and it
    proposes the tree (2 children a level) only where its siblings' measured acceptance
    pays their verify rows (adaptive_k.h, tree_pays). Each target row costs 10% of a
    one-row pass, on a SyntheticClock: the decoder measures exactly the synthetic costs, so
    the decisions are the same on every run (on the wall clock, sleep jitter and a
    stale cost bucket made 1 run in 4-5 fail one side or the other). Two drafts whose first choice is
    wrong at the same half of the contexts: one whose second choice is then right (its
    siblings are accepted: the later steps are trees) and one whose second choice is
    wrong too (s falls as 1 / (n + 2) over n tries: the later steps are chains). Both
    try trees first (kTreeExploreTrials: s is measured before it is judged; with these
    costs a tree would pay if its siblings were always right). Greedy output stays the
    plain greedy tokens in both."""
    from test_adaptive_k import Slow, SyntheticClock
    watch = Watch(monkeypatch)
    clock = SyntheticClock(monkeypatch)
    target, _ = models()
    tail = {}
    for second in (True, False):
        draft = _wrong_first(target, range(0, 17, 2), second)
        watch.verify_passes.clear()
        dec = SpecDecoder(Slow(target, 0.02, 0.002, clock), Slow(draft, 0.002, 0.0, clock),
                          k="auto",
                          max_k=6, num_blocks=64, block_size=4, draft_branches=2)
        (r,) = dec.generate([PROMPTS[0]], max_new_tokens=64, greedy=True)
        assert r.tokens == greedy_reference(target, PROMPTS[0], 64)
        # the steady steps: past the first (the prior s = 0.5) and before the last (where
        # the tokens left cap the row below a second level)
        tail[second] = [int(v) for v in watch.verify_passes[6:-3]]
        assert_no_leaks(dec)
    assert len(tail[True]) >= 8 and len(tail[False]) >= 8, tail
    assert sum(tail[True]) >= 0.8 * len(tail[True]) and sum(tail[False]) <= 0.2 * len(tail[False]), tail


def test_adaptive_draft_trees_go_deep_with_a_perfect_draft(monkeypatch):
    """k="auto" with draft_branches = 2 and a draft that is always right: the first steps
    measure the draft (two levels, so one draft pass is steady even when every proposal
    was accepted and the catch-up pass carries two tokens), then the rows go deep as
    chains do (a tree's siblings are never needed). Before the measuring steps had a
    second level, such a row stayed at one level: 2 tokens per target pass. Exploring
    trees is only for a draft whose siblings could pay (tree_pays with s = 1): once this
    draft's acceptance is measured, no step is a tree (at most the first, on the prior;
    exploring regardless took kTreeExploreSteps = 4 tree steps). The target's cost per
    token (4 ms on 20) keeps a second level of siblings clearly too dear for the
    acceptance measured after one step: at 2 ms the decision sat at the boundary and the
    sleeps' jitter made steps 1-2 trees in about one run in six (the costs are now on a
    SyntheticClock as well: the same decisions on every run)."""
    from test_adaptive_k import Slow, SyntheticClock
    watch = Watch(monkeypatch)
    clock = SyntheticClock(monkeypatch)
    target = Slow(CacheModel(50, seed=1, scale=4.0), 0.02, 0.004, clock)
    twin = Slow(CacheModel(50, seed=1, scale=4.0), 0.002, 0.0, clock)
    dec = SpecDecoder(target, twin, k="auto", max_k=6, num_blocks=64, block_size=4,
                      draft_branches=2)
    (r,) = dec.generate([[1, 2, 3]], max_new_tokens=60, greedy=True)
    assert r.tokens == greedy_reference(target, [1, 2, 3], 60)
    assert dec.cost_model()["draft_pass_s"] is not None
    assert r.stats["tokens_per_target_pass"] > 3, r.stats["k_history"]
    assert sum(watch.verify_passes[1:]) == 0, watch.verify_passes


@pytest.mark.parametrize("source", ["separate", "early_exit"])
def test_greedy_draft_trees_on_the_native_llama(monkeypatch, tmp_path, source):
    from test_decode_llama import plain_greedy, tiny_llama
    watch = Watch(monkeypatch)
    target = tiny_llama(tmp_path / "t", seed=0)
    draft = (tiny_llama(tmp_path / "d", seed=1, layers=1) if source == "separate"
             else EarlyExit(target, num_layers=1))
    prompts = [[5, 17, 42, 5, 17, 9, 5, 17, 100], [4, 4, 4, 9, 4, 4, 8, 4]]
    dec = SpecDecoder(target, draft, k=6, num_blocks=64, block_size=4, draft_branches=3)
    got = [r.tokens for r in dec.generate(prompts, max_new_tokens=20, greedy=True)]
    assert got == plain_greedy(target, prompts, 20)
    assert watch.tree_passes > 0
    assert dec.num_free_blocks() == dec.num_blocks()


# ---- sampling: the joint distribution of the first tokens -----------------------------

DEPTH = 3
PROMPT = [1, 2]


def _counts(dec, n, policy):
    counts: dict = {}
    for _ in range(n // 500):
        for r in dec.generate([PROMPT] * 500, max_new_tokens=DEPTH, **policy):
            counts[tuple(r.tokens)] = counts.get(tuple(r.tokens), 0) + 1
    return counts


def _sampling_models(noise):
    target = CacheModel(SV, seed=3, table_rows=53, scale=1.5)
    if noise is None:
        return target, CacheModel(SV, seed=4, table_rows=53, scale=1.5)
    return target, CacheModel(SV, base=target, noise=noise, seed=4)


CASES = {  # (policy, draft noise (None: unrelated), branches, replacement)
    "t1-close-iid": (dict(temperature=1.0), 0.8, 2, True),
    "t1-close-distinct": (dict(temperature=1.0), 0.8, 2, False),
    "t0.7-topk3-unrelated-iid": (dict(temperature=0.7, top_k=3), None, 3, True),
    # 4 children of a 3-token support: the 4th repeats the 3rd (never accepted)
    "t0.7-topk3-close-distinct-f4": (dict(temperature=0.7, top_k=3), 0.8, 4, False),
    "t0.7-topk2-unrelated-distinct": (dict(temperature=0.7, top_k=2), None, 2, False),
    "topp-minp-unrelated-distinct": (dict(temperature=1.0, top_p=0.8, min_p=0.05), None, 2,
                                     False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_draft_tree_decoding_matches_the_enumerated_target_distribution(monkeypatch, case):
    """6000 three-token continuations against the enumerated target law (chi-square,
    false alarm ALPHA = 1e-3 per case; fixed seeds, so deterministic)."""
    policy, noise, branches, replacement = CASES[case]
    watch = Watch(monkeypatch)
    target, draft = _sampling_models(noise)
    dec = SpecDecoder(target, draft, k=2 * branches, num_blocks=6000, block_size=2, seed=100,
                      draft_branches=branches, draft_replacement=replacement)
    probs = exact_continuations(target, PROMPT, policy)
    assert chi_square_pvalue(_counts(dec, 6000, policy), probs) > ALPHA
    assert watch.off_spine > 10  # siblings past the first do get accepted


def test_the_reference_ops_agree_in_law():
    policy, noise, branches, replacement = CASES["t1-close-distinct"]
    target, draft = _sampling_models(noise)
    dec = SpecDecoder(target, draft, k=4, num_blocks=6000, block_size=2, seed=100,
                      ops=reference, draft_branches=branches, draft_replacement=replacement)
    probs = exact_continuations(target, PROMPT, policy)
    assert chi_square_pvalue(_counts(dec, 6000, policy), probs) > ALPHA


def test_power_a_wrong_q_fails(monkeypatch):
    """The draft's plain softmax handed to verify_tree instead of the policy q the
    children were drawn from (T = 0.7, top-k 3): the same test rejects it."""
    real = SpecDecoder._sample_children

    def wrong_q(self, logits, policy, seed, offset):
        tokens, _ = real(self, logits, policy, seed, offset)
        return tokens, torch.softmax(logits.float(), dim=-1)

    monkeypatch.setattr(SpecDecoder, "_sample_children", wrong_q)
    policy = dict(temperature=0.7, top_k=3)
    target, draft = _sampling_models(0.8)
    dec = SpecDecoder(target, draft, k=6, num_blocks=6000, block_size=2, seed=100,
                      draft_branches=3)
    probs = exact_continuations(target, PROMPT, policy)
    assert chi_square_pvalue(_counts(dec, 6000, policy), probs) < ALPHA


def test_power_distinct_siblings_verified_as_iid_fails(monkeypatch):
    """Children drawn without replacement but verified as i.i.d. (replacement=True): the
    second sibling's test uses q where it was drawn from q without the first. Top-k 2
    and 2 siblings (the case "t0.7-topk2-unrelated-distinct" passes with the right rule):
    the second sibling is the other token for sure, which i.i.d. verification misprices."""
    real = native_ops.verify_tree

    class IidOps:
        apply_policy = staticmethod(native_ops.apply_policy)
        sample, verify = staticmethod(native_ops.sample), staticmethod(native_ops.verify)

        @staticmethod
        def verify_tree(*args, **kwargs):
            return real(*args, **{**kwargs, "replacement": True})

    policy = dict(temperature=0.7, top_k=2)
    target, draft = _sampling_models(None)
    dec = SpecDecoder(target, draft, k=4, num_blocks=6000, block_size=2, seed=100,
                      ops=IidOps(), draft_branches=2, draft_replacement=False)
    probs = exact_continuations(target, PROMPT, policy)
    assert chi_square_pvalue(_counts(dec, 6000, policy), probs) < ALPHA


def test_sampled_draft_trees_keep_target_and_draft_caches_true():
    target, draft = models(noise=0.6)
    dec = SpecDecoder(target, draft, k=6, num_blocks=64, block_size=4, seed=3,
                      draft_branches=3, draft_replacement=False)
    seqs = [dec.add(p, max_new_tokens=24, temperature=0.9) for p in PROMPTS]
    while dec.has_running():
        dec.step()
        for s in seqs:
            if dec._core.finish_reason(s) == "running":
                check_cache_truth(dec, s)
    for s in seqs:
        assert len(dec.result(s).tokens) == 24
        dec.release(s)
    assert_no_leaks(dec)


# ---- failed steps ------------------------------------------------------------------------

class WrongNodeOps:
    """verispec.ops whose verify_tree accepts node 1 (a sibling of node 0, a root child)
    with node 0's token."""
    apply_policy, sample = staticmethod(native_ops.apply_policy), staticmethod(native_ops.sample)
    verify = staticmethod(native_ops.verify)

    @staticmethod
    def verify_tree(logits, tokens, parents, q, **kw):
        out, emitted, nodes = (t.clone() for t in native_ops.verify_tree(
            logits, tokens, parents, q, **kw))
        nodes[0, 0] = 1
        emitted[0] = 2
        out[0, 0] = (int(tokens[0, 1]) + 1) % V
        out[0, 1] = 0
        return out, emitted, nodes


@pytest.mark.parametrize("fault", ["draft_pass", "verify"])
def test_a_failed_draft_tree_step_changes_nothing_and_the_run_continues(fault):
    target, draft = models()
    want = [r.tokens for r in SpecDecoder(target, draft, k=6, num_blocks=64, block_size=4,
                                          seed=5, draft_branches=3)
            .generate(PROMPTS[:3], max_new_tokens=14, temperature=1.0)]
    dec = SpecDecoder(target, draft, k=6, num_blocks=64, block_size=4, draft_branches=3)
    dec._core.reseed(5)
    seqs = [dec.add(p, max_new_tokens=14, temperature=1.0) for p in PROMPTS[:3]]
    dec.step()
    before = snapshot(dec, seqs)
    if fault == "verify":
        good, dec._ops = dec._ops, WrongNodeOps()
        with pytest.raises(ValueError, match=r"tokens\[0, 0\] is accepted node 1, so it must "
                                             r"equal its token"):
            dec.step()
        dec._ops = good
    else:
        real, calls = draft.forward, []

        def second_pass_fails(batch):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("draft failed")
            return real(batch)

        draft.forward = second_pass_fails
        with pytest.raises(RuntimeError, match="draft failed"):
            dec.step()
        draft.forward = real
    assert snapshot(dec, seqs) == before
    assert not dec._core.step_open
    while dec.has_running():
        dec.step()
    assert [dec.result(s).tokens for s in seqs] == want
    for s in seqs:
        dec.release(s)
    assert_no_leaks(dec)


# ---- arguments -----------------------------------------------------------------------------

def test_draft_tree_options_are_validated():
    target, draft = models()
    with pytest.raises(ValueError, match=r"draft_branches must be in \[1, 64\], got 0"):
        SpecDecoder(target, draft, draft_branches=0)
    with pytest.raises(ValueError, match=r"draft_branches = 2 \(draft trees\) needs a draft "
                                         r"model, got NGram\("):
        SpecDecoder(target, NGram(1, 2), draft_branches=2)
    with pytest.raises(TypeError, match="draft_replacement must be a bool, got 'no'"):
        SpecDecoder(target, draft, draft_branches=2, draft_replacement="no")
    with pytest.raises(ValueError, match="verify_method='block' verifies chains"):
        SpecDecoder(target, draft, draft_branches=2, verify_method="block")
    with pytest.raises(ValueError, match=r"draft_branches = 2 \(draft trees\) needs a draft "
                                         r"model \(has_draft_model\)"):
        _C.SpecDecoder(k=2, has_draft_model=False, target_num_blocks=4, draft_num_blocks=0,
                       block_size=4, vocab_size=5, max_context=16, seed=0, ngram_min_n=1,
                       ngram_max_n=2, draft_branches=2)
