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

The same identity, checked by sampling: ``empirical_check(p, q, draws)`` runs the
native accept/correct step (``verispec.ops.verify`` with k = 1) ``draws`` times and
tests the emitted tokens against ``p`` (G-test); ``plot`` draws the decomposition.

Trees and blocks: ``tree_outputs`` (verify_tree), ``chain_outputs`` (token-wise) and
``block_outputs`` (verify with method="block") give the exact law of what one call
emits for a small "world" of prefix -> distribution callables, drafts enumerated;
``completed(outputs, p, m) == autoregressive(p, m)`` is their exactness.

    >>> parse_distribution("3/5, 0.3, 0.1", "p")
    [Fraction(3, 5), Fraction(3, 10), Fraction(1, 10)]
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction

__all__ = [
    "ALPHA",
    "EmpiricalCheck",
    "LabTable",
    "accepted_mass",
    "acceptance",
    "autoregressive",
    "block_outputs",
    "chain_outputs",
    "completed",
    "expected_accepted",
    "chi2_sf",
    "empirical_check",
    "format_table",
    "g_test",
    "native_step",
    "parse_distribution",
    "plot",
    "recovered",
    "rejection_mass",
    "residual",
    "table",
    "tree_outputs",
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


def parse_distribution(text, name="p"):
    """A distribution from text such as "0.6,0.3,0.1" or "3/5, 3/10, 1/10", as Fractions.

    Raises ValueError naming ``name``, the expected form and the value found (entries
    must be numbers >= 0 that sum to exactly 1).
    """
    if not isinstance(text, str):
        raise TypeError(f"{name} must be a string of comma-separated probabilities, got {text!r}")
    parts = [part.strip() for part in text.split(",")]
    if any(part == "" for part in parts):
        raise ValueError(f"{name} must be comma-separated probabilities such as '0.6,0.3,0.1', "
                         f"got {text!r}")
    return _distribution(name, parts)


# --- the same identity, by sampling -------------------------------------------------

ALPHA = 1e-3  # default false-alarm rate of empirical_check: a correct sampler fails this often


def native_step(p, q, draws, seed=0, *, device="cpu", chunk=1 << 16):
    """``draws`` independent speculative steps with the native ops, k = 1.

    Each row drafts y ~ q with ``verispec.ops.sample`` and runs ``verispec.ops.verify``
    on target logits log p (at the draft position and the bonus position) with
    draft_probs q, so one row is the whole accept / correct step. Rows are batched
    ``chunk`` at a time; the Philox offset advances per call, so every row draws fresh
    coins and the result is a pure function of ``seed``.

    p, q: probabilities over V tokens (anything ``table`` accepts, or float tensors).
    Returns (tokens int64 [draws]: the first emitted token of each row,
    accepted bool [draws]: whether that token was the accepted draft), on the CPU.
    """
    import torch

    from verispec import ops

    p_t, q_t = _float_probs(p, device), _float_probs(q, device)
    log_p = p_t.log().float()  # log 0 = -inf: a masked token
    q_t = q_t.float()
    tokens, accepted = [], []
    for call, start in enumerate(range(0, draws, chunk)):
        n = min(chunk, draws - start)
        q_rows = q_t.expand(n, -1).contiguous()                          # [n, V]
        drafted = ops.sample(q_rows, seed=seed, offset=2 * call)          # [n]
        out, _, num_accepted = ops.verify(
            log_p.expand(n, 2, -1).contiguous(),                          # [n, K+1 = 2, V]
            drafted.view(n, 1), q_rows.view(n, 1, -1),                    # [n, 1], [n, 1, V]
            seed=seed, offset=2 * call + 1)
        tokens.append(out[:, 0].long())
        accepted.append(num_accepted == 1)
    if not tokens:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.bool)
    return torch.cat(tokens).cpu(), torch.cat(accepted).cpu()


