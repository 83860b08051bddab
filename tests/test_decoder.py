"""SpecDecoder end to end on tiny models that read their context from the paged cache."""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from scipy import stats as sstats
from toymodels import CacheModel

import verispec
from verispec import _C, reference
from verispec.decoder import SpecDecoder
from verispec.drafters import NGram

V = 13


def backends():
    from verispec import ops
    return [pytest.param(ops, id="native"), pytest.param(reference, id="reference")]


OPS = backends()


def models(vocab=V, noise=0.7, max_context=256):
    target = CacheModel(vocab, seed=1, max_context=max_context)
    draft = CacheModel(vocab, base=target, noise=noise, seed=2, max_context=max_context)
    return target, draft


def greedy_reference(model: CacheModel, prompt, n, eos=None):
    seq = list(prompt)
    out = []
    for _ in range(n):
        t = int(torch.argmax(model.logits_for(seq)))
        out.append(t)
        seq.append(t)
        if eos is not None and t == eos:
            break
    return out


def assert_no_leaks(dec: SpecDecoder):
    assert not dec.has_running()
    for role in ("target", "draft") if dec.draft is not None else ("target",):
        assert dec.num_free_blocks(role) == dec.num_blocks(role)


def check_cache_truth(dec: SpecDecoder, seq: int):
    """The K/V of every cached position equal a fresh prefill of the committed tokens
    (the toy models store (token, position) as K)."""
    committed = dec._core.committed(seq)
    for role in (_C.ModelRole.target, _C.ModelRole.draft):
        n = dec._core.cache_len(seq, role)
        assert n < len(committed), "a model may never cache past the committed tokens"
        table = dec._core.block_table(seq, role)
        k = dec._pools[role].k[0].view(-1, 2)
        bs = dec._pools[role].block_size
        slots = [table[p // bs] * bs + p % bs for p in range(n)]
        got = k[slots].long().tolist() if slots else []
        assert got == [[committed[p], p] for p in range(n)], f"{role} cache differs from a prefill"


@pytest.mark.parametrize("ops", OPS)
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_equals_target_only(ops, k):
    target, draft = models()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12, 0], [7], [3, 3, 3, 3, 3]]
    dec = SpecDecoder(target, draft, k=k, num_blocks=64, block_size=4, ops=ops)
    results = dec.generate(prompts, max_new_tokens=17, greedy=True)
    for p, r in zip(prompts, results):
        assert r.tokens == greedy_reference(target, p, 17)
        assert r.finish_reason == "length"
        assert r.stats["emitted"] == 17
        assert 0 <= r.stats["accepted"] <= r.stats["proposed"]
    assert_no_leaks(dec)


@pytest.mark.parametrize("ops", OPS)
def test_plain_decoding_through_the_same_loop(ops):
    target, _ = models()
    dec = SpecDecoder(target, None, num_blocks=32, block_size=4, ops=ops)
    (r,) = dec.generate([[5, 6]], max_new_tokens=9, greedy=True)
    assert r.tokens == greedy_reference(target, [5, 6], 9)
    assert r.stats["steps"] == 9 and r.stats["proposed"] == 0
    assert_no_leaks(dec)


@pytest.mark.parametrize("ops", OPS)
def test_cache_truth_after_steps_with_rejections(ops):
    target, draft = models(noise=1.5)  # a poor draft: many rejections and rollbacks
    dec = SpecDecoder(target, draft, k=4, num_blocks=64, block_size=3, ops=ops)
    seqs = [dec.add(p, max_new_tokens=30, temperature=1.0) for p in ([1, 2], [3, 4, 5, 6, 7], [8])]
    rejected = 0
    while dec.has_running():
        dec.step()
        for s in seqs:
            if dec._core.finish_reason(s) == "running":
                check_cache_truth(dec, s)
    for s in seqs:
        st = dec.result(s).stats
        rejected += st["proposed"] - st["accepted"]
    assert rejected > 10, "the test must exercise rollbacks"
    # The check can fail: corrupt one cached position and it must notice.
    s = dec.add([1, 2, 3, 4, 5], max_new_tokens=5, greedy=True)
    dec.step()
    table = dec._core.block_table(s, _C.ModelRole.draft)
    dec._pools[_C.ModelRole.draft].k[0].view(-1, 2)[table[0] * 3 + 1, 0] += 1
    with pytest.raises(AssertionError, match="draft cache differs"):
        check_cache_truth(dec, s)


