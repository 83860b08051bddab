"""verify's invariants at awkward sizes, its expected progress, and the native ops
against the reference drawing the very same coins.

Complements tests/test_ops.py (contract, errors, exactness in distribution) and
tests/test_reference.py (the oracle on its own):

- invariants of every output on awkward sizes, for sampled, one-hot and ragged drafts;
  greedy mode against argmax decoding; a one-hot target always emits its token;
- expected progress: with acceptance probability a at every position the mean number
  of tokens per verify call is 1 + a + ... + a^K, within 4.5 standard errors (two-sided
  false-alarm rate 6.8e-6), and subtly wrong variants fall outside that band (power);
- same coins: a NumPy Philox4x32-10 of philox.h's stream layout feeds the reference the
  coins the native op draws, so the two must agree token for token, except where a
  coin lies within rounding of a decision boundary (those rows are found and excluded
  explicitly, and must be rare); the same holds for CUDA against the CPU.
"""

import math

import numpy as np
import pytest
import torch

from verispec import ops, reference


@pytest.fixture(autouse=True)
def one_torch_thread():
    # These tests run many small torch ops (the reference); on a busy 2-core machine
    # intra-op threads only add synchronisation (measured: 50x slower at B=99, V=111).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- a second implementation of the random stream (csrc/include/verispec/philox.h) -------

ACCEPT, CORRECTION, SAMPLE = 0, 1, 2  # philox.h Purpose values
_M0, _M1, _W0, _W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85
_MASK32 = 0xFFFFFFFF


def _philox_words(seed, offset, rows, positions, purpose):
    """Words 0 and 1 (uint64 arrays) of Philox4x32-10 of counter {position, row,
    lo32(offset), hi32(offset) & 0x0fffffff | purpose << 28} under key {lo32(seed),
    hi32(seed)}, broadcast over rows and positions."""
    rows, positions = np.broadcast_arrays(np.asarray(rows, dtype=np.uint64),
                                          np.asarray(positions, dtype=np.uint64))
    shape = rows.shape
    c0, c1 = positions.copy(), rows.copy()
    c2 = np.full(shape, offset & _MASK32, dtype=np.uint64)
    c3 = np.full(shape, ((offset >> 32) & 0x0FFFFFFF) | (purpose << 28), dtype=np.uint64)
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    lo, shift = np.uint64(_MASK32), np.uint64(32)
    for _ in range(10):
        p0, p1 = c0 * np.uint64(_M0), c2 * np.uint64(_M1)  # 32 x 32 -> 64 bits: exact
        c0, c1, c2, c3 = ((p1 >> shift) ^ c1 ^ np.uint64(k0), p1 & lo,
                          (p0 >> shift) ^ c3 ^ np.uint64(k1), p0 & lo)
        k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
    return c0, c1


def philox_uniform(seed, offset, rows, positions, purpose):
    """float32 coins uniform(seed, offset, row, position, purpose): word 0, top 24 bits."""
    c0, _ = _philox_words(seed, offset, rows, positions, purpose)
    return torch.from_numpy((c0 >> np.uint64(8)).astype(np.float32) * np.float32(2.0 ** -24))


def philox_draw(seed, offset, rows, positions, purpose):
    """float64 draws: the 64-bit coin (word 1 << 32 | word 0) / 2^64, the fraction the
    native ops' exact inverse CDF uses (rounded to a double)."""
    c0, c1 = _philox_words(seed, offset, rows, positions, purpose)
    return torch.from_numpy(c1.astype(np.float64) * 2.0 ** -32 + c0.astype(np.float64) * 2.0 ** -64)


class _TorchWithCoins:
    """The torch module, except that rand() hands out the given coins in call order."""

    def __init__(self, coins):
        self._coins = list(coins)

    def __getattr__(self, name):
        return getattr(torch, name)

    def rand(self, *size, generator=None, device=None, dtype=None):
        shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list)) else size
        coins = self._coins.pop(0)
        assert tuple(coins.shape) == tuple(shape), (coins.shape, shape)
        return coins.to(device=device, dtype=dtype or torch.float32)


def _shifted(u, shift):
    return (u.double() + shift).clamp(0.0, 1.0 - 2.0 ** -24).float()


def _shifted_draw(u, shift):
    return (u + shift).clamp(0.0, 1.0 - 2.0 ** -53)


