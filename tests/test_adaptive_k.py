"""Adaptive speculation length: the cost-model rule and the controller in the loop."""

import time

import pytest
from toymodels import CacheModel

from verispec import _C, reference
from verispec.decoder import SpecDecoder
from verispec.drafters import NGram


def brute_best_k(a, draft, target, max_k):
    rates = []
    for k in range(max_k + 1):
        e = k + 1 if a == 1 else (1 - a ** (k + 1)) / (1 - a)
        rates.append(e / (k * draft + target[k]))
    return max(range(max_k + 1), key=lambda k: (rates[k], -k))


@pytest.mark.parametrize("a", [0.0, 0.1, 0.3, 0.5, 0.7, 0.85, 0.95, 1.0])
@pytest.mark.parametrize("draft", [0.0, 0.05, 0.2, 0.6])
def test_best_k_is_the_argmax_of_the_cost_model(a, draft):
    target = [1.0 + 0.2 * n for n in range(9)]  # a 5-token pass costs 1.8x a 1-token pass
    assert _C.best_k(a, draft, target, 8) == brute_best_k(a, draft, target, 8)
    assert _C.expected_tokens(a, 3) == pytest.approx(4.0 if a == 1 else (1 - a ** 4) / (1 - a))


def test_useless_draft_turns_speculation_off_and_a_perfect_one_on():
    assert _C.best_k(0.0, 0.1, [1.0 + 0.2 * n for n in range(9)], 8) == 0
    assert _C.best_k(1.0, 0.0, [1.0 + 0.2 * n for n in range(9)], 8) == 8


class SyntheticClock:
    """The decoder's clock (verispec.decoder's ``time.perf_counter``) replaced by one that
    only Slow models given this clock move: each pass is measured at exactly its
    synthetic cost, whatever else the machine is doing, so the controller's decisions
    are the same on every run (a test of the rule, not of the machine's jitter)."""

    def __init__(self, monkeypatch):
        import types

        import verispec.decoder

        self.now = 0.0
        monkeypatch.setattr(verispec.decoder, "time",
                            types.SimpleNamespace(perf_counter=lambda: self.now))


class Slow:
    """A toy model with a synthetic cost: base + per_token seconds per forward row-token,
    slept (the decoder measures it on the wall clock) or, with a SyntheticClock, added to
    that clock."""

    def __init__(self, model, base, per_token, clock=None):
        self.model, self.base, self.per_token, self.clock = model, base, per_token, clock
        self.geometry = model.geometry

    def forward(self, batch):
        cost = self.base + self.per_token * int(batch.input_ids.shape[0])
        if self.clock is None:
            time.sleep(cost)
        else:
            self.clock.now += cost
        return self.model.forward(batch)

    def logits_for(self, prefix):
        return self.model.logits_for(prefix)


# The synthetic costs (sleeps) are made large next to the real work of a step (toy
# forwards, native ops) so that a loaded machine does not change what the controller
# measures.
def test_controller_stops_speculating_with_a_useless_draft():
    target = Slow(CacheModel(50, seed=1, scale=4.0), 0.02, 0.004)
    useless = Slow(CacheModel(50, seed=9, scale=4.0), 0.012, 0.0)  # unrelated: ~no acceptance
    dec = SpecDecoder(target, useless, k="auto", max_k=6, num_blocks=64, block_size=4)
    (r,) = dec.generate([[1, 2, 3]], max_new_tokens=60, greedy=True)
    ks = r.stats["k_history"]
    assert sum(ks[-20:]) <= 2, ks  # off, but for rare probes
    cm = dec.cost_model()
    assert cm["draft_pass_s"] > 0.012 and cm["target_pass_s"][0] > 0.02


