"""Logprobs: each emitted token's log-probability under the target, whatever its origin.

A TokenLogprob carries the token's log-probability under the policy-applied target
distribution it was sampled from, under the raw distribution (log-softmax of the
logits), and the top-n alternatives. Checked against the toy target's own logits and
verispec.reference.apply_policy, for accepted drafts, corrections and bonus tokens alike
(n-gram drafts, a draft model, plain decoding), and against plain decoding's report of
the same tokens. SmolLM2 against transformers is in tests/test_hf_decode.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from toymodels import CacheModel

from verispec import reference
from verispec.decoder import MAX_TOP_LOGPROBS, SpecDecoder
from verispec.drafters import NGram
from test_decoder import OPS

V = 13
PROMPTS = [[1, 2, 3, 4, 1, 2, 3, 4, 1], [5, 6, 7], [8, 9, 8, 9, 8]]
POLICIES = [dict(greedy=True), dict(temperature=0.8, top_k=5), dict(temperature=1.2, top_p=0.8),
            dict(temperature=0.9, min_p=0.1)]
TOL = 1e-5  # float32 log-softmax / log of the policy's probabilities


def _models():
    target = CacheModel(V, seed=1)
    return target, CacheModel(V, base=target, noise=0.7, seed=2)


def _expected(target, prompt, token, policy):
    """(policy-applied logprob, raw logprob, raw log-softmax row) of `token` after `prompt`."""
    logits = target.logits_for(prompt)
    raw = torch.log_softmax(logits.double(), -1)
    temperature = 0.0 if policy.get("greedy") else policy.get("temperature", 1.0)
    applied = reference.apply_policy(logits[None], temperature=temperature,
                                     top_k=policy.get("top_k", 0), top_p=policy.get("top_p", 1.0),
                                     min_p=policy.get("min_p", 0.0))[0]
    return torch.log(applied.double()), raw


def _check(target, prompt, result, policy, n):
    assert result.logprobs is not None and len(result.logprobs) == len(result.tokens)
    seq = list(prompt)
    for token, lp in zip(result.tokens, result.logprobs):
        applied, raw = _expected(target, seq, token, policy)
        assert lp.token == token
        assert abs(lp.raw_logprob - raw[token].item()) <= TOL
        want = applied[token].item()
        assert want > -math.inf, "a sampled token must have positive probability"
        assert abs(lp.logprob - want) <= TOL
        assert len(lp.top) == n
        order = raw.argsort(descending=True)[:n].tolist()
        assert [t for t, _, _ in lp.top] == order
        for t, a, r in lp.top:
            assert abs(r - raw[t].item()) <= TOL
            assert (a == -math.inf) == (applied[t].item() == -math.inf)
            if a > -math.inf:
                assert abs(a - applied[t].item()) <= TOL
        seq.append(token)


@pytest.mark.parametrize("ops", OPS)
@pytest.mark.parametrize("source", ["plain", "ngram", "model"])
@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_logprobs_are_the_targets(ops, source, policy):
    target, draft = _models()
    drafts = {"plain": (None, 0), "ngram": (NGram(1, 3), 3), "model": (draft, 3)}
    d, k = drafts[source]
    dec = SpecDecoder(target, d, k=k, num_blocks=64, block_size=4, ops=ops)
    results = dec.generate(PROMPTS, max_new_tokens=14, seed=3, logprobs=3, **policy)
    for prompt, r in zip(PROMPTS, results):
        _check(target, prompt, r, policy, 3)
    proposed = sum(r.stats["proposed"] for r in results)
    accepted = sum(r.stats["accepted"] for r in results)
    if source == "model":  # accepted drafts, corrections and bonus tokens all took part
        assert 0 < accepted < proposed
    elif source == "ngram":  # drafts were verified (and, on this hashed toy, rejected)
        assert proposed > 0


def test_speculative_logprobs_equal_plain_decodings():
    """Greedy: the same tokens, and the same logprobs, as plain decoding reports them."""
    target, draft = _models()
    want = SpecDecoder(target, None, num_blocks=64, block_size=4).generate(
        PROMPTS, max_new_tokens=14, greedy=True, logprobs=2)
    for d in (NGram(1, 3), draft):
        got = SpecDecoder(target, d, k=4, num_blocks=64, block_size=4).generate(
            PROMPTS, max_new_tokens=14, greedy=True, logprobs=2)
        for a, b in zip(got, want):
            assert a.tokens == b.tokens
            assert [(x.token, x.raw_logprob, x.top) for x in a.logprobs] == \
                [(x.token, x.raw_logprob, x.top) for x in b.logprobs]


def test_streaming_logprobs_and_requests_that_did_not_ask():
    """step() hands each committed token's logprob with it; a sequence that did not ask
    gets None; top-n differs per request within one step; release forgets them."""
    target, draft = _models()
    dec = SpecDecoder(target, draft, k=3, num_blocks=64, block_size=4)
    a = dec.add(PROMPTS[0], max_new_tokens=10, temperature=0.7, logprobs=0)
    b = dec.add(PROMPTS[1], max_new_tokens=10, temperature=0.7)
    c = dec.add(PROMPTS[2], max_new_tokens=10, temperature=0.7, logprobs=MAX_TOP_LOGPROBS)
    streamed = {a: [], c: []}
    while dec.has_running():
        for out in dec.step():
            if out.seq == b:
                assert out.logprobs is None
            else:
                assert len(out.logprobs) == len(out.tokens)
                streamed[out.seq] += out.logprobs
    assert dec.result(b).logprobs is None
    for seq, n in ((a, 0), (c, min(MAX_TOP_LOGPROBS, V))):
        r = dec.result(seq)
        assert r.logprobs == streamed[seq]
        assert all(len(x.top) == n for x in r.logprobs)  # at most the vocabulary's V ids
    dec.release(a)
    again = dec.add(PROMPTS[0], max_new_tokens=2)  # the id is reused: no stale logprobs
    assert again == a and dec.result(again).logprobs is None


def test_bad_logprobs_requests():
    target, _ = _models()
    dec = SpecDecoder(target, num_blocks=16, block_size=4)
    with pytest.raises(ValueError, match=rf"logprobs must be in \[0, {MAX_TOP_LOGPROBS}\], got 21"):
        dec.add([1], max_new_tokens=2, logprobs=21)
    with pytest.raises(ValueError, match="logprobs must be in"):
        dec.generate([[1]], max_new_tokens=2, logprobs=-1)
    for bad in (True, 1.5, "2"):
        with pytest.raises(TypeError, match="logprobs must be an int or None"):
            dec.add([1], max_new_tokens=2, logprobs=bad)
    assert not dec.has_running()