@pytest.mark.parametrize("ops", OPS)
def test_continuous_batching_matches_separate_runs(ops):
    target, draft = models()
    dec = SpecDecoder(target, draft, k=3, num_blocks=64, block_size=4, ops=ops)
    a = dec.add([1, 2, 3], max_new_tokens=12, greedy=True)
    streamed = {a: []}
    for _ in range(2):
        for o in dec.step():
            streamed[o.seq] += o.tokens
    b = dec.add([9, 8], max_new_tokens=6, greedy=True)  # joins mid-flight
    streamed[b] = []
    while dec.has_running():
        for o in dec.step():
            streamed[o.seq] += o.tokens
    assert streamed[a] == greedy_reference(target, [1, 2, 3], 12) == dec.result(a).tokens
    assert streamed[b] == greedy_reference(target, [9, 8], 6)
    assert_no_leaks(dec)


@pytest.mark.parametrize("ops", OPS)
def test_eos_mid_block_ends_there(ops):
    target, draft = models(noise=0.0)  # draft == target: whole blocks are accepted
    ref = greedy_reference(target, [1, 2, 3], 20)
    eos = ref[6]
    cut = ref.index(eos) + 1
    dec = SpecDecoder(target, draft, k=5, num_blocks=64, block_size=4, ops=ops)
    (r,) = dec.generate([[1, 2, 3]], max_new_tokens=20, greedy=True, eos_token_id=[999 % V + 100, eos])
    assert r.tokens == ref[:cut] and r.finish_reason == "eos"
    assert r.stats["emitted"] == cut
    assert_no_leaks(dec)


@pytest.mark.parametrize("ops", OPS)
def test_stop_sequence_across_step_boundary(ops):
    target, draft = models(noise=0.0)
    ref = greedy_reference(target, [4, 4], 24)
    # k = 3 with a perfect draft: steps emit 4 tokens, so tokens 7..8 straddle a step.
    stop = ref[7:9]
    first = next(i for i in range(len(ref) - 1) if ref[i:i + 2] == stop)
    dec = SpecDecoder(target, draft, k=3, num_blocks=64, block_size=4, ops=ops)
    (r,) = dec.generate([[4, 4]], max_new_tokens=24, greedy=True, stop=[[V + 5], stop])
    assert r.tokens == ref[:first + 2] and r.finish_reason == "stop"
    assert_no_leaks(dec)


@pytest.mark.parametrize("ops", OPS)
def test_max_new_tokens_smaller_than_k_is_exact(ops):
    target, draft = models(noise=0.0)
    dec = SpecDecoder(target, draft, k=6, num_blocks=64, block_size=4, ops=ops)
    res = dec.generate([[1], [2, 3]], max_new_tokens=2, greedy=True)
    for p, r in zip([[1], [2, 3]], res):
        assert r.tokens == greedy_reference(target, p, 2) and r.finish_reason == "length"
        assert r.stats["steps"] == 1 and r.stats["proposed"] == 1  # k capped at 2 - 1
    assert_no_leaks(dec)


@pytest.mark.parametrize("ops", OPS)
def test_context_limit(ops):
    target, draft = models(max_context=12)
    dec = SpecDecoder(target, draft, k=4, num_blocks=64, block_size=4, ops=ops)
    (r,) = dec.generate([list(range(10))], max_new_tokens=50, greedy=True)
    assert r.finish_reason == "context" and len(r.tokens) == 2
    assert r.tokens == greedy_reference(target, list(range(10)), 2)
    with pytest.raises(ValueError, match="prompt length must be < the context length 12, got 12"):
        dec.generate([list(range(12))], max_new_tokens=1)
    assert_no_leaks(dec)


@pytest.mark.parametrize("ops", OPS)
def test_one_row_finishes_early(ops):
    target, draft = models()
    dec = SpecDecoder(target, draft, k=3, num_blocks=64, block_size=4, ops=ops)
    res = dec.generate([[1, 2], [3, 4], [5]], max_new_tokens=10, greedy=True,
                       eos_token_id=greedy_reference(target, [3, 4], 10)[1])
    assert res[1].finish_reason == "eos" and len(res[1].tokens) <= 2
    for p, r in zip([[1, 2], [3, 4], [5]], res):
        ref = greedy_reference(target, p, 10, eos=greedy_reference(target, [3, 4], 10)[1])
        assert r.tokens == ref
    assert_no_leaks(dec)