def test_controller_speculates_far_with_a_perfect_draft():
    target = Slow(CacheModel(50, seed=1, scale=4.0), 0.02, 0.002)
    twin = Slow(CacheModel(50, seed=1, scale=4.0), 0.002, 0.0)  # the same table: always right
    dec = SpecDecoder(target, twin, k="auto", max_k=6, num_blocks=64, block_size=4)
    (r,) = dec.generate([[1, 2, 3]], max_new_tokens=60, greedy=True)
    assert r.stats["acceptance_rate"] == 1.0
    assert max(r.stats["k_history"][-5:]) >= 4, r.stats["k_history"]
    assert r.stats["tokens_per_target_pass"] > 3


def test_the_decoder_speculates_less_for_a_large_batch(monkeypatch):
    """End to end, the same draft (acceptance ~0.7): one sequence speculates (k ~ 3), a
    batch of 24 barely does (k ~ 0, probes aside), because the target's synthetic cost grows
    with the pass's total tokens (10 ms + 1 ms per token) and 24 rows make every proposal
    dear. The decoder measures the cost itself; nothing is told. (This holds for a fixed
    batch size under the old per-row cost table too; test_k_falls_when_the_batch_makes_the_
    target_pass_compute_bound is the one that tells the rules apart.) The costs are on a
    SyntheticClock: measured exactly, so the outcome does not depend on sleep jitter."""
    mean_k = {}
    clock = SyntheticClock(monkeypatch)
    for n in (1, 24):
        target = Slow(CacheModel(50, seed=1, scale=4.0), 0.01, 0.001, clock)
        draft = Slow(CacheModel(50, base=target.model, noise=0.5, seed=2), 0.001, 0.0, clock)
        dec = SpecDecoder(target, draft, k="auto", max_k=6, num_blocks=512, block_size=4)
        results = dec.generate([[i, 3, 4] for i in range(n)], max_new_tokens=30, greedy=True)
        ks = [k for r in results for k in r.stats["k_history"][-10:]]
        mean_k[n] = sum(ks) / len(ks)
        # the fit recovers the synthetic growth (measured exactly: 1 ms a token)
        assert dec.cost_model()["target_fit"]["slope_s_per_token"] == pytest.approx(0.001)
    # the same on every run: one sequence at k = 4 over its last 10 steps, the batch at
    # ~0 (3 probes at k = 1 in 240 row-steps); on the wall clock the single sequence's mean had
    # ranged 1.8-3.2
    assert mean_k[1] >= 3 and mean_k[24] <= 0.5, mean_k


def test_cost_model_fits_measured_sizes_and_never_makes_a_longer_pass_cheaper():
    cm = _C.CostModel()
    assert cm.target_passes(1, 8) == pytest.approx([1.0 + 0.2 * i for i in range(8)])  # the prior
    cm.observe_target(1, 2.0)  # one size: the prior slope scaled through it
    assert cm.target_pass(5) == pytest.approx(2.0 * 1.8)
    cm.observe_target(3, 3.0)  # two sizes: a line through them
    assert cm.target_pass(2) == pytest.approx(2.5) and cm.target_pass(8) == pytest.approx(5.5)
    noisy = _C.CostModel()
    noisy.observe_target(1, 5.0)
    noisy.observe_target(2, 3.0)  # timed during a quiet spell: below the 1-token pass
    passes = noisy.target_passes(1, 9)
    assert all(b >= a for a, b in zip(passes, passes[1:])), passes
    # so k = 1 no longer looks free to a draft that is rarely right
    assert _C.best_k(0.1, 0.5, passes, 8) == 0


