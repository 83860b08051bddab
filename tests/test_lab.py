"""verispec.lab: exact rational speculative-sampling arithmetic."""

from decimal import Decimal
from fractions import Fraction as F

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verispec import lab

P = ("0.6", "0.3", "0.1")
Q = ("0.2", "0.5", "0.3")


def test_worked_example_exact():
    t = lab.table(P, Q)
    assert t.p == (F(3, 5), F(3, 10), F(1, 10))
    assert t.q == (F(1, 5), F(1, 2), F(3, 10))
    assert t.acceptance == (F(1), F(3, 5), F(1, 3))
    assert t.accepted_mass == (F(1, 5), F(3, 10), F(1, 10))
    assert t.rejection_mass == F(2, 5)
    assert t.acceptance_rate == F(3, 5)
    assert t.residual == (F(1), F(0), F(0))
    assert t.recovered == (F(3, 5), F(3, 10), F(1, 10))
    assert t.exact


def test_functions_agree_with_table_and_accept_mixed_inputs():
    p = [F(3, 5), "3/10", 0.1]          # Fraction, string, float
    q = [Decimal("0.2"), F(1, 2), "0.3"]
    assert lab.acceptance(p, q) == [F(1), F(3, 5), F(1, 3)]
    assert lab.accepted_mass(p, q) == [F(1, 5), F(3, 10), F(1, 10)]
    assert lab.rejection_mass(p, q) == F(2, 5)
    assert lab.residual(p, q) == [F(1), F(0), F(0)]
    assert lab.recovered(p, q) == [F(3, 5), F(3, 10), F(1, 10)]
    assert lab.table(p, q) == lab.table(P, Q)


def test_q_zero_where_p_has_mass():
    # The draft never proposes token 1; all of p(1) must come back through the residual.
    p, q = [F(1, 2), F(1, 2)], [1, 0]
    t = lab.table(p, q)
    assert t.acceptance == (F(1, 2), F(1))
    assert t.rejection_mass == F(1, 2)
    assert t.residual == (F(0), F(1))
    assert t.recovered == t.p


def test_p_equals_q_falls_back_to_p():
    p = ["1/6", "1/3", "1/2"]
    t = lab.table(p, p)
    assert t.acceptance == (1, 1, 1)
    assert t.rejection_mass == 0
    assert t.residual == t.p  # documented fallback: no rejection can happen
    assert t.recovered == t.p


def test_single_token_vocabulary():
    assert lab.table([1], [1]).recovered == (F(1),)


@st.composite
def distribution(draw, n, allow_zeros=True):
    low = 0 if allow_zeros else 1
    weights = draw(st.lists(st.integers(low, 30), min_size=n, max_size=n).filter(any))
    total = sum(weights)
    return [F(w, total) for w in weights]


@st.composite
def pair(draw):
    n = draw(st.integers(1, 7))
    return draw(distribution(n)), draw(distribution(n))


@settings(max_examples=300, database=None, derandomize=True, deadline=None)
@given(pair())
def test_recovered_is_p_exactly(pq):
    p, q = pq
    t = lab.table(p, q)
    assert t.recovered == tuple(p)
    assert sum(t.accepted_mass) + t.rejection_mass == 1
    assert all(0 <= a <= 1 for a in t.acceptance)
    # P(propose i and accept) = q_i * acceptance_i = min(p_i, q_i)
    assert all(qi * a == m for qi, a, m in zip(q, t.acceptance, t.accepted_mass))
    if t.rejection_mass:
        assert sum(t.residual) == 1 and all(r >= 0 for r in t.residual)
        # the residual lives where the draft undershoots the target
        assert all(r == 0 for r, pi, qi in zip(t.residual, p, q) if pi <= qi)


@settings(max_examples=100, database=None, derandomize=True, deadline=None)
@given(st.integers(1, 7).flatmap(lambda n: distribution(n)))
def test_p_equals_q_property(p):
    t = lab.table(p, p)
    assert t.rejection_mass == 0 and t.acceptance_rate == 1
    assert t.recovered == t.residual == tuple(p)


def test_wrong_correction_is_not_exact():
    # The lab can show why the correction must be the residual: using p instead loses mass.
    p, q = [F(3, 5), F(3, 10), F(1, 10)], [F(1, 5), F(1, 2), F(3, 10)]
    mass = lab.rejection_mass(p, q)
    wrong = [a + mass * pi for a, pi in zip(lab.accepted_mass(p, q), p)]
    assert wrong != p


@pytest.mark.parametrize(
    ("p", "q", "error", "message"),
    [
        (["0.5", "0.6"], ["0.5", "0.5"], ValueError, "p must sum to exactly 1, got 11/10"),
        (["0.5", "0.5"], ["1.5", "-0.5"], ValueError, r"q\[1\] must be >= 0, got -1/2"),
        (["0.5", "0.5"], ["1"], ValueError, "same length, got 2 and 1"),
        ([], [], ValueError, "p must have at least one entry"),
        (["half", "0.5"], ["0.5", "0.5"], ValueError, r"p\[0\] must be a number or a numeric"),
        ([float("nan"), 1], [0, 1], ValueError, r"p\[0\] must be finite"),
        ([True, 0], [1, 0], TypeError, r"p\[0\] must be a number"),
        ([None, 1], [0, 1], TypeError, r"p\[0\] must be a number"),
        ("01", [0, 1], TypeError, "p must be a sequence"),
        (0.5, [0, 1], TypeError, "p must be a sequence"),
    ],
)
def test_bad_inputs(p, q, error, message):
    for fn in (lab.table, lab.acceptance, lab.residual, lab.recovered, lab.rejection_mass):
        with pytest.raises(error, match=message):
            fn(p, q)


def test_float_inputs_read_as_decimals():
    # 0.6 + 0.3 + 0.1 in binary is not 1; read as decimals it is.
    assert lab.table([0.6, 0.3, 0.1], [0.2, 0.5, 0.3]) == lab.table(P, Q)


def test_format_table_rows():
    rows = lab.format_table(lab.table(P, Q), labels=["a", "b", "c"])
    assert rows[0].split() == ["token", "p", "q", "accept", "min(p,q)", "residual", "recovered"]
    assert rows[1].split() == ["a", "3/5", "1/5", "1", "1/5", "1", "3/5"]
    assert rows[2].split() == ["b", "3/10", "1/2", "3/5", "3/10", "0", "3/10"]
    assert rows[3].split() == ["c", "1/10", "3/10", "1/3", "1/10", "0", "1/10"]
    assert rows[4] == "acceptance rate = 3/5, rejection mass = 2/5"
    assert rows[5] == "recovered == p: True"
    assert len({len(r) for r in rows[:4]}) == 1  # right-aligned columns


def test_format_table_decimals_and_errors():
    rows = lab.format_table(lab.table(P, Q), decimals=3)
    assert rows[3].split() == ["2", "0.100", "0.300", "0.333", "0.100", "0.000", "0.100"]
    with pytest.raises(ValueError, match="labels must have 3 entries"):
        lab.format_table(lab.table(P, Q), labels=["a"])
    with pytest.raises(ValueError, match="decimals must be an int >= 0"):
        lab.format_table(lab.table(P, Q), decimals=-1)