def test_bad_input_is_refused_clearly():
    target, draft = models()
    dec = SpecDecoder(target, draft, k=3, num_blocks=16, block_size=4, ops=reference)
    with pytest.raises(ValueError, match="prompt must hold at least 1 token, got 0"):
        dec.generate([[]], max_new_tokens=3)
    with pytest.raises(ValueError, match=r"prompt\[1\] must be in \[0, 13\), got 13"):
        dec.generate([[1, 13]], max_new_tokens=3)
    with pytest.raises(ValueError, match="max_new_tokens must be > 0, got 0"):
        dec.generate([[1]], max_new_tokens=0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        dec.generate([[1]], max_new_tokens=3, top_p=1.5)
    with pytest.raises(ValueError, match="temperature must be finite and >= 0, got -1"):
        dec.generate([[1]], max_new_tokens=3, temperature=-1.0)
    with pytest.raises(TypeError, match="prompts must be a list of token-id lists"):
        dec.generate("hello", max_new_tokens=3)
    other = CacheModel(13, seed=5)
    target.tokenizer_fingerprint, other.tokenizer_fingerprint = "a" * 32, "b" * 32
    with pytest.raises(ValueError, match="the draft's tokenizer must be the target's"):
        SpecDecoder(target, other, ops=reference)
    del target.tokenizer_fingerprint
    with pytest.raises(TypeError, match="target must implement the model protocol"):
        SpecDecoder(object(), ops=reference)
    assert_no_leaks(dec)


@pytest.mark.parametrize("ops", OPS)
def test_a_full_cache_preempts_the_newest_sequence(ops):
    """Two sequences that do not fit the target's 6 blocks together: the newer one is
    preempted (blocks freed, tokens kept), waits, and recomputes its cache when the older
    one is done; both get the target's greedy output, nothing is lost or leaked."""
    target, draft = models()
    dec = SpecDecoder(target, draft, k=4, num_blocks=6, draft_num_blocks=64, block_size=4, ops=ops)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 0, 1]]
    a, b = (dec.add(p, max_new_tokens=12, greedy=True) for p in prompts)
    got = {a: [], b: []}
    waited = False
    for _ in range(80):
        if not dec.has_running():
            break
        for o in dec.step():
            got[o.seq] += o.tokens
        waited |= dec.num_waiting() > 0
    assert not dec.has_running() and waited
    # preempted once, then it waits (FIFO admission does not re-admit what cannot fit)
    assert dec.num_preemptions() == dec.result(b).stats["preemptions"] == 1
    assert dec.result(a).stats["preemptions"] == 0  # the older one is never preempted
    for s, p in zip((a, b), prompts):
        assert got[s] == greedy_reference(target, p, 12)
        assert dec.result(s).tokens == got[s] and dec.result(s).finish_reason == "length"
    assert_no_leaks(dec)


@pytest.mark.parametrize("ops", OPS)
def test_generate_returns_every_result_whatever_the_pool(ops):
    """More prompts than fit at once (two 6-token prompts x 20 new tokens in a 32-slot
    pool, and five prompts with max_num_seqs=2): every result comes back, in order, equal
    to each prompt decoded alone."""
    target, draft = models()
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]
    alone = [SpecDecoder(target, draft, k=3, num_blocks=64, block_size=4, ops=ops).generate(
        [p], max_new_tokens=20, greedy=True)[0].tokens for p in prompts]
    dec = SpecDecoder(target, draft, k=3, num_blocks=8, draft_num_blocks=64, block_size=4, ops=ops)
    assert [r.tokens for r in dec.generate(prompts, max_new_tokens=20, greedy=True)] == alone
    assert dec.num_preemptions() > 0
    assert_no_leaks(dec)
    five = [[1, 2], [3, 4, 5], [6], [7, 8, 9, 10], [11, 12, 0]]
    want = [greedy_reference(target, p, 9) for p in five]
    dec = SpecDecoder(target, NGram(1, 2), k=2, num_blocks=64, block_size=4, ops=ops,
                      max_num_seqs=2)
    dec_runs = dec.generate(five, max_new_tokens=9, greedy=True)
    assert [r.tokens for r in dec_runs] == want
    assert max(r.stats["steps"] for r in dec_runs) < sum(r.stats["steps"] for r in dec_runs)


def test_max_num_seqs_admits_in_arrival_order():
    target, draft = models()
    dec = SpecDecoder(target, draft, k=2, num_blocks=64, block_size=4, max_num_seqs=2)
    ids = [dec.add([i + 1, i + 2], max_new_tokens=3, greedy=True) for i in range(4)]
    assert dec.num_waiting() == 4 and dec.has_running()
    rows = {o.seq for o in dec.step()}
    assert rows == set(ids[:2]) and dec.num_waiting() == 2
    while dec.has_running():
        dec.step()
    assert all(dec.result(i).finish_reason == "length" for i in ids)
    with pytest.raises(ValueError, match=r"max_num_seqs must be >= 0 \(0: no limit\), got -1"):
        SpecDecoder(target, draft, max_num_seqs=-1)