def test_the_fit_keeps_decode_sizes_accurate_next_to_prompt_passes():
    """A server's target passes: decode batches of 16-32 tokens (tens of ms) and whole
    prompts (over a second). The fit weighs relative errors, so 4 proposals on a batch
    of 16 rows cost what they were measured to cost; fitted unweighted (as before), the
    prompts set the line, the cost was flat up to 32 tokens and proposals looked free:
    n-gram auto then speculated at 0.5x of plain decoding's throughput under load."""
    cm = _C.CostModel()
    for t, s in ((16, 0.040), (20, 0.046), (32, 0.064), (700, 1.30), (900, 1.80)):
        cm.observe_target(t, s)
    assert cm.target_pass(16) == pytest.approx(0.040, rel=0.1)
    assert cm.target_pass(20) - cm.target_pass(16) >= 0.005
    assert cm.target_pass(32) == pytest.approx(0.064, rel=0.1)
    # 16 decode rows whose lookups are right 30% of the time: proposing does not pay
    assert _C.best_batch_k([0.3] * 16, [8] * 16, 0.0, cm) == [0] * 16
    # (the unweighted fit's flat 45 ms up to 32 tokens made it pay)
    flat = _C.CostModel()
    for t, s in ((16, 0.0454), (32, 0.0454), (700, 1.3601)):
        flat.observe_target(t, s)
    assert sum(_C.best_batch_k([0.3] * 16, [8] * 16, 0.0, flat)) > 0


def hinge_cost_model(knee=16, slope=1 / 16):
    """A target pass that costs 1 up to `knee` tokens (memory-bound), then grows by
    `slope` per token (compute-bound), measured at the sizes a decoder would see."""
    cm = _C.CostModel()
    for t in [*range(1, 17), 24, 32, 48, 64, 128, 256, 512]:
        cm.observe_target(t, 1.0 + slope * max(0, t - knee))
    return cm


def test_the_fit_finds_the_flat_part_and_the_slope():
    flat, knee, slope = hinge_cost_model().fit
    assert (flat, knee, slope) == pytest.approx((1.0, 16.0, 1 / 16))
    measured = hinge_cost_model().measured()
    assert [t for t, _ in measured][:3] == [1.0, 2.0, 3.0] and len(measured) == 23


@pytest.mark.parametrize("a", [0.5, 0.7, 0.9])
def test_k_falls_when_the_batch_makes_the_target_pass_compute_bound(a):
    """The batch effect: a batch of 64 rows chooses a smaller k than one row at the same
    acceptance, because every proposal lengthens the one target pass all rows share.
    Without batch awareness (each row's pass costed as if it ran alone, as before) both
    would get the one-row k: the last assertion is what that rule fails."""
    cm, draft = hinge_cost_model(), 0.02
    (alone,) = _C.best_batch_k([a], [8], draft, cm)
    batch = _C.best_batch_k([a] * 64, [8] * 64, draft, cm)
    assert alone >= 3
    assert max(batch) < alone
    # what a per-row rule would choose for each row of the batch: the one-row k
    per_row = _C.best_k(a, draft, cm.target_passes(1, 9), 8)
    assert per_row == alone and max(batch) < per_row
    # in between, k falls as the batch grows
    ks = [max(_C.best_batch_k([a] * n, [8] * n, draft, cm)) for n in (1, 4, 16, 64)]
    assert ks == sorted(ks, reverse=True) and ks[0] > ks[-1], ks


def test_the_rest_of_the_step_counts():
    """Rows decided elsewhere (64 decoding rows at k = 0) make the pass compute-bound for
    this row too; prefill tokens alone (which emit nothing) only add a fixed cost, which
    makes proposals relatively cheaper, never dearer."""
    cm = hinge_cost_model()
    (alone,) = _C.best_batch_k([0.8], [8], 0.02, cm)
    (busy,) = _C.best_batch_k([0.8], [8], 0.02, cm, rest_expected=64.0, rest_tokens=64)
    (prefill,) = _C.best_batch_k([0.8], [8], 0.02, cm, rest_tokens=300)
    assert busy < alone <= prefill
    with pytest.raises(ValueError, match=r"cap must hold one value per row \(2\), got 1"):
        _C.best_batch_k([0.8, 0.8], [8], 0.02, cm)


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("draft", [0.0, 0.1, 0.5, 3.0])
@pytest.mark.parametrize("slope", [0.0, 0.2, 1.0])
def test_probes_spend_at_most_the_budget(draft, slope, rows):
    # `rows` rows each probing every `interval` plain steps: rows / interval probes per
    # step on average, each costing a k = 1 step beyond a plain step
    target = [1.0 + slope * n for n in range(9)]
    interval = _C.probe_interval(draft, target, rows)
    probe_cost = draft + (target[1] - target[0])
    assert interval >= 8
    assert rows * probe_cost <= _C.PROBE_BUDGET * interval * target[0] * (1 + 1e-9)
    if interval > 8:  # and not more sparing than the budget requires
        assert rows * probe_cost > _C.PROBE_BUDGET * (interval - 1) * target[0]


