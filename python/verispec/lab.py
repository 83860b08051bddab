"""Speculative sampling, worked exactly: rational arithmetic on small distributions.

For a target ``p`` and a draft ``q`` over the same few tokens, one speculative step
emits token ``i`` with probability

    min(p_i, q_i)                    drafted i and accepted it (prob q_i * min(1, p_i/q_i))
  + (1 - sum_j min(p_j, q_j)) * r_i  rejected some draft, corrected with r = norm(max(p - q, 0))

and the two terms add up to exactly ``p_i``. This module computes each term with
``fractions.Fraction`` so that identity can be checked with ``==``, not a tolerance.

    >>> t = table(["0.6", "0.3", "0.1"], ["0.2", "0.5", "0.3"])
    >>> t.acceptance
    (Fraction(1, 1), Fraction(3, 5), Fraction(1, 3))
    >>> t.recovered == t.p
    True

Values may be Fractions, ints, decimal strings ("0.6", "3/5") or floats. A float is
read as its shortest decimal repr (0.1 -> 1/10), which is what a person typing 0.1
means; Fraction(0.1) would be the binary value 3602879701896397/36028797018963968.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction

__all__ = [
    "LabTable",
    "accepted_mass",
    "acceptance",
    "format_table",
    "recovered",
    "rejection_mass",
    "residual",
    "table",
]


def acceptance(p, q):
    """Per token, the probability a proposal of it is accepted: min(1, p_i / q_i).

    Defined as 1 where q_i == 0 (that token is never proposed, so it never matters).
    """
    p, q = _pair(p, q)
    return [Fraction(1) if qi == 0 else min(Fraction(1), pi / qi) for pi, qi in zip(p, q)]


def accepted_mass(p, q):
    """Per token, P(draft proposes i and it is accepted) = min(p_i, q_i)."""
    p, q = _pair(p, q)
    return [min(pi, qi) for pi, qi in zip(p, q)]


def rejection_mass(p, q):
    """P(the proposal is rejected) = 1 - sum_i min(p_i, q_i), the total variation distance."""
    return 1 - sum(accepted_mass(p, q))


def residual(p, q):
    """The correction distribution r = max(p - q, 0) / rejection_mass.

    When the rejection mass is 0 (p == q) no rejection can happen and r is undefined;
    p is returned, the same fallback verify uses for a roundoff-sized residual.
    """
    p, q = _pair(p, q)
    mass = rejection_mass(p, q)
    if mass == 0:
        return list(p)
    return [max(pi - qi, Fraction(0)) / mass for pi, qi in zip(p, q)]


def recovered(p, q):
    """P(one speculative step emits i) = accepted_mass_i + rejection_mass * residual_i; == p."""
    p, q = _pair(p, q)
    mass = rejection_mass(p, q)
    return [a + mass * r for a, r in zip(accepted_mass(p, q), residual(p, q))]


@dataclass(frozen=True)
class LabTable:
    """Every quantity of one speculative step, per token; each a tuple of Fractions."""

    p: tuple
    q: tuple
    acceptance: tuple
    accepted_mass: tuple
    rejection_mass: Fraction
    residual: tuple
    recovered: tuple

    @property
    def acceptance_rate(self):
        """P(the proposal is accepted) = sum_i min(p_i, q_i)."""
        return 1 - self.rejection_mass

    @property
    def exact(self):
        """True when the step reproduces p exactly (always, for a correct algorithm)."""
        return self.recovered == self.p


def table(p, q):
    """All quantities of one speculative step for target p and draft q, as a LabTable."""
    p, q = _pair(p, q)
    return LabTable(
        p=tuple(p),
        q=tuple(q),
        acceptance=tuple(acceptance(p, q)),
        accepted_mass=tuple(accepted_mass(p, q)),
        rejection_mass=rejection_mass(p, q),
        residual=tuple(residual(p, q)),
        recovered=tuple(recovered(p, q)),
    )


def format_table(lab_table, *, labels=None, decimals=None):
    """Render a LabTable as text rows (no trailing newlines), one per token plus a summary.

    labels: a name per token (default: the token index). decimals: show values as
    decimals with that many digits instead of exact fractions.
    """
    t = lab_table
    n = len(t.p)
    if labels is None:
        labels = [str(i) for i in range(n)]
    labels = [str(label) for label in labels]
    if len(labels) != n:
        raise ValueError(f"format_table: labels must have {n} entries (one per token), "
                         f"got {len(labels)}")
    if decimals is not None and (isinstance(decimals, bool) or not isinstance(decimals, int)
                                 or decimals < 0):
        raise ValueError(f"format_table: decimals must be an int >= 0 or None, got {decimals!r}")

    def show(x):
        return str(x) if decimals is None else f"{float(x):.{decimals}f}"

    header = ["token", "p", "q", "accept", "min(p,q)", "residual", "recovered"]
    body = [
        [labels[i], show(t.p[i]), show(t.q[i]), show(t.acceptance[i]),
         show(t.accepted_mass[i]), show(t.residual[i]), show(t.recovered[i])]
        for i in range(n)
    ]
    widths = [max(len(row[c]) for row in [header] + body) for c in range(len(header))]

    def line(cells):
        return "  ".join(cell.rjust(w) for cell, w in zip(cells, widths)).rstrip()

    return [line(header)] + [line(row) for row in body] + [
        f"acceptance rate = {show(t.acceptance_rate)}, rejection mass = {show(t.rejection_mass)}",
        f"recovered == p: {t.exact}",
    ]


# --- input checks -------------------------------------------------------------------


def _fraction(name, i, value):
    if isinstance(value, bool):
        raise TypeError(f"{name}[{i}] must be a number or a numeric string, got {value!r}")
    if isinstance(value, Fraction):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{name}[{i}] must be finite, got {value!r}")
        return Fraction(repr(value))
    if isinstance(value, (numbers.Rational, Decimal)):
        return Fraction(value)
    if isinstance(value, numbers.Real):  # numpy floats and other reals
        return _fraction(name, i, float(value))
    if isinstance(value, str):
        try:
            return Fraction(value.strip())
        except ValueError:
            raise ValueError(f"{name}[{i}] must be a number or a numeric string such as "
                             f"'0.6' or '3/5', got {value!r}") from None
    raise TypeError(f"{name}[{i}] must be a number or a numeric string, got "
                    f"{type(value).__name__} {value!r}")


def _distribution(name, values):
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{name} must be a sequence of probabilities, got {values!r}")
    probs = [_fraction(name, i, v) for i, v in enumerate(values)]
    if not probs:
        raise ValueError(f"{name} must have at least one entry, got an empty sequence")
    for i, x in enumerate(probs):
        if x < 0:
            raise ValueError(f"{name}[{i}] must be >= 0, got {x}")
    total = sum(probs)
    if total != 1:
        raise ValueError(f"{name} must sum to exactly 1, got {total} (= {float(total)!r})")
    return probs


def _pair(p, q):
    p, q = _distribution("p", p), _distribution("q", q)
    if len(p) != len(q):
        raise ValueError(f"p and q must have the same length, got {len(p)} and {len(q)}")
    return p, q