def test_priority_orders_the_queue_and_picks_who_is_preempted():
    """max_num_seqs=2: four waiting sequences run higher priority first, FIFO within a
    priority; a later arrival of higher priority takes the place of the running one of
    the lowest priority (preempted: blocks freed, tokens kept); every result equals the
    prompt decoded alone."""
    target, draft = models()
    dec = SpecDecoder(target, draft, k=2, num_blocks=64, block_size=4, max_num_seqs=2)
    prompts = [[1, 2], [3, 4], [5, 6], [7, 8]]
    low, mid, high, mid2 = (dec.add(p, max_new_tokens=6, greedy=True, priority=q)
                            for p, q in zip(prompts, (-1, 0, 5, 0)))
    assert {o.seq for o in dec.step()} == {high, mid}
    dec.step()
    urgent = dec.add([9, 10], max_new_tokens=6, greedy=True, priority=9)
    rows = {o.seq for o in dec.step()}
    assert rows == {urgent, high}  # mid (lowest running, priority 0) made room
    assert dec.result(mid).stats["preemptions"] == 1 and dec.num_preemptions() == 1
    order = []
    while dec.has_running():
        for o in dec.step():
            if o.finish_reason is not None:
                order.append(o.seq)
    assert order.index(mid) < order.index(low) and order.index(mid2) < order.index(low)
    assert dec.result(high).stats["preemptions"] == 0
    for seq, p in zip((low, mid, high, mid2, urgent), prompts + [[9, 10]]):
        assert dec.result(seq).tokens == greedy_reference(target, p, 6)
    assert_no_leaks(dec)
    for bad, err in ((1.5, TypeError), (True, TypeError), (1 << 63, ValueError)):
        with pytest.raises(err, match="add: priority must be"):
            dec.add([1], max_new_tokens=1, priority=bad)


def test_add_takes_any_top_k_the_policy_rule_takes():
    """top_k past int32: off, like any k of the vocabulary's size or more (the same tokens as
    top_k=0 for the same seed); below it, the rule's error with the value as given."""
    target, draft = models()
    outs = []
    for k in (0, 2**31, 10**30):
        dec = SpecDecoder(target, draft, k=2, num_blocks=64, block_size=4)
        seq = dec.add([1, 2, 3], max_new_tokens=8, temperature=1.0, top_k=k, seed=5)
        while dec.has_running():
            dec.step()
        outs.append(dec.result(seq).tokens)
    assert outs[0] == outs[1] == outs[2] and len(outs[0]) == 8
    dec = SpecDecoder(target, draft, k=2, num_blocks=64, block_size=4)
    for bad in (-2, -2**31 - 1, -10**30):
        with pytest.raises(ValueError, match=rf"add: top_k must be .*{bad}"):
            dec.add([1], max_new_tokens=1, top_k=bad)


@pytest.mark.parametrize("ops", OPS)
def test_a_full_cache_preempts_the_lowest_priority(ops):
    """Blocks run out: the running sequence of the lowest priority is preempted, even the
    older one; both still get the target's greedy output."""
    target, draft = models()
    dec = SpecDecoder(target, draft, k=4, num_blocks=6, draft_num_blocks=64, block_size=4, ops=ops)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 0, 1]]
    old = dec.add(prompts[0], max_new_tokens=12, greedy=True, priority=-3)
    dec.step()  # the old one runs alone first
    new = dec.add(prompts[1], max_new_tokens=12, greedy=True)
    while dec.has_running():
        dec.step()
    assert dec.result(old).stats["preemptions"] >= 1
    assert dec.result(new).stats["preemptions"] == 0
    for s, p in zip((old, new), prompts):
        assert dec.result(s).tokens == greedy_reference(target, p, 12)
    assert_no_leaks(dec)


@pytest.mark.parametrize("ops", OPS)
def test_one_sequence_that_cannot_fit_raises_and_changes_nothing(ops):
    target, draft = models()
    dec = SpecDecoder(target, draft, k=4, num_blocks=6, draft_num_blocks=64, block_size=4, ops=ops)
    a = dec.add([1, 2, 3, 4, 5, 6, 7], max_new_tokens=40, greedy=True)
    got = []
    with pytest.raises(verispec.CacheFullError):
        for _ in range(40):
            before = (dec._core.committed(a), dec._core.cache_len(a, _C.ModelRole.target),
                      dec._core.cache_len(a, _C.ModelRole.draft))
            free = (dec.num_free_blocks("target"), dec.num_free_blocks("draft"))
            for o in dec.step():
                got += o.tokens
    # the failed step changed nothing
    assert (dec._core.committed(a), dec._core.cache_len(a, _C.ModelRole.target),
            dec._core.cache_len(a, _C.ModelRole.draft)) == before
    assert (dec.num_free_blocks("target"), dec.num_free_blocks("draft")) == free
    assert got == greedy_reference(target, [1, 2, 3, 4, 5, 6, 7], len(got)) and len(got) > 0
    dec.abort(a)
    assert dec.result(a).finish_reason == "aborted"
    assert_no_leaks(dec)