def test_a_batch_shares_the_probe_budget():
    # power for the rows factor: a batch's rows probing at the one-row interval would
    # spend `rows` times the budget
    target = [1.0 + 0.2 * n for n in range(9)]
    alone = _C.probe_interval(0.0, target)
    batch = _C.probe_interval(0.0, target, 64)
    assert 64 * 0.2 > _C.PROBE_BUDGET * alone * target[0]  # the one-row interval overspends
    assert batch >= 64 * (alone - 1)


def test_adaptive_keeps_greedy_output_and_reports_a_time_split():
    target = CacheModel(13, seed=1)
    draft = CacheModel(13, base=target, noise=0.7, seed=2)
    plain = SpecDecoder(target, None, ops=reference, num_blocks=64, block_size=4)
    auto = SpecDecoder(target, draft, k="auto", ops=reference, num_blocks=64, block_size=4)
    auto_ng = SpecDecoder(target, NGram(1, 3), k="auto", ops=reference, num_blocks=64, block_size=4)
    want = [r.tokens for r in plain.generate([[1, 2], [3, 4, 5]], max_new_tokens=25, greedy=True)]
    for dec in (auto, auto_ng):
        results = dec.generate([[1, 2], [3, 4, 5]], max_new_tokens=25, greedy=True)
        assert [r.tokens for r in results] == want
        split = results[0].stats["time_split"]
        assert set(split) == {"draft_forward_s", "draft_sample_s", "target_forward_s", "verify_s",
                              "bookkeeping_s", "steps"}
        assert split["target_forward_s"] > 0
        assert split["steps"] == max(r.stats["steps"] for r in results)
    with pytest.raises(ValueError, match=r"k must be an int or 'auto', got 'fast'"):
        SpecDecoder(target, draft, k="fast", ops=reference)
    with pytest.raises(ValueError, match=r"max_k must be an int in \[1, 64\], got 0"):
        SpecDecoder(target, draft, k="auto", max_k=0, ops=reference)


def test_new_sequences_start_from_the_acceptance_every_sequence_showed():
    """A draft that never agrees: after one sequence the prior of the next is well below
    the uniform 0.5 (the first sequence started there); a draft that always agrees raises
    the prior."""
    target = CacheModel(50, seed=1, scale=4.0)
    useless = CacheModel(50, seed=9, scale=4.0)  # an unrelated table: ~no acceptance
    # k fixed: the trials do not depend on timing (the trackers learn at any k)
    dec = SpecDecoder(target, useless, k=3, ops=reference, num_blocks=64, block_size=4)
    assert dec.cost_model()["acceptance_prior"] == [0.5]  # nothing seen yet
    (first,) = dec.generate([[1, 2, 3]], max_new_tokens=60, greedy=True)
    prior = dec.cost_model()["acceptance_prior"][0]
    assert first.stats["accepted"] <= first.stats["proposed"] // 10, first.stats
    assert prior < 0.3, prior  # ~(0 + 1) / (8 + 2) for a draft that is never right
    twin = CacheModel(50, seed=1, scale=4.0)  # the target's own table: always right
    dec = SpecDecoder(target, twin, k=3, ops=reference, num_blocks=64, block_size=4)
    dec.generate([[1, 2, 3]], max_new_tokens=30, greedy=True)
    assert dec.cost_model()["acceptance_prior"][0] > 0.8