@dataclass(frozen=True)
class EmpiricalCheck:
    """Observed outcomes of many speculative steps against the target p.

    counts[i]: steps that emitted token i; accepted_counts[i]: of those, the steps that
    accepted a draft of i (expected share min(p_i, q_i)). statistic / dof / p_value: a
    G-test of counts against p; ``passed`` when p_value > alpha.
    """

    p: tuple                  # target, floats
    accepted_mass: tuple      # exact min(p_i, q_i), floats
    counts: tuple
    accepted_counts: tuple
    draws: int
    statistic: float
    dof: int
    p_value: float
    method: str               # how the p-value was computed
    alpha: float
    exact_acceptance_rate: float

    @property
    def frequencies(self):
        return tuple(c / self.draws for c in self.counts)

    @property
    def accepted_frequencies(self):
        return tuple(c / self.draws for c in self.accepted_counts)

    @property
    def max_deviation(self):
        """max_i |observed frequency_i - p_i|."""
        return max(abs(f - pi) for f, pi in zip(self.frequencies, self.p))

    @property
    def acceptance_rate(self):
        """Observed share of steps that accepted their draft."""
        return sum(self.accepted_counts) / self.draws

    @property
    def passed(self):
        return self.p_value > self.alpha

    def format(self, *, labels=None):
        """Text rows: per token p, observed, deviation, accepted mass; then the verdict."""
        n = len(self.p)
        labels = [str(i) for i in range(n)] if labels is None else [str(x) for x in labels]
        header = ["token", "p", "observed", "obs - p", "min(p,q)", "observed accepted"]
        body = [[labels[i], f"{self.p[i]:.6f}", f"{self.frequencies[i]:.6f}",
                 f"{self.frequencies[i] - self.p[i]:+.6f}", f"{self.accepted_mass[i]:.6f}",
                 f"{self.accepted_frequencies[i]:.6f}"] for i in range(n)]
        widths = [max(len(row[c]) for row in [header] + body) for c in range(len(header))]
        rows = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)).rstrip()
                for row in [header] + body]
        verdict = "PASS" if self.passed else "FAIL"
        return rows + [
            f"max |observed - p| = {self.max_deviation:.6f}; acceptance rate {self.acceptance_rate:.6f} "
            f"(exact {self.exact_acceptance_rate:.6f})",
            f"G-test: G = {self.statistic:.3f}, dof {self.dof}, p-value {self.p_value:.4g} "
            f"({self.method}); {verdict} at alpha = {self.alpha:g}",
        ]

    def to_dict(self):
        d = {f: getattr(self, f) for f in self.__dataclass_fields__}
        d.update(frequencies=self.frequencies, max_deviation=self.max_deviation,
                 acceptance_rate=self.acceptance_rate, passed=self.passed)
        return d


def empirical_check(p, q, draws=200_000, *, seed=0, device="cpu", sampler=None, alpha=ALPHA):
    """Run ``draws`` speculative steps and test the emitted tokens against p.

    ``sampler(p, q, draws, seed) -> (tokens [draws], accepted [draws])`` performs the
    steps, p and q given as float64 tensors; the default is ``native_step`` (the native
    ops on ``device``). A test can pass a deliberately wrong sampler to show the check
    has power. With a fixed seed the result is deterministic; over random seeds a
    correct sampler fails with probability ``alpha`` (the G-test's false-alarm rate).
    """
    import torch

    t = table(p, q)
    if isinstance(draws, bool) or not isinstance(draws, int) or draws < 1:
        raise ValueError(f"empirical_check: draws must be an int >= 1, got {draws!r}")
    if sampler is None:
        def sampler(p_, q_, n, s):
            return native_step(p_, q_, n, s, device=device)
    v = len(t.p)
    tokens, accepted = sampler(_float_probs(t.p, "cpu"), _float_probs(t.q, "cpu"), draws, seed)
    tokens = torch.as_tensor(tokens).long().cpu().reshape(-1)
    accepted = torch.as_tensor(accepted).bool().cpu().reshape(-1)
    if tokens.numel() != draws or accepted.numel() != draws:
        raise ValueError(f"empirical_check: sampler must return {draws} tokens and {draws} "
                         f"accepted flags, got {tokens.numel()} and {accepted.numel()}")
    if draws and (int(tokens.min()) < 0 or int(tokens.max()) >= v):
        raise ValueError(f"empirical_check: sampler returned tokens outside [0, {v}): "
                         f"min {int(tokens.min())}, max {int(tokens.max())}")
    counts = torch.bincount(tokens, minlength=v).tolist()
    accepted_counts = torch.bincount(tokens[accepted], minlength=v).tolist()
    statistic, dof, p_value, method = g_test(counts, t.p)
    return EmpiricalCheck(
        p=tuple(float(x) for x in t.p), accepted_mass=tuple(float(x) for x in t.accepted_mass),
        counts=tuple(counts), accepted_counts=tuple(accepted_counts), draws=draws,
        statistic=statistic, dof=dof, p_value=p_value, method=method, alpha=alpha,
        exact_acceptance_rate=float(t.acceptance_rate))


