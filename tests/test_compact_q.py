"""Compact q: a draft over a subset of the vocabulary keeps its probabilities over that
subset ([.., W]) and verification reads them through ``draft_index`` (q = 0 outside).
Every result must be bit for bit the full q's (the compact rows scattered, zeros
elsewhere): the ops (CPU here; the CUDA kernels in csrc/tests/test_cuda_sim_kernels.cpp
under the simulator), the reference, and SpecDecoder with an EAGLE-3 head end to end.
"""

import pytest
import torch

from verispec import ops, reference
from verispec.decoder import SpecDecoder
from verispec.drafters import DraftSpec, Eagle3

from test_eagle3 import VOCAB, _prompts, random_head, tiny  # noqa: F401 (fixture)

POLICIES = [dict(temperature=1.0), dict(temperature=0.7, top_k=8),
            dict(temperature=1.2, top_k=20, top_p=0.9, min_p=0.05), dict(temperature=0.0)]


def _case(B, K, V, keep, seed):
    """(target logits [B, K+1, V], drafts [B, K], full q [B, K, V] zero outside `keep`,
    compact q [B, K, W], draft_index [V])."""
    g = torch.Generator().manual_seed(seed)
    logits = 2 * torch.randn(B, K + 1, V, generator=g)
    noisy = logits[:, :K] + 0.5 * torch.randn(B, K, V, generator=g)
    inside = torch.zeros(V, dtype=torch.bool)
    inside[keep] = True
    full = torch.softmax(noisy.masked_fill(~inside, float("-inf")), dim=-1)
    drafts = torch.multinomial(full.view(-1, V), 1, generator=g).view(B, K).int()
    index = torch.full((V,), -1, dtype=torch.int32)
    index[keep] = torch.arange(len(keep), dtype=torch.int32)
    return logits, drafts, full, full[..., keep].contiguous(), index


@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.parametrize("V", [40, 300])
def test_verify_reads_a_compact_q_as_the_full_one(method, V):
    keep = torch.tensor([x for x in range(V) if x % 3 != 1 and x < V - 2])
    rows = rejected = 0
    for seed in range(3):
        logits, drafts, full, compact, index = _case(8, 3, V, keep, seed)
        num_draft = torch.tensor([3, 0, 2, 3, 1, 3, 3, 2])
        for policy in POLICIES:
            args = dict(num_draft=num_draft, seed=seed, offset=5, method=method, **policy)
            want = ops.verify(logits, drafts, full, **args)
            got = ops.verify(logits, drafts, compact, draft_index=index, **args)
            ref = reference.verify(logits, drafts, compact, draft_index=index, **args)
            ref_full = reference.verify(logits, drafts, full, **args)
            for a, b, r, rf in zip(want, got, ref, ref_full):
                assert torch.equal(a, b)
                assert torch.equal(r, rf)
            rows += len(num_draft)
            rejected += int((want[2] < num_draft).sum())
    assert 0 < rejected < rows  # both paths ran: rejections (the residual) and bonuses


@pytest.mark.parametrize("replacement", [True, False])
def test_verify_tree_reads_a_compact_q_as_the_full_one(replacement):
    V, N, B = 60, 6, 6
    keep = torch.arange(0, V, 2)
    g = torch.Generator().manual_seed(11)
    logits = 2 * torch.randn(B, N + 1, V, generator=g)
    inside = torch.zeros(V, dtype=torch.bool)
    inside[keep] = True
    full = torch.softmax((logits + 0.5 * torch.randn(B, N + 1, V, generator=g))
                         .masked_fill(~inside, float("-inf")), dim=-1)
    parents = torch.tensor([[-1, -1, 0, 0, 1, 1]] * B, dtype=torch.int32)
    tokens = torch.zeros(B, N, dtype=torch.int32)
    for b in range(B):
        for i in range(0, N, 2):
            row = full[b, int(parents[b, i]) + 1]
            tokens[b, i:i + 2] = torch.multinomial(row, 2, replacement=False, generator=g)
    index = torch.full((V,), -1, dtype=torch.int32)
    index[keep] = torch.arange(len(keep), dtype=torch.int32)
    compact = full[..., keep].contiguous()
    deep = 0
    for policy in POLICIES:
        args = dict(replacement=replacement, seed=3, offset=1, **policy)
        want = ops.verify_tree(logits, tokens, parents, full, **args)
        got = ops.verify_tree(logits, tokens, parents, compact, draft_index=index, **args)
        ref = reference.verify_tree(logits, tokens, parents, compact, draft_index=index, **args)
        ref_full = reference.verify_tree(logits, tokens, parents, full, **args)
        for a, b, r, rf in zip(want, got, ref, ref_full):
            assert torch.equal(a, b)
            assert torch.equal(r, rf)
        deep += int((want[1] > 1).sum())
    assert deep > 0


def test_compact_q_arguments_are_checked():
    logits, drafts, full, compact, index = _case(2, 2, 30, torch.arange(0, 30, 3), 0)
    with pytest.raises(ValueError, match=r"draft_index must be an integer tensor \[V\] = \[30\]"):
        ops.verify(logits, drafts, compact, draft_index=index[:-1])
    with pytest.raises(ValueError, match="draft_index needs draft_probs"):
        ops.verify(logits, drafts, None, draft_index=index)
    with pytest.raises(ValueError, match=r"draft_probs must be float \[B, K, W\]"):
        ops.verify(logits, drafts, compact[:1], draft_index=index)
    # an index past the row reads as an invalid probability, where it is read
    bad = index.clone()
    bad[int(drafts[0, 0])] = compact.shape[-1]
    with pytest.raises(ValueError, match="draft_probs"):
        ops.verify(logits, drafts, compact, draft_index=bad)


def test_draft_spec_checks_its_draft_vocab():
    with pytest.raises(ValueError, match="draft_vocab must be"):
        DraftSpec(kind="model", model=object(), draft_vocab=torch.tensor([3, 2]))
    assert DraftSpec(kind="model", model=object(), draft_vocab=[1, 4]).draft_vocab.tolist() == [1, 4]


@pytest.mark.parametrize("shape", ["chain", "tree", "block"])
def test_spec_decoder_tokens_are_the_full_q_tokens(tiny, shape):  # noqa: F811
    target, heads = tiny
    kw = dict(k=3, num_blocks=256)
    if shape == "tree":
        kw.update(draft_branches=2)
    if shape == "block":
        kw.update(verify_method="block")
    prompts = _prompts(6, seed=9)
    runs = {}
    for compact in (True, False):
        dec = SpecDecoder(target, Eagle3(target, heads["speculators"]), compact_q=compact,
                          seed=5, **kw)
        runs[compact] = (dec.generate(prompts, max_new_tokens=24, temperature=1.0, top_k=30),
                         dec)
    (on, dec_on), (off, dec_off) = runs[True], runs[False]
    assert [r.tokens for r in on] == [r.tokens for r in off]
    assert sum(r.stats["accepted"] for r in on) > 0
    mem = dec_on.q_memory(8, 3)
    assert mem["width"] == 40 and mem["vocab_size"] == VOCAB
    assert mem["saved_bytes"] == 4 * 8 * 3 * (VOCAB - 40)
    assert dec_off.q_memory(8, 3)["saved_bytes"] == 0
    with pytest.raises(TypeError, match="compact_q must be a bool"):
        SpecDecoder(target, Eagle3(target, heads["speculators"]), compact_q="yes")