def reference_verify_on_coins(target, drafts, q, *, seed, offset, shift=0.0, **kwargs):
    """reference.verify drawing the native op's Philox coins (each moved by `shift`).

    The reference draws its K acceptance coins, then one correction coin per row; the
    native op addresses the correction coin by the emitted position, which depends on
    the acceptances. So: a first pass finds num_accepted (it does not depend on the
    correction coins), a second pass hands in the coins at those positions.
    """
    b, k = drafts.shape
    rows = np.arange(b)[:, None]
    accept = _shifted(philox_uniform(seed, offset, rows, np.arange(k)[None, :], ACCEPT), shift)
    correction = _shifted_draw(philox_draw(seed, offset, rows, np.arange(k + 1)[None, :],
                                           CORRECTION), shift)

    def run(correction_coins):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(reference, "torch", _TorchWithCoins([accept, correction_coins]))
            return reference.verify(target, drafts, q, seed=seed, offset=offset, **kwargs)

    accepted = run(torch.zeros(b))[2].long()
    out = run(correction.gather(1, accepted[:, None]).squeeze(1))
    assert torch.equal(out[2].long(), accepted)
    return out


def reference_sample_on_coins(probs, *, seed, offset, shift=0.0):
    coins = _shifted_draw(philox_draw(seed, offset, np.arange(probs.shape[0]), 0, SAMPLE), shift)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(reference, "torch", _TorchWithCoins([coins]))
        return reference.sample(probs, seed=seed, offset=offset)


# A coin within `eps` of a decision boundary may legitimately decide differently in two
# implementations whose probabilities differ by rounding (float32 ulps; a float32 against
# a double accumulator): a row is fragile when moving all its coins by +-eps changes the
# reference's output. Each decision is monotone in its own coin, so a row that is not
# fragile decides alike for any perturbation of its coins within eps. The native ops sum
# in fixed point (2^-40 of the largest weight), the reference in double: eps 1e-6.
CPU_EPS = 1e-6


def fragile_verify_rows(target, drafts, q, *, eps, **kwargs):
    """[B] bool: rows whose reference output changes when every coin moves by +-eps."""
    mid = reference_verify_on_coins(target, drafts, q, **kwargs)
    fragile = torch.zeros(drafts.shape[0], dtype=torch.bool)
    for shift in (-eps, eps):
        moved = reference_verify_on_coins(target, drafts, q, shift=shift, **kwargs)
        for x, y in zip(moved, mid):
            fragile |= _differs(x, y)
    return fragile


def fragile_sample_rows(probs, *, eps, **kwargs):
    mid = reference_sample_on_coins(probs, **kwargs)
    fragile = torch.zeros(probs.shape[0], dtype=torch.bool)
    for shift in (-eps, eps):
        fragile |= reference_sample_on_coins(probs, shift=shift, **kwargs) != mid
    return fragile


def _differs(a, b):
    """Rows of two [B, ...] tensors that differ anywhere."""
    return (a != b).reshape(a.shape[0], -1).any(dim=1)


class SameExceptFragile:
    """Outputs of two implementations agree on every row, except rows that differ and are
    fragile (computed only when some row differs). Counts the differing rows, which a
    test bounds: rounding may excuse a few, not many."""

    def __init__(self):
        self.rows = self.differ = 0

    def check(self, got, want, fragile_rows):
        """got, want: tensors or tuples of [B, ...] tensors; fragile_rows() -> [B] bool."""
        got = got if isinstance(got, tuple) else (got,)
        want = want if isinstance(want, tuple) else (want,)
        differ = torch.zeros(got[0].shape[0], dtype=torch.bool)
        for g, w in zip(got, want):
            differ |= _differs(g.cpu(), w.cpu())
        self.rows += len(differ)
        if differ.any():
            robust = differ & ~fragile_rows()
            assert not robust.any(), (
                f"{int(robust.sum())} of {len(differ)} rows differ although no coin is near "
                f"a decision boundary, e.g. row {int(robust.nonzero()[0])}")
            self.differ += int(differ.sum())

    def assert_differ_at_most(self, fraction):
        assert self.differ <= fraction * self.rows, (
            f"{self.differ} of {self.rows} rows differ (at a rounding boundary; limit "
            f"{fraction:.0%})")


# --- inputs ---------------------------------------------------------------------------------

POLICIES = {
    "softmax": dict(),
    "all_knobs": dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02),
}