def g_test(counts, probs):
    """G-test (log-likelihood ratio) of observed counts against probabilities.

    Returns (G, dof, p_value, method). Tokens of probability 0 are left out of the
    degrees of freedom; observing one is impossible under p, so G = inf and p_value = 0.
    The chi-square approximation wants every expected count N * p_i >= 5 or so.
    """
    n = sum(counts)
    g, cells = 0.0, 0
    for observed, prob in zip(counts, probs):
        expected = n * float(prob)
        if expected == 0:
            if observed > 0:
                return math.inf, max(cells - 1, 0), 0.0, "an outcome of probability 0 occurred"
            continue
        cells += 1
        if observed > 0:
            g += 2.0 * observed * math.log(observed / expected)
    g = max(g, 0.0)  # roundoff
    dof = cells - 1
    if dof == 0:
        return g, 0, 1.0, "one possible outcome"
    p_value, method = _chi2_sf_with_method(g, dof)
    return g, dof, p_value, method


def chi2_sf(x, dof, *, use_scipy=True):
    """P(X > x) for X ~ chi-square(dof): scipy.stats.chi2.sf when available (and
    ``use_scipy``), else the regularized upper incomplete gamma Q(dof / 2, x / 2)."""
    return _chi2_sf_with_method(x, dof, use_scipy=use_scipy)[0]


def _chi2_sf_with_method(x, dof, *, use_scipy=True):
    if use_scipy:
        try:
            import scipy.stats
        except ImportError:
            pass
        else:
            return float(scipy.stats.chi2.sf(x, dof)), "scipy.stats.chi2"
    return _gamma_q(dof / 2.0, x / 2.0), "incomplete gamma (scipy not installed)"


def _gamma_q(a, x):
    """Regularized upper incomplete gamma Q(a, x): a series below x = a + 1, a continued
    fraction (modified Lentz) above, each to ~1e-15 relative."""
    if x <= 0:
        return 1.0
    if math.isinf(x):
        return 0.0
    log_prefix = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        denom = a
        for _ in range(10_000):
            denom += 1
            term *= x / denom
            total += term
            if abs(term) < abs(total) * 1e-16:
                break
        return min(1.0, max(0.0, 1.0 - total * math.exp(log_prefix)))
    tiny = 1e-300
    b = x + 1.0 - a
    c, d = 1.0 / tiny, 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-16:
            break
    return min(1.0, max(0.0, math.exp(log_prefix) * h))


