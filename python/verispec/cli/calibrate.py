"""Early exit's depth from measured acceptance.

How many of the target's layers an early-exit draft should run decides whether it pays:
on SmolLM2-135M (30 layers) greedy acceptance is about 0.05 at 8 layers and 0.5 at 28,
and a draft of n layers costs about n / L of a target pass per proposal. So when the
user names no depth, the command line measures: a short greedy run of each candidate
depth on the prompt's own tokens (k = 1, so the acceptance rate is the per-token
acceptance a), then the cost model of adaptive k (csrc/include/verispec/adaptive_k.h),
with the draft's cost taken as its share of the layers:

    speedup(n) = max over k of  E(a, k) / (1 + k * n / L + k * c),  E(a, k) = (1 - a^(k+1)) / (1 - a)

where c is what one more token costs a memory-bound target pass, in one-token passes
(VERIFY_TOKEN_COST). The costs are structural, not timed: a timing on a shared machine
would pick a depth by its noise, and acceptance, which is deterministic for a greedy
run, is what varies between depths. The estimate leaves out the draft's LM head, so it
is optimistic; when even the best depth stays below 1 the command warns and says what
to try instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from verispec.cache import blocks_for

CALIBRATION_TOKENS = 32    # new tokens per candidate depth
CALIBRATION_CONTEXT = 256  # the prompt's last tokens the calibration runs on
VERIFY_TOKEN_COST = 0.05   # one more token in a decode pass, in one-token passes
BLOCK_SIZE = 16


def candidate_depths(num_layers: int) -> list[int]:
    """A quarter, half and three quarters of the layers, and all but two."""
    depths = {round(num_layers * f) for f in (0.25, 0.5, 0.75)} | {num_layers - 2}
    return sorted(d for d in depths if 1 <= d < num_layers)


def estimated_speedup(acceptance: float, draft_fraction: float, max_k: int) -> tuple[float, int]:
    """(speedup over plain decoding, the k >= 1 that gives it) by the cost model above;
    below 1 when no k pays (k auto would then mostly draft nothing)."""
    from verispec import _C

    best = (0.0, 0)
    for k in range(1, max_k + 1):
        cost = 1.0 + k * draft_fraction + k * VERIFY_TOKEN_COST
        best = max(best, (_C.expected_tokens(acceptance, k) / cost, k), key=lambda x: x[0])
    return best


@dataclass
class Calibration:
    num_layers: int
    acceptance: dict = field(default_factory=dict)  # depth -> measured acceptance rate
    estimate: dict = field(default_factory=dict)    # depth -> estimated speedup
    depth: int = 0                                  # the chosen depth

    @property
    def pays(self) -> bool:
        return self.estimate[self.depth] > 1.0

    def describe(self) -> str:
        measured = ", ".join(f"{n}: {a:.2f}" for n, a in self.acceptance.items())
        return (f"depth from greedy acceptance measured on the prompt by layers ({measured}); "
                f"estimated {self.estimate[self.depth]:.2f}x of plain")

    def advice(self) -> str:
        return (f"early exit does not pay on this prompt: at the best depth ({self.depth} of "
                f"{self.num_layers} layers, acceptance {self.acceptance[self.depth]:.2f}) the "
                f"cost model estimates {self.estimate[self.depth]:.2f}x of plain decoding; try "
                f"--draft ngram for text that repeats the prompt, or --draft none")


def calibrate_early_exit(model, prompt: list[int], max_k: int) -> Calibration:
    """Measures greedy acceptance at each candidate depth on the prompt's last tokens and
    picks the depth of the best estimated speedup (the shallower one on a tie)."""
    from verispec.decoder import SpecDecoder
    from verispec.drafters import EarlyExit

    layers = model.geometry.num_layers
    context = list(prompt[-CALIBRATION_CONTEXT:])
    cal = Calibration(num_layers=layers)
    num_blocks = blocks_for(len(context) + CALIBRATION_TOKENS + 4, BLOCK_SIZE, spare=1)
    for n in candidate_depths(layers):
        dec = SpecDecoder(model, EarlyExit(model, num_layers=n), k=1, block_size=BLOCK_SIZE,
                          num_blocks=num_blocks)
        (r,) = dec.generate([context], max_new_tokens=CALIBRATION_TOKENS, temperature=0.0)
        cal.acceptance[n] = float(r.stats["acceptance_rate"] or 0.0)
        cal.estimate[n] = estimated_speedup(cal.acceptance[n], n / layers, max_k)[0]
    cal.depth = max(cal.estimate, key=lambda n: (cal.estimate[n], -n))
    return cal
