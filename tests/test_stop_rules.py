"""The stop rules (csrc/decoder/stop_rules.cpp), the one place they are applied."""

import pytest

from verispec._C import apply_stop_rules


def stop(tokens, *, generated=(), max_new=100, eos=(), seqs=(), prompt_len=3, max_context=1000):
    return apply_stop_rules(max_new, list(eos), [list(s) for s in seqs], list(generated),
                            list(tokens), prompt_len, max_context)


def test_nothing_stops():
    assert stop([5, 6, 7]) == (3, "running")


def test_eos_in_the_middle_keeps_it_and_drops_the_rest():
    assert stop([5, 2, 7, 2], eos=[9, 2]) == (2, "eos")


def test_stop_sequence_straddling_the_previous_step():
    assert stop([4, 8, 1], generated=[1, 2, 3], seqs=[[3, 4, 8]]) == (2, "stop")
    assert stop([4, 8, 1], generated=[1, 2], seqs=[[3, 4, 8]]) == (3, "running")


def test_max_new_tokens_is_exact():
    assert stop([1, 2, 3, 4], generated=[0] * 8, max_new=10) == (2, "length")


def test_context_limit_counts_the_prompt():
    assert stop([1, 2, 3], generated=[0, 0], prompt_len=5, max_context=8) == (1, "context")


@pytest.mark.parametrize("order", ["eos-first", "length-first"])
def test_first_rule_hit_wins(order):
    if order == "eos-first":
        assert stop([1, 9, 2], eos=[9], max_new=3) == (2, "eos")
    else:
        assert stop([1, 2, 9], eos=[9], max_new=2) == (2, "length")
