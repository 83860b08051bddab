"""The speed report of ``verispec generate``: what the timed rounds allow one to say.

Speculative and plain runs alternate over several rounds after a warm-up, so a drifting
machine load hits both alike. Each round gives one ratio of the two rates; the report
says the median and the range of those ratios, and how much the plain runs (the same
work each time) vary: the noise band of this machine, now. It then refuses to claim
what the run cannot show:

- nothing drafted: every step was a plain step, so any difference is noise;
- a speedup above what the tokens per target pass allow: a speculative step runs one
  target pass of k + 1 tokens (costing at least a one-token pass) plus the drafts, so
  it cannot be faster than plain decoding by more than the tokens it emits per pass;
- rounds that disagree on which is faster: no measurable difference.

Paired rounds cancel the load that drifts slowly; the spread of the same runs is shown
so that a reader sees how loaded the machine was (under heavy load it can exceed 100%
while every round still agrees).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

# Below this many tokens per target pass a run "accepted almost nothing": under 10% over
# plain decoding's one token per pass, less than the drafts usually cost.
ALMOST_NOTHING_TOKENS_PER_PASS = 1.1


def median(values: Sequence[float]) -> float:
    values = sorted(values)
    if not values:
        raise ValueError("median: expected at least one value, got none")
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def spread(values: Sequence[float]) -> Optional[float]:
    """(max - min) / median: how much the same work's measurements vary; None for one."""
    if len(values) < 2:
        return None
    return (max(values) - min(values)) / median(values)


@dataclass
class SpeedVerdict:
    """What a run's rounds say about speculative against plain decoding."""

    ratios: list           # per round: speculative rate / plain rate
    noise: Optional[float]  # the larger relative spread of the plain and speculative rates
    cap: float             # the most the tokens per target pass allow
    proposed: int          # draft tokens proposed in the (last) speculative run

    @property
    def median(self) -> float:
        return median(self.ratios)

    @property
    def kind(self) -> str:
        """"nothing drafted", "above the cap", "within noise" (the rounds disagree on which
        is faster) or "measured"."""
        m = self.median
        if self.proposed == 0:
            return "nothing drafted"
        if m > self.cap:
            return "above the cap"
        if min(self.ratios) <= 1.0 <= max(self.ratios):
            return "within noise"
        return "measured"

    def _rounds(self) -> str:
        n = len(self.ratios)
        if n == 1:
            return "one round, so its spread is not measured: --repeats 3 measures it"
        return (f"median of {n} rounds, {min(self.ratios):.2f}-{max(self.ratios):.2f}x; the "
                f"same runs vary by {self.noise:.0%} here")

    def line(self) -> str:
        m, kind = self.median, self.kind
        if kind == "nothing drafted":
            return (f"speedup none: the drafter proposed no tokens, so every step was a plain "
                    f"step; the measured {m:.2f}x ({self._rounds()}) is noise")
        if kind == "above the cap":
            return (f"speedup at most {self.cap:.2f}x: the measured {m:.2f}x ({self._rounds()}) "
                    f"is more than {self.cap:.2f} tokens per target pass allow, so the excess "
                    f"is machine noise; rerun with more --repeats on a quieter machine")
        if kind == "within noise":
            return (f"speedup none measurable: {m:.2f}x ({self._rounds()}): the rounds "
                    f"disagree on which is faster")
        return f"speedup {m:.2f}x over plain decoding ({self._rounds()})"


def judge(spec_rates: Sequence[float], plain_rates: Sequence[float], *,
          tokens_per_pass: float, plain_tokens_per_pass: float = 1.0,
          proposed: int) -> SpeedVerdict:
    """The verdict of paired rounds (spec_rates[i] and plain_rates[i] ran in round i)."""
    if len(spec_rates) != len(plain_rates) or not spec_rates:
        raise ValueError(f"judge: expected as many speculative as plain rates (>= 1), got "
                         f"{len(spec_rates)} and {len(plain_rates)}")
    ratios = [s / p for s, p in zip(spec_rates, plain_rates)]
    noises = [x for x in (spread(plain_rates), spread(spec_rates)) if x is not None]
    cap = tokens_per_pass / plain_tokens_per_pass if plain_tokens_per_pass > 0 else tokens_per_pass
    return SpeedVerdict(ratios=ratios, noise=max(noises) if noises else None, cap=cap,
                        proposed=proposed)


def low_acceptance_note(stats: dict, draft_kind: str, num_layers: int, k) -> Optional[str]:
    """One line after a run that drafted nothing or had almost nothing accepted, saying so
    and what would help; None otherwise. ``draft_kind``: "ngram", "early-exit" or "model"."""
    proposed = int(stats.get("proposed") or 0)
    per_pass = float(stats.get("tokens_per_target_pass") or 0.0)
    help_ = {
        "ngram": "n-gram lookup pays on text that repeats the prompt or itself (rewriting, "
                 "editing, extraction, code); for open-ended text --draft none is as fast",
        "early-exit": f"a deeper draft (--early-exit-layers, up to {num_layers - 1}), "
                      f"--draft ngram for text that repeats the prompt, or --draft none",
        "model": "a draft model closer to the target (same family and training), or "
                 "--draft ngram for text that repeats the prompt",
    }[draft_kind]
    if proposed == 0:
        why = ("--k 0 drafts nothing" if k == 0 else
               "k auto found no proposal worth its cost" + (
                   " (or the text's last tokens had no earlier occurrence)"
                   if draft_kind == "ngram" else ""))
        return f"note: the drafter proposed no tokens ({why}); {help_}"
    if per_pass < ALMOST_NOTHING_TOKENS_PER_PASS:
        acc = stats.get("acceptance_rate")
        return (f"note: almost nothing was accepted (acceptance {acc or 0.0:.2f}, {per_pass:.2f} "
                f"tokens per target pass); what would help: {help_}")
    return None