def logits_for(n, v, seed):
    return 3.0 * torch.randn(n, v, generator=torch.Generator().manual_seed(seed))


def draft_setup(b, k, v, seed, draft="sampled", noise=0.3):
    """Target logits [B, K+1, V]; drafts [B, K] and q (None for one-hot drafts) of a draft
    model whose logits are the target's plus noise, so every acceptance count occurs."""
    gen = torch.Generator().manual_seed(seed)
    target = 3.0 * torch.randn(b, k + 1, v, generator=gen)
    draft_logits = target[:, :k] + noise * 3.0 * torch.randn(b, k, v, generator=gen)
    if draft == "onehot":
        return target, draft_logits.argmax(dim=-1), None
    q = torch.softmax(draft_logits, dim=-1)
    drafts = torch.multinomial(q.view(b * k, v), 1, generator=gen).view(b, k)
    return target, drafts, q


# --- invariants on awkward sizes ----------------------------------------------------------

K = 3
# (B, V): every awkward batch with the small vocabulary, the larger vocabularies at
# batches that keep a case near 50 MB of logits (B = 989 only with V = 111, V = 49152
# only with B <= 8).
SIZES = [(1, 111), (99, 111), (989, 111), (1, 32000), (99, 32000), (1, 49152), (8, 49152)]
SIZE_IDS = [f"B{b}-V{v}" for b, v in SIZES]


def check_invariants(out, drafts, num_draft, v):
    tokens, emitted, accepted = out
    b = tokens.shape[0]
    assert tokens.shape == (b, K + 1) and tokens.dtype == torch.int32
    assert emitted.dtype == torch.int32 and accepted.dtype == torch.int32
    pad = tokens == -1
    assert torch.equal(pad.int().cummax(dim=1).values.bool(), pad), "a token after a -1"
    assert torch.equal(emitted, (~pad).sum(dim=1).int())
    assert torch.equal(emitted, accepted + 1)
    assert (accepted <= num_draft).all()
    assert ((tokens[~pad] >= 0) & (tokens[~pad] < v)).all()
    is_accepted = torch.arange(K)[None, :] < accepted[:, None]
    assert torch.equal(tokens[:, :K][is_accepted], drafts.int()[is_accepted])
    # After a rejection the correction comes from max(p - q, 0), which is 0 at the
    # rejected draft (a rejection means p(y) < q(y)); the roundoff fallback to p cannot
    # trigger on these inputs (p and q are far apart), so the draft never comes back.
    rows = torch.arange(b)
    rejected = accepted < num_draft
    at = accepted.long()[rejected]
    assert (tokens[rows[rejected], at] != drafts.int()[rows[rejected], at]).all()


@pytest.mark.parametrize(("b", "v"), SIZES, ids=SIZE_IDS)
def test_verify_invariants_at_awkward_sizes(b, v):
    seen_accepted = set()
    for draft in ("sampled", "onehot"):
        target, drafts, q = draft_setup(b, K, v, seed=b * v, draft=draft)
        num_draft = torch.randint(0, K + 1, (b,), generator=torch.Generator().manual_seed(v))
        for policy in POLICIES.values():
            for ragged in (False, True):
                nd = num_draft if ragged else torch.full((b,), K)
                out = ops.verify(target, drafts, q, num_draft=nd if ragged else None,
                                 seed=b, offset=v, **policy)
                check_invariants(out, drafts, nd.int(), v)
                seen_accepted.update(out[2].tolist())
    if b >= 99:  # the inputs exercise every outcome, from rejecting d1 to the bonus
        assert seen_accepted == set(range(K + 1)), seen_accepted


@pytest.mark.parametrize(("b", "v"), SIZES, ids=SIZE_IDS)
@pytest.mark.parametrize("draft", ["sampled", "onehot"])
def test_greedy_verify_is_argmax_decoding(b, v, draft):
    # Row r drafts the target's argmax at positions < cut[r], then a different token:
    # greedy verification must accept exactly cut[r] and emit the argmax at each position.
    target, _, q = draft_setup(b, K, v, seed=b + v, draft=draft)
    gen = torch.Generator().manual_seed(b)
    argmax = target.argmax(dim=-1)                                        # [B, K+1]
    cut = torch.randint(0, K + 1, (b,), generator=gen)
    wrong = (argmax[:, :K] + torch.randint(1, v, (b, K), generator=gen)) % v
    drafts = torch.where(torch.arange(K)[None, :] < cut[:, None], argmax[:, :K], wrong)
    for policy in ({}, dict(temperature=0.7, top_k=5, top_p=0.5)):  # greedy ignores them
        tokens, emitted, accepted = ops.verify(target, drafts, q, greedy=True, seed=1, **policy)
        assert torch.equal(accepted, cut.int())
        live = torch.arange(K + 1)[None, :] < emitted[:, None]
        assert torch.equal(tokens, torch.where(live, argmax, -1).int())