@pytest.mark.parametrize("ops", OPS)
def test_sampling_is_reproducible_for_a_seed(ops):
    target, draft = models()
    dec = SpecDecoder(target, draft, k=3, num_blocks=64, block_size=4, ops=ops)
    kw = dict(max_new_tokens=15, temperature=0.8, top_k=6, seed=11)
    first = [r.tokens for r in dec.generate([[1, 2], [3]], **kw)]
    again = [r.tokens for r in dec.generate([[1, 2], [3]], **kw)]
    other = [r.tokens for r in dec.generate([[1, 2], [3]], **{**kw, "seed": 12})]
    assert first == again and first != other


# ---- sampled exactness end to end ----------------------------------------------------

SV = 5          # vocabulary of the exactness test
DEPTH = 3       # compare 3-token continuations
ALPHA = 1e-3    # false-alarm rate of each chi-square test (fixed seeds: deterministic)


def exact_continuations(target: CacheModel, prompt, policy) -> dict:
    probs = {}
    for cont in itertools.product(range(SV), repeat=DEPTH):
        p, seq = 1.0, list(prompt)
        for t in cont:
            dist = reference.apply_policy(target.logits_for(seq)[None], **policy)[0]
            p *= float(dist[t])
            seq.append(t)
        probs[cont] = p
    return probs


def sampled_continuations(dec: SpecDecoder, prompt, n, policy, seed, stream="decoder") -> dict:
    """Counts of n sampled continuations: from the decoder's stream (dec built with its
    own seed; each generate call continues it) or keyed (request seeds from seed + call)."""
    counts: dict = {}
    per_call = 1000
    for call in range(n // per_call):
        request = seed + call if stream == "keyed" else None
        for r in dec.generate([prompt] * per_call, max_new_tokens=DEPTH, seed=request, **policy):
            counts[tuple(r.tokens)] = counts.get(tuple(r.tokens), 0) + 1
    return counts


def chi_square_pvalue(counts: dict, probs: dict) -> float:
    n = sum(counts.values())
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for cont, p in probs.items():
        if n * p < 5:  # pool small cells
            pool_o += counts.get(cont, 0)
            pool_e += n * p
        else:
            obs.append(counts.get(cont, 0))
            exp.append(n * p)
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    assert sum(counts.get(c, 0) for c in probs) == n, "a continuation outside the support"
    total = sum(exp)  # float32 policy probabilities: renormalise the roundoff away
    return float(sstats.chisquare(obs, [e * n / total for e in exp]).pvalue)


@pytest.mark.parametrize("policy", [dict(temperature=1.0), dict(temperature=0.7, top_k=3),
                                    dict(temperature=1.0, top_p=0.8, min_p=0.05)],
                         ids=["t1", "t0.7-topk3", "topp-minp"])
@pytest.mark.parametrize("source", ["model", "ngram"])
@pytest.mark.parametrize("stream", ["decoder", "keyed"])
def test_generate_matches_the_enumerated_target_distribution(policy, source, stream):
    """Both random streams: the decoder's (verify's rule) and per-request seeds (the
    keyed rule, ops.verify_keyed)."""
    ops = OPS[0].values[0]
    target = CacheModel(SV, seed=3, table_rows=53, scale=1.5)
    if source == "model":
        draft = CacheModel(SV, seed=4, table_rows=53, scale=1.5)  # unrelated: many rejections
    else:
        draft = NGram(1, 2)  # the prompt [1, 2] and generated tokens feed the lookup
    dec = SpecDecoder(target, draft, k=2, num_blocks=3000, block_size=2, ops=ops, seed=100)
    probs = exact_continuations(target, [1, 2], policy)
    counts = sampled_continuations(dec, [1, 2], 8000, policy, seed=100, stream=stream)
    assert chi_square_pvalue(counts, probs) > ALPHA


def test_end_to_end_test_has_power(monkeypatch):
    """The same test rejects a decoder that keeps the wrong q: the draft's plain softmax
    instead of the policy distribution its proposals were sampled from.

    (Verifying sampled drafts as one-hot, or feeding the draft a stale cache, would
    NOT be caught, and rightly: both still give exactly the target distribution. The
    one-hot rule is exact for any proposal, and q only has to be what y was drawn from.)
    """
    ops = OPS[0].values[0]
    policy = dict(temperature=0.7, top_k=3)
    target = CacheModel(SV, seed=3, table_rows=53, scale=1.5)
    draft = CacheModel(SV, seed=4, table_rows=53, scale=1.5)
    dec = SpecDecoder(target, draft, k=2, num_blocks=3000, block_size=2, ops=ops)
    real_sample_draft = SpecDecoder._sample_draft

    def wrong_q(self, logits, pol, seed, offset):
        tokens, _ = real_sample_draft(self, logits, pol, seed, offset)
        return tokens, torch.softmax(logits.float(), dim=-1)

    monkeypatch.setattr(SpecDecoder, "_sample_draft", wrong_q)
    probs = exact_continuations(target, [1, 2], policy)
    counts = sampled_continuations(dec, [1, 2], 8000, policy, seed=100)
    assert chi_square_pvalue(counts, probs) < ALPHA


def test_end_to_end_test_has_power_on_keyed_requests(monkeypatch):
    """The keyed rule ignores q (every emitted token is the target's keyed sample), so a
    wrong q cannot break it; a keyed verify that accepts every proposal can, and the
    same test catches it."""
    from verispec import ops as native

    policy = dict(temperature=0.7, top_k=3)
    target = CacheModel(SV, seed=3, table_rows=53, scale=1.5)
    draft = CacheModel(SV, seed=4, table_rows=53, scale=1.5)

    def accept_all(target_logits, draft_tokens, *, num_draft, **kwargs):
        tokens, _, _ = native.verify_keyed(target_logits, draft_tokens, num_draft=num_draft,
                                           **kwargs)
        n = num_draft.long()
        steps = torch.arange(tokens.shape[1])
        padded = torch.cat([draft_tokens, draft_tokens[:, :1]], dim=1)
        out = torch.where(steps < n[:, None], padded, tokens[:, :1])  # any valid bonus
        out = torch.where(steps <= n[:, None], out, -1)
        return out.int(), (n + 1).int(), n.int()

    class WrongOps:
        apply_policy, sample = staticmethod(native.apply_policy), staticmethod(native.sample)
        verify, verify_keyed = staticmethod(native.verify), staticmethod(accept_all)

    dec = SpecDecoder(target, draft, k=2, num_blocks=3000, block_size=2, ops=WrongOps())
    probs = exact_continuations(target, [1, 2], policy)
    counts = sampled_continuations(dec, [1, 2], 8000, policy, seed=100, stream="keyed")
    assert chi_square_pvalue(counts, probs) < ALPHA


@pytest.mark.parametrize("ops", OPS)
@pytest.mark.parametrize("draft_vocab", [7, 20])
def test_draft_with_another_vocabulary_size(ops, draft_vocab):
    """A draft whose (padded or smaller) vocabulary differs from the target's 13 ids:
    greedy output is still the target's own, a smaller draft never proposes past its
    size and a larger one never past the target's (the core would refuse the ids)."""
    target = CacheModel(13)
    draft = CacheModel(draft_vocab, seed=3)
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 1, 2]]
    want = SpecDecoder(target, k=0, num_blocks=32, block_size=4, ops=ops).generate(
        prompts, max_new_tokens=12, greedy=True)
    dec = SpecDecoder(target, draft, k=3, num_blocks=32, block_size=4, ops=ops)
    got = dec.generate(prompts, max_new_tokens=12, greedy=True)
    assert [r.tokens for r in got] == [r.tokens for r in want]
    sampled = dec.generate(prompts, max_new_tokens=12, temperature=1.0, seed=4)
    assert all(0 <= t < 13 for r in sampled for t in r.tokens)
    assert sum(r.stats["proposed"] for r in sampled) > 0