def plot(lab_table, path, *, check=None, labels=None, title=None):
    """A PNG bar chart of one speculative step, per outcome: a stacked bar of the accepted
    mass min(p, q) and the corrected mass (rejection mass * residual), next to the target
    p; with an EmpiricalCheck, its observed frequencies as markers. Returns ``path``.

    Needs matplotlib (drawn on a standalone Figure: no pyplot state, no backend change).
    """
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ModuleNotFoundError("verispec.lab.plot needs matplotlib: pip install matplotlib",
                                  name="matplotlib") from None
    t = lab_table
    n = len(t.p)
    labels = [f"token {i}" for i in range(n)] if labels is None else [str(x) for x in labels]
    accepted = [float(x) for x in t.accepted_mass]
    corrected = [float(t.rejection_mass * r) for r in t.residual]
    target = [float(x) for x in t.p]
    xs = list(range(n))
    w = 0.38
    fig = Figure(figsize=(max(5.0, 1.3 * n + 2.5), 4.2))
    ax = fig.subplots()
    left = [x - w / 2 for x in xs]
    ax.bar(left, accepted, w, label="accepted: min(p, q)", color="#4c72b0")
    ax.bar(left, corrected, w, bottom=accepted, label="corrected: rejection mass x residual",
           color="#dd8452")
    ax.bar([x + w / 2 for x in xs], target, w, label="target p", color="#8c8c8c")
    if check is not None:
        ax.plot(left, check.frequencies, "kD", markersize=5,
                label=f"observed ({check.draws} native draws)")
    ax.set_xticks(xs)
    ax.set_xticklabels(labels)
    ax.set_ylabel("probability of emitting the token")
    ax.set_ylim(0, max(target + [a + c for a, c in zip(accepted, corrected)]) * 1.25)
    ax.set_title(title or f"one speculative step: accepted + corrected = p "
                          f"(acceptance rate {float(t.acceptance_rate):.3g})", fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


# --- trees and blocks, enumerated exactly -------------------------------------------------
# A "world" is two callables from a prefix (a tuple of token ids after the committed
# tokens) to a distribution over the same V tokens: p (the target, after its policy) and
# q (the drafter). The functions below give the exact law of what one verify_tree call
# (or one block verification of a chain) emits, as {emitted tuple: Fraction}, summed over
# the drafting (sampled trees are drawn from q here, as a drafter would) and over the
# verifier's coins. Exactness is then ``completed(outputs, p, m) == autoregressive(p, m)``:
# the emitted tokens, continued by sampling p, are a sample of p token after token.


def tree_outputs(p, parents, *, tokens=None, q=None, replacement=True):
    """Exact law of verify_tree's emitted tokens (the accepted path, then one token).

    parents: parent of each draft node (-1 = the root, else an earlier node).
    Deterministic candidates (q None): ``tokens`` gives each node's token (siblings
    distinct); at a node x ~ p, descend into the child holding x, else emit x.
    Sampled children (q given, ``tokens`` None): each node's token is drawn from q after
    its parent's path, siblings i.i.d. (replacement) or without replacement; every draw
    of the tree is enumerated with its probability, then verified by the op's rule:
    siblings in node order, child accepted with min(1, r(x) / q_i(x)), r <- norm(max(r -
    q_i, 0)) after a rejection, a sample of r when all are rejected, p at a leaf.
    """
    parents = [int(x) for x in parents]
    for i, par in enumerate(parents):
        if not -1 <= par < i:
            raise ValueError(f"parents[{i}] must be in [-1, {i}), got {par}")
    out = {}
    if q is None:
        if tokens is None or len(tokens) != len(parents):
            raise ValueError("tokens must give one token per node when q is None")
        _add_walk(out, Fraction(1), p, None, parents, list(tokens), replacement)
        return out
    if tokens is not None:
        raise ValueError("tokens must be None when q is given (the children are drawn from q)")
    for drawn, weight in _draws(q, parents, replacement):
        _add_walk(out, weight, p, q, parents, drawn, replacement)
    return out


def chain_outputs(p, q, k):
    """Exact law of token-wise verification of k proposals drawn from q (a chain tree)."""
    return tree_outputs(p, list(range(-1, k - 1)), q=q)


def block_outputs(p, q, k):
    """Exact law of block verification (Sun et al., arXiv 2403.10444) of a chain of k
    proposals drawn from q: weights w_i = min(1, w_{i-1} p(y_i) / q(y_i)), keep
    probabilities h_i = R_i / (R_i + 1 - w_i) (R_i = sum max(w_i p_i - q_i, 0); h_k = w_k),
    tau = the last i with eta_i < h_i (else 0), then y_1..y_tau and a token from p_k
    (tau = k) or norm(max(w_tau p_tau - q_tau, 0))."""
    out = {}
    for chain, weight in _draws(q, list(range(-1, k - 1)), True):
        w = [Fraction(1)]
        for i, y in enumerate(chain):
            pi, qi = _dist("p", p, tuple(chain[:i])), _dist("q", q, tuple(chain[:i]))
            num = w[-1] * pi[y]
            w.append(Fraction(0) if num == 0 else (Fraction(1) if num >= qi[y] else num / qi[y]))
        h = []
        for i in range(1, k + 1):
            if i == k:
                h.append(w[k])
                continue
            pi, qi = _dist("p", p, tuple(chain[:i])), _dist("q", q, tuple(chain[:i]))
            mass = sum(max(w[i] * a - b, Fraction(0)) for a, b in zip(pi, qi))
            denom = mass + 1 - w[i]
            h.append(mass / denom if denom > 0 else Fraction(1))
        later = Fraction(1)  # P(no i' > i kept)
        for tau in range(k, -1, -1):
            chance = later * (h[tau - 1] if tau > 0 else 1)
            if tau > 0:
                later *= 1 - h[tau - 1]
            if chance == 0:
                continue
            prefix = tuple(chain[:tau])
            pt = _dist("p", p, prefix)
            if tau == k:
                last = pt
            else:
                qt = _dist("q", q, prefix)
                r = [max(w[tau] * a - b, Fraction(0)) for a, b in zip(pt, qt)]
                mass = sum(r)
                last = pt if mass == 0 else [x / mass for x in r]
            for x, px in enumerate(last):
                if px:
                    key = prefix + (x,)
                    out[key] = out.get(key, Fraction(0)) + weight * chance * px
    return out


def completed(outputs, p, m):
    """The law of the first m tokens when every output shorter than m is continued by
    sampling p: {m-tuple: Fraction}. Equal to autoregressive(p, m) for an exact verifier."""
    law = {}
    for seq, prob in outputs.items():
        for cont, cprob in _continuations(p, tuple(seq[:m]), m):
            law[cont] = law.get(cont, Fraction(0)) + prob * cprob
    return {k: v for k, v in law.items() if v}


def autoregressive(p, m):
    """The law of m tokens sampled from p one after another: {m-tuple: Fraction}."""
    return {k: v for k, v in _continuations(p, (), m) if v}


def expected_accepted(outputs):
    """Expected number of accepted draft tokens (tokens emitted minus one)."""
    return sum(prob * (len(seq) - 1) for seq, prob in outputs.items())


def _dist(name, fn, prefix):
    return _distribution(f"{name}{list(prefix)}", fn(prefix))


def _continuations(p, prefix, m):
    if len(prefix) >= m:
        yield prefix, Fraction(1)
        return
    for x, px in enumerate(_dist("p", p, prefix)):
        if px:
            for seq, rest in _continuations(p, prefix + (x,), m):
                yield seq, px * rest


def _path(parents, tokens, node):
    out = []
    while node >= 0:
        out.append(tokens[node])
        node = parents[node]
    return tuple(reversed(out))


def _draws(q, parents, replacement):
    """Every assignment of tokens to the nodes, drawn from q in node order, with its
    probability (without replacement: q minus the earlier siblings, renormalised)."""
    n = len(parents)

    def rec(i, drawn, weight):
        if i == n:
            yield list(drawn), weight
            return
        qi = _dist("q", q, _path(parents, drawn, parents[i]))
        taken = [drawn[s] for s in range(i) if parents[s] == parents[i]] if not replacement else []
        left = 1 - sum(qi[t] for t in set(taken))
        for x, qx in enumerate(qi):
            if qx == 0 or x in taken:
                continue
            yield from rec(i + 1, drawn + [x], weight * qx / left)

    yield from rec(0, [], Fraction(1))


def _add_walk(out, weight, p, q, parents, tokens, replacement):
    """Adds the law of one verification walk over a fixed tree (times weight) to out."""
    n = len(parents)

    def walk(cur, prefix, reach):
        pr = _dist("p", p, prefix)
        children = [c for c in range(cur + 1, n) if parents[c] == cur]
        if q is None:
            for x, px in enumerate(pr):
                if not px:
                    continue
                child = next((c for c in children if tokens[c] == x), None)
                if child is None:
                    key = prefix + (x,)
                    out[key] = out.get(key, Fraction(0)) + reach * px
                else:
                    walk(child, prefix + (x,), reach * px)
            return
        r, stay = pr, reach
        qn = _dist("q", q, prefix)
        removed = []
        for c in children:
            left = 1 - sum(qn[t] for t in removed)
            qi = [Fraction(0) if (t in removed or left <= 0) else qn[t] / left
                  for t in range(len(qn))]
            x = tokens[c]
            accept = (Fraction(1) if r[x] > 0 else Fraction(0)) if qi[x] == 0 \
                else min(Fraction(1), r[x] / qi[x])
            if accept:
                walk(c, prefix + (x,), stay * accept)
            stay *= 1 - accept
            if stay == 0:
                return
            res = [max(a - b, Fraction(0)) for a, b in zip(r, qi)]
            mass = sum(res)
            r = pr if mass == 0 else [v / mass for v in res]
            if not replacement:
                removed.append(x)
        for x, rx in enumerate(r):
            if rx:
                key = prefix + (x,)
                out[key] = out.get(key, Fraction(0)) + stay * rx

    walk(-1, (), weight)


def _float_probs(values, device):
    import torch

    if isinstance(values, torch.Tensor):
        return values.to(device=device, dtype=torch.float64)
    return torch.tensor([float(_fraction("probs", i, v)) for i, v in enumerate(values)],
                        dtype=torch.float64, device=device)


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