@pytest.mark.parametrize(("b", "v"), SIZES, ids=SIZE_IDS)
@pytest.mark.parametrize("draft", ["sampled", "onehot"])
def test_one_hot_target_always_emits_its_token(b, v, draft):
    # p is exactly one-hot under any policy (the other weights underflow to 0): a draft
    # equal to the hot token is always accepted (u * q < 1), any other always rejected
    # (p(y) = 0), and the correction or bonus is the hot token.
    gen = torch.Generator().manual_seed(v - b)
    hot = torch.randint(0, v, (b, K + 1), generator=gen)
    target = torch.randn(b, K + 1, v, generator=gen).scatter_(-1, hot[..., None], 1e3)
    other = (hot[:, :K] + torch.randint(1, v, (b, K), generator=gen)) % v
    drafts = torch.where(torch.rand(b, K, generator=gen) < 0.7, hot[:, :K], other)
    q = None if draft == "onehot" else torch.softmax(torch.randn(b, K, v, generator=gen), -1)
    matched = (drafts == hot[:, :K]).int().cumprod(dim=1).sum(dim=1)
    for policy in ({}, dict(temperature=1.6), POLICIES["all_knobs"]):
        for offset in range(3):
            tokens, emitted, accepted = ops.verify(target, drafts, q, seed=2, offset=offset,
                                                   **policy)
            assert torch.equal(accepted, matched.int())
            live = torch.arange(K + 1)[None, :] < emitted[:, None]
            assert torch.equal(tokens, torch.where(live, hot, -1).int())


# --- expected progress ------------------------------------------------------------------------


def constant_acceptance_inputs(n, k, a, draft, v=16, seed=0):
    """Rows whose acceptance probability sum_y min(p(y), q(y)) is exactly `a` at every
    position, with random distributions and vocabulary layout per (row, position).

    sampled: the vocabulary splits into random halves A and B; m and t live on B, s on A;
             p = a m + (1 - a) s and q = a m + (1 - a) t, so min(p, q) = a m: P(accept)
             = a, and each proposal (always in B) passes with probability p/q < 1;
    onehot:  q = one-hot(y) for a random y with p(y) = a: P(accept) = p(y) = a.
    Target logits are log p (-inf off its support).
    """
    gen = torch.Generator().manual_seed(seed)
    half = v // 2

    def on(support, shape):  # random distributions over the given token ids
        w = torch.softmax(torch.randn(*shape, half, generator=gen), dim=-1)
        return torch.zeros(*shape, v).scatter_(-1, support, w)

    layouts = torch.rand(1024, v, generator=gen).argsort(dim=-1)  # random permutations
    layout = layouts[torch.randint(0, 1024, (n, k + 1), generator=gen)]
    a_half, b_half = layout[..., :half], layout[..., half:]
    if draft == "sampled":
        m = on(b_half, (n, k + 1))
        p = a * m + (1 - a) * on(a_half, (n, k + 1))
        q = a * m[:, :k] + (1 - a) * on(b_half[:, :k], (n, k))
        # inverse CDF: the first token whose cumulative q exceeds u * total (q > 0 there)
        cdf = q.double().cumsum(dim=-1)
        u = torch.rand(n, k, 1, generator=gen, dtype=torch.float64)
        drafts = (cdf <= u * cdf[..., -1:]).sum(dim=-1)
    else:
        p, q = on(layout[..., :half], (n, k + 1)), None
        drafts = layout[:, :k, half]  # a token off p's support, given p(y) = a below
        p[:, :k] *= 1 - a
        p[:, :k].scatter_(-1, drafts[..., None], a)
    return p.log(), drafts, q


