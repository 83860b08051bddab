"""N-gram prompt lookup: the native incremental index against a brute-force matcher."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from toymodels import CacheModel

from verispec import _C, reference
from verispec.decoder import SpecDecoder
from verispec.drafters import NGram


def brute_force(tokens, min_n, max_n, k):
    """The rule of csrc/include/verispec/ngram.h, by scanning everything."""
    L = len(tokens)
    for n in range(min(max_n, L), min_n - 1, -1):
        key = tokens[L - n:]
        for e in range(L - 2, n - 2, -1):  # most recent earlier occurrence first
            if tokens[e - n + 1:e + 1] == key:
                return tokens[e + 1:min(e + 1 + k, L)]
    return []


ops = st.lists(st.one_of(st.tuples(st.just("extend"), st.lists(st.integers(0, 3), max_size=12)),
                         st.tuples(st.just("rollback"), st.integers(0, 30)),
                         st.tuples(st.just("propose"), st.integers(0, 6))), max_size=40)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(min_n=st.integers(1, 3), extra=st.integers(0, 3), script=ops)
def test_index_matches_brute_force_through_rollbacks(min_n, extra, script):
    max_n = min_n + extra
    index = _C.NGramIndex(min_n, max_n)
    tokens = []
    for op, arg in script:
        if op == "extend":
            index.extend(arg)
            tokens += arg
        elif op == "rollback":
            new_len = min(arg, len(tokens))
            index.rollback(new_len)
            tokens = tokens[:new_len]
        assert index.length == len(tokens)
        for k in (1, 4) if op != "propose" else (arg,):
            assert index.propose(k) == brute_force(tokens, min_n, max_n, k)


def test_brute_force_would_catch_a_wrong_rule():
    """Power: an index that picks the oldest match disagrees with the rule."""
    tokens = [1, 2, 9, 1, 2, 7, 1, 2]
    index = _C.NGramIndex(1, 2)
    index.extend(tokens)
    assert index.propose(1) == [7] == brute_force(tokens, 1, 2, 1)
    assert brute_force(tokens, 1, 2, 1) != [9]


def test_bad_arguments():
    with pytest.raises(ValueError, match="min_n <= max_n"):
        _C.NGramIndex(3, 2)
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NGram(0, 2)
    index = _C.NGramIndex(1, 2)
    index.extend([1, 2])
    with pytest.raises(ValueError, match=r"new_len must be in \[0, 2\], got 3"):
        index.rollback(3)


@pytest.mark.parametrize("greedy", [True, False])
def test_ngram_drafts_keep_greedy_output_and_speed_up_copying(greedy):
    """A repetitive target: n-gram drafts are accepted often and output is unchanged."""
    target = CacheModel(7, seed=5, table_rows=3, scale=4.0)  # few contexts: repetitive
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    plain = SpecDecoder(target, None, num_blocks=64, block_size=4, ops=reference)
    spec = SpecDecoder(target, NGram(1, 3), k=4, num_blocks=64, block_size=4, ops=reference)
    kw = dict(max_new_tokens=40, greedy=greedy, seed=3)
    (a,) = plain.generate([prompt], **kw)
    (b,) = spec.generate([prompt], **kw)
    if greedy:
        assert a.tokens == b.tokens
    assert len(b.tokens) == 40
    assert b.stats["proposed"] > 0
    if greedy:
        assert b.stats["tokens_per_target_pass"] > 1.5
    assert spec.num_free_blocks() == spec.num_blocks()