# ---- the token budget and chunked prefill -------------------------------------------

class Recording:
    """Wraps a model: the token count of every forward, and its logits rows."""

    def __init__(self, model):
        self.model, self.geometry = model, model.geometry
        self.tokens: list[int] = []

    def forward(self, batch):
        self.tokens.append(int(batch.input_ids.shape[0]))
        return self.model.forward(batch)

    def logits_for(self, prefix):
        return self.model.logits_for(prefix)


@pytest.mark.parametrize("source", ["model", "ngram", "auto"])
def test_generate_goes_through_the_queue_under_a_small_budget_and_pool(source):
    """20 prompts, a pool far too small for all of them and a budget of 5 tokens a step:
    every result comes back in order, equal to the prompt decoded alone; long prompts were
    prefilled in chunks, sequences were preempted, no block leaks."""
    target, draft = models()
    prompts = [[(3 * i + j) % V for j in range(1 + (7 * i) % 17)] for i in range(20)]
    want = [greedy_reference(target, p, 8) for p in prompts]
    drafter = NGram(1, 3) if source == "ngram" else draft
    dec = SpecDecoder(Recording(target), drafter, k="auto" if source == "auto" else 3,
                      num_blocks=7, draft_num_blocks=7, block_size=4, max_tokens_per_step=5)
    results = dec.generate(prompts, max_new_tokens=8, greedy=True)
    assert [r.tokens for r in results] == want
    assert all(r.finish_reason == "length" for r in results)
    assert max(dec.target.tokens) <= 5
    assert sum(r.stats["prefill_chunks"] for r in results) > 0
    assert dec.num_preemptions() > 0
    assert_no_leaks(dec)