def progress_z(verify_fn, a, k, draft, n=100_000, seed=0):
    """z-score of the mean tokens per call against 1 + a + ... + a^k.

    num_accepted is i < k with probability a^i (1 - a), k with probability a^k, so its
    mean and variance are exact; z = (mean - expected) / sqrt(variance / n).
    """
    target, drafts, q = constant_acceptance_inputs(n, k, a, draft, seed=seed)
    _, emitted, _ = verify_fn(target, drafts, q, seed=seed, offset=7)
    law = torch.tensor([a ** i * (1 - a) for i in range(k)] + [a ** k], dtype=torch.float64)
    counts = torch.arange(1, k + 2, dtype=torch.float64)  # emitted = accepted + 1
    mean = (law * counts).sum()
    var = (law * (counts - mean) ** 2).sum()
    assert math.isclose(mean, sum(a ** i for i in range(k + 1)))
    return ((emitted.double().mean() - mean) / (var / n).sqrt()).item()


Z_BAND = 4.5  # two-sided false-alarm rate 2 * (1 - Phi(4.5)) = 6.8e-6 per case
PROGRESS_CASES = [(0.7, 4, "sampled"), (0.95, 7, "sampled"), (0.3, 3, "onehot"),
                  (0.8, 5, "onehot")]
POWER_CASES = [(0.7, 4, "sampled"), (0.8, 5, "onehot")]  # the reference runs these too


@pytest.mark.parametrize(
    ("impl", "a", "k", "draft"),
    [(ops.verify, *case) for case in PROGRESS_CASES]
    + [(reference.verify, *case) for case in POWER_CASES],
    ids=[f"native-a{a}-K{k}-{d}" for a, k, d in PROGRESS_CASES]
    + [f"reference-a{a}-K{k}-{d}" for a, k, d in POWER_CASES])
def test_expected_progress_matches_geometric_sum(impl, a, k, draft):
    z = progress_z(impl, a, k, draft)
    assert abs(z) < Z_BAND, f"mean tokens per call off by {z:.2f} standard errors"


def _without_bonus(target_logits, draft_tokens, draft_probs=None, **kwargs):
    # drops the bonus token when every proposal was accepted
    tokens, emitted, accepted = ops.verify(target_logits, draft_tokens, draft_probs, **kwargs)
    return tokens, emitted - (accepted == draft_tokens.shape[1]).int(), accepted


POWER_VARIANTS = {
    "native_without_bonus": (_without_bonus, None),
    "reference_accept_ignores_q": (reference.verify, lambda u, p_y, q_y: u < p_y),
    "reference_accept_inverted": (reference.verify, lambda u, p_y, q_y: u * p_y < q_y),
    "reference_accept_1pct_strict": (reference.verify, lambda u, p_y, q_y: u * q_y < 0.99 * p_y),
}


# With q(y) = 1 (one-hot drafts) ignoring q, or inverting the ratio to accept with
# probability min(1, 1/p(y)) = 1, is caught as well (or no bug): the sampled case suffices.
POWER_RUNS = [(variant, case) for variant in POWER_VARIANTS for case in POWER_CASES
              if case[2] == "sampled" or variant in ("native_without_bonus",
                                                     "reference_accept_1pct_strict")]


@pytest.mark.parametrize(("variant", "case"), POWER_RUNS,
                         ids=[f"{v}-a{a}-K{k}-{d}" for v, (a, k, d) in POWER_RUNS])
def test_expected_progress_rejects_wrong_variants(monkeypatch, variant, case):
    # the same statistic, rows and band as above; measured z: without bonus -49 / -54,
    # ignores q -327, inverted +453, 1% too strict -7.4 / -11.7
    verify_fn, wrong_accept = POWER_VARIANTS[variant]
    if wrong_accept is not None:
        monkeypatch.setattr(reference, "_accept", wrong_accept)
    z = progress_z(verify_fn, *case)
    assert abs(z) > Z_BAND, f"the wrong variant passed: z = {z:.2f}"


# --- the same coins: native against the reference, CUDA against the CPU --------------------


def test_philox_oracle_reproduces_the_native_coins():
    # With V = 4096 equal weights the exact inverse CDF returns floor(4096 c / 2^64): the
    # top 12 bits of every 64-bit draw, over all 64 bits of seed and 60 of offset.
    for seed, offset in ((0, 0), (3, 5), (12345678901234, 98765432109),
                         ((1 << 64) - 1, (1 << 60) - 1)):
        _, c1 = _philox_words(seed, offset, np.arange(3000), 0, SAMPLE)
        tokens = ops.sample(torch.ones(3000, 4096), seed=seed, offset=offset)
        assert torch.equal(tokens.long(), torch.from_numpy((c1 >> np.uint64(20)).astype(np.int64)))
    # and with weights 1, 3 the draw's first quarter picks token 0 (the acceptance coins of
    # word 0 are checked through verify below)
    d = philox_draw(7, 9, np.arange(2000), 0, SAMPLE)
    tokens = ops.sample(torch.tensor([[1.0, 3.0]]).expand(2000, 2).contiguous(), seed=7, offset=9)
    assert torch.equal(tokens.long(), (d >= 0.25).long())


SAME_COIN_SIZES = [(99, 111), (8, 32000), (1, 49152)]


@pytest.mark.parametrize(("b", "v"), SAME_COIN_SIZES,
                         ids=[f"B{b}-V{v}" for b, v in SAME_COIN_SIZES])
@pytest.mark.parametrize("draft", ["sampled", "onehot"])
def test_native_verify_equals_reference_on_the_same_coins(b, v, draft):
    target, drafts, q = draft_setup(b, K, v, seed=v + 1, draft=draft)
    num_draft = torch.randint(0, K + 1, (b,), generator=torch.Generator().manual_seed(b))
    same = SameExceptFragile()
    for policy in POLICIES.values():
        for offset, nd in ((0, None), (2**40 + 3, num_draft)):
            args = dict(seed=(1 << 63) + b, offset=offset, num_draft=nd, **policy)
            same.check(ops.verify(target, drafts, q, **args),
                       reference_verify_on_coins(target, drafts, q, **args),
                       lambda: fragile_verify_rows(target, drafts, q, eps=CPU_EPS, **args))
    same.assert_differ_at_most(0.01)


@pytest.mark.parametrize(("n", "v"), [(989, 111), (99, 32000)])
def test_native_sample_equals_reference_on_the_same_coins(n, v):
    same = SameExceptFragile()
    for policy in POLICIES.values():
        probs = ops.apply_policy(logits_for(n, v, seed=n), **policy)
        same.check(ops.sample(probs, seed=5, offset=6),
                   reference_sample_on_coins(probs, seed=5, offset=6),
                   lambda: fragile_sample_rows(probs, eps=CPU_EPS, seed=5, offset=6))
    same.assert_differ_at_most(0.01)


# (B, V) for the CUDA comparison: awkward batches and a 128k vocabulary.
CUDA_SIZES = [(989, 111), (99, 32000), (8, 49152), (4, 128256)]


@pytest.mark.cuda
@pytest.mark.parametrize(("b", "v"), CUDA_SIZES, ids=[f"B{b}-V{v}" for b, v in CUDA_SIZES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_ops_draw_the_cpu_tokens(b, v, dtype):
    """CUDA and CPU native ops on the same inputs, seed and offset give the same tokens and
    the same probabilities, bit for bit: every sum is a fixed-point integer sum and every
    float is computed alike (sampling_math.h), in greedy and sampled mode, every policy."""
    for draft in ("sampled", "onehot"):
        target, drafts, q = draft_setup(b, K, v, seed=v, draft=draft)
        target = target.to(dtype)
        num_draft = torch.randint(0, K + 1, (b,), generator=torch.Generator().manual_seed(v))
        on_cuda = [t.cuda() if t is not None else None for t in (target, drafts, q)]
        for policy in [dict(greedy=True)] + list(POLICIES.values()):
            for method in ("token", "block"):
                args = dict(num_draft=num_draft, seed=11, offset=v, method=method, **policy)
                got = ops.verify(*on_cuda, **dict(args, num_draft=num_draft.cuda()))
                want = ops.verify(target, drafts, q, **args)
                for x, y in zip(got, want):
                    assert torch.equal(x.cpu(), y), (draft, policy, method)

    # apply_policy, then sample, each on its own device
    logits = logits_for(b, v, seed=v + 2).to(dtype)
    for policy in POLICIES.values():
        probs_cuda = ops.apply_policy(logits.cuda(), **policy)
        probs = ops.apply_policy(logits, **policy)
        assert torch.equal(probs_cuda.cpu(), probs)
        assert torch.equal(ops.sample(probs_cuda, seed=9, offset=b).cpu(),
                           ops.sample(probs, seed=9, offset=b))