def test_a_long_prompt_is_prefilled_in_chunks_while_the_others_decode():
    """A 60-token prompt arrives while two sequences decode: with a budget of 8 tokens it
    is prefilled in chunks and the others emit a token at every step; without a budget
    (the power check) its whole prompt goes through one pass of 60+ tokens."""
    target, draft = models()
    for budget in (8, 0):
        rec = Recording(target)
        dec = SpecDecoder(rec, draft, k=2, num_blocks=64, block_size=4, max_tokens_per_step=budget)
        a, b = dec.add([1, 2, 3], max_new_tokens=40, greedy=True), dec.add([4, 5], max_new_tokens=40,
                                                                             greedy=True)
        while len(dec.result(a).tokens) < 3 or len(dec.result(b).tokens) < 3:
            dec.step()
        long = [(5 * i + 1) % V for i in range(60)]
        c = dec.add(long, max_new_tokens=5, greedy=True)
        stalled = 0
        while not dec.result(c).tokens:
            emitted = {o.seq for o in dec.step() if o.tokens}
            stalled += not {a, b} <= emitted and dec.result(a).finish_reason is None
        while dec.has_running():
            dec.step()
        assert dec.result(c).tokens == greedy_reference(target, long, 5)
        for s, p in ((a, [1, 2, 3]), (b, [4, 5])):
            assert dec.result(s).tokens == greedy_reference(target, p, 40)
        chunks = dec.result(c).stats["prefill_chunks"]
        if budget:
            assert max(rec.tokens) <= budget and stalled == 0 and chunks >= 60 // budget
        else:
            assert max(rec.tokens) >= 60 and chunks == 0
        assert_no_leaks(dec)


def test_max_tokens_per_step_is_validated():
    target, draft = models()
    with pytest.raises(ValueError, match=r"max_tokens_per_step must be 0 \(no limit\) or >= 1, "
                                         r"got -1"):
        SpecDecoder(target, draft, max_tokens_per_step=-1)
    for bad in (2.5, True, "8"):
        with pytest.raises(ValueError, match=r"max_tokens_per_step must be an int, got "
                                             + repr(bad).replace(".", r"\.")):
            SpecDecoder(target, draft, max_tokens_per_step=bad)
    with pytest.raises(ValueError, match=r"max_tokens_per_step must be 0 \(no limit\) or >= 1, got -3"):
        _C.SpecDecoder(k=2, has_draft_model=True, target_num_blocks=8, draft_num_blocks=8,
                       block_size=4, vocab_size=V, max_context=64, seed=0, max_tokens_per_step=-3)


# SpecDecoder's integer settings: the types are Python's, the ranges the core's
# (spec_decoder.cpp), checked once. Each message names the setting, what it must be and
# the value as given (ints past int64 included), for a draft model, an n-gram drafter
# and no draft (plain decoding still checks the k it was given).
CONFIG_ERRORS = [
    (dict(k=-1), "k must be in [0, 64], got -1"),
    (dict(k=65), "k must be in [0, 64], got 65"),
    (dict(k=10**30), f"k must be in [0, 64], got {10**30}"),
    (dict(k="fast"), "k must be an int or 'auto', got 'fast'"),
    (dict(k=2.0), "k must be an int or 'auto', got 2.0"),
    (dict(k=True), "k must be an int or 'auto', got True"),
    (dict(k="auto", max_k=65), "max_k must be an int in [1, 64], got 65"),
    (dict(max_num_seqs=-1), "max_num_seqs must be >= 0 (0: no limit), got -1"),
    (dict(max_num_seqs=-10**30), f"max_num_seqs must be >= 0 (0: no limit), got {-10**30}"),
    (dict(max_num_seqs=1.0), "max_num_seqs must be an int, got 1.0"),
    (dict(max_num_seqs=None), "max_num_seqs must be an int, got None"),
    (dict(max_tokens_per_step=-1), "max_tokens_per_step must be 0 (no limit) or >= 1, got -1"),
    (dict(max_tokens_per_step=False), "max_tokens_per_step must be an int, got False"),
    (dict(draft_branches=0), "draft_branches must be in [1, 64], got 0"),
    (dict(draft_branches="2"), "draft_branches must be an int, got '2'"),
]


@pytest.mark.parametrize("kwargs, message", CONFIG_ERRORS)
@pytest.mark.parametrize("drafter", ["model", "ngram", "none"])
def test_decoder_settings_are_checked_once_naming_the_value(kwargs, message, drafter):
    target, draft = models()
    draft = {"model": draft, "ngram": NGram(1, 3), "none": None}[drafter]
    with pytest.raises(ValueError, match="^" + re.escape("SpecDecoder: " + message) + "$"):
        SpecDecoder(target, draft, **kwargs)


def test_decoder_settings_at_their_bounds_are_taken():
    target, draft = models()
    for drafter in (draft, NGram(1, 3), None):
        for kwargs in (dict(k=0), dict(k=64), dict(k="auto", max_k=1), dict(k="auto", max_k=64),
                       dict(max_num_seqs=0), dict(max_num_seqs=10**30),
                       dict(max_tokens_per_step=0), dict(max_tokens_per_step=1)):
            dec = SpecDecoder(target, drafter, **kwargs)
            plain = drafter is None
            # the default k is "auto": up to max_k (default 8), adaptively
            k = kwargs.get("k", "auto")
            assert dec.k == (0 if plain else kwargs.get("max_k", 8) if k == "auto" else k), kwargs
            assert dec.adaptive == (k == "auto" and not plain)
    # the range is the core's own rule, and the decoder's message is its message
    with pytest.raises(ValueError, match=re.escape("SpecDecoder: k must be in [0, 64], got 65")):
        _C.SpecDecoder(k=65, has_draft_model=True, target_num_blocks=8, draft_num_blocks=8,
                       block_size=4, vocab_size=V, max_context=64, seed=0)


def test_a_budget_of_one_token_still_decodes_everything():
    """The smallest budget: one sequence runs at a time, k is 0 (a decoding row's one
    token), prompts go one token per step; nothing deadlocks."""
    target, draft = models()
    dec = SpecDecoder(target, draft, k=4, num_blocks=64, block_size=4, max_tokens_per_step=1)
    prompts = [[1, 2, 3, 4], [5], [6, 7]]
    results = dec.generate(prompts, max_new_tokens=4, greedy=True)
    assert [r.tokens for r in results] == [greedy_reference(target, p, 4) for p in prompts]
    assert all(set(r.stats["k_history"]) == {0} for r in results)
    assert results[0].stats["prefill_chunks"] == 3
    assert_no_leaks(dec)


def test_a_bfloat16_draft_for_a_float32_target_is_legitimate():
    """The decoder checks the draft's device, not its dtype: q is computed in float32
    whatever the draft's logits are, and each model has its own pools of its own dtype."""
    target = CacheModel(V, seed=1)
    draft = CacheModel(V, base=target, noise=0.7, seed=2, dtype=torch.bfloat16)
    dec = SpecDecoder(target, draft, k=3, num_blocks=64, block_size=4)
    (r,) = dec.generate([[1, 2, 3]], max_new_tokens=12, greedy=True)
    assert r.tokens == greedy_reference(target, [1, 2, 3], 12) and r.stats["proposed"] > 0
    assert dec._pools[_C.ModelRole.draft].k[0].dtype == torch.bfloat16


def test_a_failed_step_with_a_prefill_chunk_changes_nothing():
    """A forward that fails in a step with a prefill row (and in a step of chunks only):
    the prefilling sequence's cache is back at its mark, the decoding one is untouched, and
    the next steps give the target's greedy output."""
    target, draft = models()

    class Failing(Recording):
        fail_at: set = set()

        def forward(self, batch):
            if len(self.tokens) in self.fail_at:
                self.tokens.append(-1)
                raise RuntimeError("forward failed")
            return super().forward(batch)

    for fail_at in ({3, 4}, {0, 1}):  # a chunk next to a verify row; a chunk alone
        rec = Failing(target)
        rec.fail_at = set(fail_at)
        dec = SpecDecoder(rec, draft, k=2, num_blocks=64, block_size=4, max_tokens_per_step=4)
        long = [(3 * i + 2) % V for i in range(14)]
        if fail_at == {3, 4}:  # a decodes, then b's chunks ride next to it
            a = dec.add([1, 2], max_new_tokens=12, greedy=True)
            while len(dec.result(a).tokens) < 2:
                dec.step()
            b = dec.add(long, max_new_tokens=6, greedy=True)
        else:  # b first: its first chunks fill whole steps, with no verify row
            b = dec.add(long, max_new_tokens=6, greedy=True)
            a = dec.add([1, 2], max_new_tokens=12, greedy=True)
        failures = 0
        while dec.has_running():
            before = [(dec._core.committed(s), dec._core.cache_len(s, _C.ModelRole.target),
                       dec._core.cache_len(s, _C.ModelRole.draft)) for s in (a, b)]
            try:
                dec.step()
            except RuntimeError as e:
                assert "forward failed" in str(e)
                failures += 1
                after = [(dec._core.committed(s), dec._core.cache_len(s, _C.ModelRole.target),
                          dec._core.cache_len(s, _C.ModelRole.draft)) for s in (a, b)]
                assert after == before
        assert failures == 2
        assert dec.result(b).stats["prefill_chunks"] >= 3
        assert dec.result(a).tokens == greedy_reference(target, [1, 2], 12)
        assert dec.result(b).tokens == greedy_reference(target, long, 6)
        assert_no_leaks(dec)
