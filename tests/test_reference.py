"""verispec.reference: policy semantics, verify's contract, and exactness in distribution."""

import math

import pytest
import scipy.stats
import torch

from exactness import ALPHA, EXACTNESS_CASES, joint_distribution_result
from verispec import reference


def logits_of(*probs):
    """Logits whose softmax is the given rows of probabilities."""
    return torch.tensor(probs, dtype=torch.float32).log()


def assert_probs(actual, expected):
    expected = torch.tensor(expected, dtype=torch.float32)
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(actual == 0, expected == 0), "dropped tokens must be exactly 0"


# --- apply_policy -------------------------------------------------------------------


def test_policy_defaults_are_softmax():
    x = torch.randn(7, 11)
    torch.testing.assert_close(reference.apply_policy(x), torch.softmax(x, dim=-1))


@pytest.mark.parametrize(
    ("temperature", "expected"),
    [(1.0, [1 / 7, 2 / 7, 4 / 7]), (0.5, [1 / 21, 4 / 21, 16 / 21]),
     (2.0, [1 / (3 + math.sqrt(2)), math.sqrt(2) / (3 + math.sqrt(2)), 2 / (3 + math.sqrt(2))])],
)
def test_policy_temperature(temperature, expected):
    assert_probs(reference.apply_policy(logits_of([1, 2, 4]), temperature=temperature),
                 [expected])


def test_policy_greedy_rows_are_one_hot_lowest_index_on_ties():
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, -1.0, 2.0, 5.0]])
    assert_probs(reference.apply_policy(x, temperature=0.0), [[0, 1, 0, 0], [1, 0, 0, 0]])
    # the other knobs do not matter for a greedy row
    assert_probs(reference.apply_policy(x, temperature=0.0, top_k=3, top_p=0.5, min_p=0.9),
                 [[0, 1, 0, 0], [1, 0, 0, 0]])


@pytest.mark.parametrize(
    ("probs", "top_k", "expected"),
    [
        ([0.4, 0.2, 0.2, 0.2], 1, [1, 0, 0, 0]),
        ([0.4, 0.2, 0.2, 0.2], 2, [0.4, 0.2, 0.2, 0.2]),  # ties with the 2nd are all kept
        ([0.1, 0.3, 0.3, 0.3], 1, [0, 1 / 3, 1 / 3, 1 / 3]),
        ([0.1, 0.2, 0.3, 0.4], 2, [0, 0, 3 / 7, 4 / 7]),
        ([0.1, 0.2, 0.3, 0.4], 4, [0.1, 0.2, 0.3, 0.4]),
        ([0.1, 0.2, 0.3, 0.4], 100, [0.1, 0.2, 0.3, 0.4]),  # k >= V keeps everything
    ],
)
def test_policy_top_k(probs, top_k, expected):
    assert_probs(reference.apply_policy(logits_of(probs), top_k=top_k), [expected])


@pytest.mark.parametrize(
    ("probs", "top_p", "expected"),
    [
        ([0.5, 0.3, 0.15, 0.05], 0.7, [0.625, 0.375, 0, 0]),
        ([0.5, 0.3, 0.15, 0.05], 0.9, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),
        ([0.5, 0.3, 0.15, 0.05], 0.3, [1, 0, 0, 0]),
        ([0.05, 0.15, 0.3, 0.5], 0.7, [0, 0, 0.375, 0.625]),  # order does not matter
        ([0.4, 0.2, 0.2, 0.2], 0.5, [0.4, 0.2, 0.2, 0.2]),    # ties at the threshold kept
    ],
)
def test_policy_top_p(probs, top_p, expected):
    assert_probs(reference.apply_policy(logits_of(probs), top_p=top_p), [expected])


def test_policy_top_p_uses_the_mass_that_survived_top_k():
    x = logits_of([0.4, 0.3, 0.2, 0.1])
    # top_k=2 leaves mass 0.7; half of it (0.35) is reached by the first token alone.
    assert_probs(reference.apply_policy(x, top_k=2, top_p=0.5), [[1, 0, 0, 0]])
    # measured against the full mass (0.5) it would take two tokens
    assert_probs(reference.apply_policy(x, top_p=0.5), [[4 / 7, 3 / 7, 0, 0]])


@pytest.mark.parametrize(
    ("min_p", "expected"),
    [
        (0.4, [0.625, 0.375, 0, 0]),                            # threshold 0.2
        (0.25, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),       # threshold 0.125
        (1.0, [1, 0, 0, 0]),
    ],
)
def test_policy_min_p(min_p, expected):
    assert_probs(reference.apply_policy(logits_of([0.5, 0.3, 0.15, 0.05]), min_p=min_p),
                 [expected])


def test_policy_order_temperature_then_top_k_then_top_p_then_min_p():
    x = logits_of([0.4, 0.3, 0.2, 0.1])
    # temperature 0.5 squares: [16, 9, 4, 1] / 30; top_k=3 drops 1/30; top_p=0.9 of 29/30
    # needs all three; min_p=0.3 drops 4/30 (< 0.3 * 16/30).
    assert_probs(reference.apply_policy(x, temperature=0.5, top_k=3, top_p=0.9, min_p=0.3),
                 [[16 / 25, 9 / 25, 0, 0]])


def test_policy_per_row_tensor_params_match_scalar_calls():
    x = torch.randn(4, 9, generator=torch.Generator().manual_seed(1))
    params = dict(temperature=[0.7, 0.0, 1.3, 1.0], top_k=[0, 3, 2, 5],
                  top_p=[0.8, 1.0, 0.5, 1.0], min_p=[0.0, 0.2, 0.1, 0.3])
    batched = reference.apply_policy(x, **{
        name: torch.tensor(values, dtype=torch.long if name == "top_k" else torch.float32)
        for name, values in params.items()})
    for i in range(4):
        row = reference.apply_policy(x[i:i + 1], **{n: v[i] for n, v in params.items()})
        torch.testing.assert_close(batched[i:i + 1], row, rtol=0, atol=0)
    # a 0-d tensor broadcasts like a scalar
    torch.testing.assert_close(reference.apply_policy(x, temperature=torch.tensor(0.7)),
                               reference.apply_policy(x, temperature=0.7))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_policy_half_precision_logits_computed_in_float32(dtype):
    x = (3 * torch.randn(5, 13, generator=torch.Generator().manual_seed(2))).to(dtype)
    for kwargs in ({}, dict(temperature=0.6, top_k=5, top_p=0.9, min_p=0.05)):
        probs = reference.apply_policy(x, **kwargs)
        assert probs.dtype == torch.float32
        torch.testing.assert_close(probs, reference.apply_policy(x.float(), **kwargs),
                                   rtol=0, atol=0)


def test_policy_masked_logits():
    x = torch.tensor([[0.0, -math.inf, 0.0, -math.inf]])
    assert_probs(reference.apply_policy(x), [[0.5, 0, 0.5, 0]])


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(temperature=-0.5), ValueError,
         "apply_policy: temperature must be finite and >= 0, got -0.5"),
        (dict(temperature=math.nan), ValueError, "temperature must be finite and >= 0, got nan"),
        (dict(top_k=-1), ValueError, "top_k must be >= 0"),
        (dict(top_k=2.0), TypeError, "top_k must be an int"),
        (dict(top_k=torch.tensor([1.0, 2.0])), ValueError, "top_k must be an integer tensor"),
        (dict(top_p=0.0), ValueError, r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), ValueError, r"top_p must be in \(0, 1\]"),
        (dict(min_p=2.0), ValueError, r"min_p must be in \[0, 1\]"),
        (dict(temperature=torch.ones(3)), ValueError,
         r"temperature must be a number or a 1-D tensor of length 2, got shape \[3\]"),
        (dict(temperature="hot"), TypeError, "temperature must be a number"),
    ],
)
def test_policy_bad_params(kwargs, error, message):
    with pytest.raises(error, match=message):
        reference.apply_policy(torch.zeros(2, 4), **kwargs)


@pytest.mark.parametrize(
    ("logits", "message"),
    [
        (torch.zeros(4), r"logits must be float32/bfloat16/float16 \[N, V\], got float32 \[4\]"),
        (torch.zeros(2, 4, dtype=torch.long), r"got int64 \[2, 4\]"),
        (torch.zeros(2, 0), "vocabulary V >= 1"),
        (torch.tensor([[0.0, math.nan]]), "finite or -inf"),
        (torch.tensor([[-math.inf, -math.inf]]), "every logit is -inf"),
    ],
)
def test_policy_bad_logits(logits, message):
    with pytest.raises(ValueError, match=message):
        reference.apply_policy(logits)


# --- sample -------------------------------------------------------------------------


def test_sample_is_deterministic_per_seed_and_offset():
    probs = torch.full((1000, 8), 1 / 8)
    a = reference.sample(probs, seed=3, offset=5)
    assert a.dtype == torch.int32 and a.shape == (1000,)
    assert torch.equal(a, reference.sample(probs, seed=3, offset=5))
    assert not torch.equal(a, reference.sample(probs, seed=3, offset=6))
    assert not torch.equal(a, reference.sample(probs, seed=4, offset=5))


def test_sample_distribution_and_zero_mass():
    expected = torch.tensor([0.1, 0.0, 0.2, 0.3, 0.0, 0.4])
    n = 40_000
    tokens = reference.sample(expected.expand(n, 6) * 3.0, seed=1)  # unnormalised is fine
    counts = torch.bincount(tokens.long(), minlength=6)
    assert chisquare_pvalue(counts, expected) > ALPHA, counts


@pytest.mark.parametrize(
    ("probs", "kwargs", "error", "message"),
    [
        (torch.ones(3), {}, ValueError, r"probs must be float32/bfloat16/float16 \[N, V\]"),
        (torch.tensor([[0.5, -0.5]]), {}, ValueError, "finite and non-negative"),
        (torch.tensor([[0.0, 0.0]]), {}, ValueError, "zero total probability"),
        (torch.ones(1, 2), dict(seed=-1), ValueError, r"seed must be an int in \[0, 2\*\*64\)"),
        (torch.ones(1, 2), dict(offset=1.5), TypeError,
         "offset must be an int or a one-element int64 tensor, got 1.5"),
    ],
)
def test_sample_bad_args(probs, kwargs, error, message):
    with pytest.raises(error, match=message):
        reference.sample(probs, **kwargs)


# --- verify: the contract -----------------------------------------------------------


def chisquare_pvalue(counts, probs):
    """Pearson chi-square p-value of integer counts against probabilities (zeros excluded)."""
    probs = probs.double() / probs.double().sum()
    support = probs > 0
    assert counts[~support].sum() == 0, "a zero-probability token was drawn"
    expected = probs[support] * counts.sum().double()
    return scipy.stats.chisquare(counts[support].double().numpy(), expected.numpy()).pvalue


def peaked_logits(argmax_per_position, vocab, height=4.0):
    """[B, P, V] logits with the given argmax at each position (random elsewhere)."""
    idx = torch.tensor(argmax_per_position)
    x = torch.randn(*idx.shape, vocab, generator=torch.Generator().manual_seed(0))
    return x.scatter(-1, idx[..., None], height + float(x.abs().amax()))


def check_contract(tokens, num_emitted, num_accepted, b, k):
    assert tokens.shape == (b, k + 1) and tokens.dtype == torch.int32
    assert num_emitted.shape == (b,) and num_emitted.dtype == torch.int32
    assert num_accepted.shape == (b,) and num_accepted.dtype == torch.int32
    assert torch.equal(num_emitted, num_accepted + 1)
    live = torch.arange(k + 1) < num_emitted[:, None].long()
    assert (tokens[live] >= 0).all()
    assert (tokens[~live] == -1).all()


@pytest.mark.parametrize("how", ["greedy", "temperature0", "top_k1"])
@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_verify_greedy_contract(how, with_draft_probs):
    # argmax p at positions 0..3 is 2, 4, 1, 3
    target = peaked_logits([[2, 4, 1, 3]] * 4, vocab=5)
    drafts = torch.tensor([[2, 4, 1], [2, 4, 0], [0, 4, 1], [2, 1, 1]])
    q = torch.softmax(torch.randn(4, 3, 5), dim=-1) if with_draft_probs else None
    kwargs = {"greedy": dict(greedy=True, temperature=0.9), "temperature0": dict(temperature=0.0),
              "top_k1": dict(top_k=1)}[how]
    for seed in range(3):
        tokens, num_emitted, num_accepted = reference.verify(target, drafts, q, seed=seed, **kwargs)
        check_contract(tokens, num_emitted, num_accepted, 4, 3)
        assert tokens.tolist() == [[2, 4, 1, 3], [2, 4, 1, -1], [2, -1, -1, -1], [2, 4, -1, -1]]
        assert num_accepted.tolist() == [3, 2, 0, 1]


def test_verify_per_row_greedy_and_temperature():
    target = peaked_logits([[1, 2, 0]] * 4, vocab=6, height=0.5)  # a soft peak
    drafts = torch.tensor([[1, 2]] * 4)
    for seed in range(20):
        out = reference.verify(target, drafts, None, seed=seed,
                               greedy=torch.tensor([True, False, False, True]),
                               temperature=torch.tensor([1.0, 0.0, 1.0, 1.0]))
        # rows 0, 1, 3 are greedy (flag or temperature 0): all accepted, bonus = argmax
        assert out[0][[0, 1, 3]].tolist() == [[1, 2, 0]] * 3


def test_verify_per_row_policy_matches_scalar_calls():
    # The same batch and seed draw the same uniforms, so a row with tensor params
    # must behave exactly as that row under the scalar call.
    gen = torch.Generator().manual_seed(4)
    target = torch.randn(6, 4, 7, generator=gen)
    q = torch.softmax(torch.randn(6, 3, 7, generator=gen), dim=-1)
    drafts = torch.multinomial(q.view(-1, 7), 1, generator=gen).view(6, 3)
    top_k = torch.tensor([0, 2, 0, 3, 1, 0])
    top_p = torch.tensor([1.0, 1.0, 0.6, 0.9, 1.0, 0.8])
    batched = reference.verify(target, drafts, q, top_k=top_k, top_p=top_p, seed=9, offset=2)
    for i in range(6):
        alone = reference.verify(target, drafts, q, top_k=int(top_k[i]),
                                 top_p=float(top_p[i]), seed=9, offset=2)
        for a, b in zip(batched, alone):
            assert torch.equal(a[i], b[i])


def test_verify_everything_accepted_when_q_equals_p():
    b, k, v = 3000, 4, 9
    gen = torch.Generator().manual_seed(5)
    target = torch.randn(b, k + 1, v, generator=gen)
    policy = dict(temperature=0.8, top_k=5, top_p=0.9)
    p = reference.apply_policy(target.view(-1, v), **policy).view(b, k + 1, v)
    drafts = torch.multinomial(p[:, :k].reshape(-1, v), 1, generator=gen).view(b, k)
    tokens, num_emitted, num_accepted = reference.verify(target, drafts, p[:, :k], **policy)
    check_contract(tokens, num_emitted, num_accepted, b, k)
    assert (num_accepted == k).all()
    assert torch.equal(tokens[:, :k], drafts.int())
    bonus = tokens[:, k].long()
    assert (p[torch.arange(b), k, bonus] > 0).all()


def test_verify_onehot_draft_outside_support_is_always_corrected():
    b, k, v = 2000, 2, 6
    target = torch.randn(b, k + 1, v, generator=torch.Generator().manual_seed(6))
    p = reference.apply_policy(target.view(-1, v), top_k=2).view(b, k + 1, v)
    drafts = target[:, :k].argmin(dim=-1)  # p(y) = 0 under top_k=2
    tokens, _, num_accepted = reference.verify(target, drafts, None, top_k=2)
    assert (num_accepted == 0).all()
    first = tokens[:, 0].long()
    assert (first != drafts[:, 0]).all()
    assert (p[torch.arange(b), 0, first] > 0).all()


@pytest.mark.parametrize("greedy", [True, False])
def test_verify_ragged_num_draft(greedy):
    # Drafts agree with the target argmax, so greedy accepts all num_draft of them and
    # the bonus comes from position num_draft (not K). Padding may hold any value.
    target = peaked_logits([[3, 1, 4, 2]] * 4, vocab=5, height=30.0)
    drafts = torch.tensor([[-1, 99, 99], [3, -7, 99], [3, 1, 50], [3, 1, 4]])
    num_draft = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    tokens, num_emitted, num_accepted = reference.verify(
        target, drafts, None, num_draft=num_draft, greedy=greedy, top_k=0 if greedy else 1)
    check_contract(tokens, num_emitted, num_accepted, 4, 3)
    assert num_accepted.tolist() == [0, 1, 2, 3]
    assert tokens.tolist() == [[3, -1, -1, -1], [3, 1, -1, -1], [3, 1, 4, -1], [3, 1, 4, 2]]
    # a list works as well as a tensor
    assert torch.equal(reference.verify(target, drafts, None, num_draft=[0, 1, 2, 3],
                                        greedy=True)[0], tokens)


def test_verify_k_zero_is_plain_sampling():
    target = torch.randn(500, 1, 4)
    tokens, num_emitted, num_accepted = reference.verify(
        target, torch.zeros(500, 0, dtype=torch.long), torch.zeros(500, 0, 4), seed=2)
    check_contract(tokens, num_emitted, num_accepted, 500, 0)
    assert (num_accepted == 0).all()


def test_verify_empty_batch():
    tokens, num_emitted, num_accepted = reference.verify(
        torch.zeros(0, 3, 5), torch.zeros(0, 2, dtype=torch.long), None)
    assert tokens.shape == (0, 3) and num_emitted.shape == num_accepted.shape == (0,)


def test_verify_randomness_is_addressed_by_seed_and_offset():
    gen = torch.Generator().manual_seed(7)
    target = torch.randn(400, 4, 6, generator=gen)
    drafts = torch.randint(0, 6, (400, 3), generator=gen)
    a = reference.verify(target, drafts, None, seed=1, offset=0)
    assert all(torch.equal(x, y) for x, y in zip(a, reference.verify(target, drafts, None,
                                                                     seed=1, offset=0)))
    assert not torch.equal(a[0], reference.verify(target, drafts, None, seed=1, offset=1)[0])
    assert not torch.equal(a[0], reference.verify(target, drafts, None, seed=2, offset=0)[0])


# --- verify: the roundoff rule ------------------------------------------------------


def test_correction_is_the_residual():
    p = torch.tensor([[0.6, 0.3, 0.1], [0.6, 0.3, 0.1]])
    q = torch.tensor([[0.2, 0.5, 0.3], [0.0, 1.0, 0.0]])  # a sampled draft, a one-hot draft
    assert_probs(reference._correction_distribution(p, q), [[1, 0, 0], [6 / 7, 0, 1 / 7]])


def test_correction_falls_back_to_p_when_residual_is_roundoff():
    p = torch.tensor([[0.5, 0.5], [0.25, 0.75], [0.25, 0.75]])
    q = torch.tensor([[0.5, 0.5], [0.25 - 4e-7, 0.75], [0.25 - 4e-6, 0.75]])
    assert reference.RESIDUAL_EPS == 1e-6
    assert_probs(reference._correction_distribution(p, q), [[0.5, 0.5], [0.25, 0.75], [1, 0]])


def test_verify_falls_back_to_p_when_a_rejection_leaves_no_residual():
    # q >= p everywhere (q not normalised) makes rejections possible with residual mass 0.
    b, v = 20_000, 4
    p = torch.tensor([0.1, 0.2, 0.3, 0.4])
    target = p.log().expand(b, 2, v)
    drafts = torch.full((b, 1), 3)
    q = p.clone()
    q[3] = 1.0
    tokens, _, num_accepted = reference.verify(target, drafts, q.expand(b, 1, v), seed=3)
    rejected = num_accepted == 0
    assert 0.5 < rejected.float().mean() < 0.7  # P(reject) = 1 - p(y)/q(y) = 0.6
    corrections = torch.bincount(tokens[rejected, 0].long(), minlength=v)
    # sampled from p, so the rejected token itself comes back in proportion to p
    assert corrections[3] > 0
    assert chisquare_pvalue(corrections, p) > ALPHA, corrections


# --- verify: argument checks --------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "message"),
    [
        ((torch.zeros(2, 5), torch.zeros(2, 3, dtype=torch.long), None), {}, ValueError,
         r"verify: target_logits must be float32/bfloat16/float16 \[B, K\+1, V\], "
         r"got float32 \[2, 5\]"),
        ((torch.zeros(2, 4, 5), torch.zeros(2, 2, dtype=torch.long), None), {}, ValueError,
         r"verify: draft_tokens must be an integer tensor \[B, K\] = \[2, 3\], got int64 \[2, 2\]"),
        ((torch.zeros(2, 4, 5), torch.zeros(2, 3), None), {}, ValueError,
         r"draft_tokens must be an integer tensor \[B, K\] = \[2, 3\], got float32 \[2, 3\]"),
        ((torch.zeros(2, 4, 5), torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 2, 5)), {},
         ValueError,
         r"verify: draft_probs must be float \[B, K, V\] = \[2, 3, 5\] or None, "
         r"got float32 \[2, 2, 5\]"),
        ((torch.zeros(2, 4, 5), torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, 5)),
         dict(num_draft=[1, 4]), ValueError, r"num_draft must be in \[0, K\] = \[0, 3\], got 4"),
        ((torch.zeros(2, 4, 5), torch.zeros(2, 3, dtype=torch.long), None),
         dict(num_draft=[1, 2, 3]), ValueError,
         r"num_draft must be an integer tensor \[B\] = \[2\], got int64 \[3\]"),
        ((torch.zeros(2, 4, 5), torch.tensor([[0, 5, 0], [0, 0, 0]]), None), {}, ValueError,
         r"draft_tokens must be in \[0, V\) = \[0, 5\), got 5"),
        ((torch.zeros(2, 4, 5), torch.zeros(2, 3, dtype=torch.long), None),
         dict(temperature=torch.ones(8)), ValueError,
         r"verify: temperature must be a number or a 1-D tensor of length 2, got shape \[8\]"),
        ((torch.zeros(2, 4, 5), torch.zeros(2, 3, dtype=torch.long), None),
         dict(greedy=torch.ones(2)), ValueError, r"greedy must be a bool or a bool tensor"),
        ((torch.zeros(2, 4, 5), torch.zeros(2, 3, dtype=torch.long), None),
         dict(greedy=1), TypeError, r"greedy must be a bool or a bool tensor"),
        ((torch.zeros(2, 4, 5), torch.zeros(2, 3, dtype=torch.long), None),
         dict(seed=-3), ValueError, r"verify: seed must be an int in \[0, 2\*\*64\), got -3"),
    ],
)
def test_verify_bad_args(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        reference.verify(*args, **kwargs)


# --- verify: exact in distribution --------------------------------------------------



@pytest.mark.parametrize("case", EXACTNESS_CASES.values(), ids=EXACTNESS_CASES.keys())
def test_verify_is_exact_in_distribution(case):
    result = joint_distribution_result(reference.verify, **case)
    assert result.p_value > ALPHA, result


# The power check: the same harness, at the same row count, must reject broken variants.
POWER_CASE = dict(draft_quality="poor", num_rows=60_000)


def test_power_case_passes_for_the_reference():
    result = joint_distribution_result(reference.verify, **POWER_CASE)
    assert result.p_value > ALPHA, result


@pytest.mark.parametrize("draft", ["sampled", "onehot"])
def test_harness_rejects_correction_sampled_from_p(monkeypatch, draft):
    # the classic bug: after a rejection, resample from p instead of the residual
    monkeypatch.setattr(reference, "_correction_distribution", lambda p, q: p)
    result = joint_distribution_result(reference.verify, draft=draft, **POWER_CASE)
    assert result.p_value < ALPHA, result


@pytest.mark.parametrize(
    "wrong_accept",
    [lambda u, p_y, q_y: u < p_y,            # ignores q: accepts with p(y), not p(y)/q(y)
     lambda u, p_y, q_y: u * p_y < q_y],     # the ratio upside down: min(1, q/p)
    ids=["ignores_q", "inverted_ratio"],
)
def test_harness_rejects_wrong_acceptance_test(monkeypatch, wrong_accept):
    monkeypatch.setattr(reference, "_accept", wrong_accept)
    result = joint_distribution_result(reference.verify, **POWER_CASE)
    assert result.p_value < ALPHA, result


def test_harness_rejects_bonus_from_the_last_position():
    # Ragged rows must take the bonus at position num_draft; reading position K (junk
    # in the harness) instead must be caught.
    def bonus_at_k(target_logits, draft_tokens, draft_probs=None, *, num_draft=None, **kw):
        k = draft_tokens.shape[1]
        shifted = target_logits.clone()
        rows = torch.arange(target_logits.shape[0])
        shifted[rows, num_draft.long()] = target_logits[:, k]
        return reference.verify(shifted, draft_tokens, draft_probs, num_draft=num_draft, **kw)

    result = joint_distribution_result(bonus_at_k, ragged=True, **POWER_CASE)
    assert result.p_value < ALPHA, result


def test_harness_catches_ignoring_num_draft():
    def ignores_num_draft(*args, num_draft=None, **kwargs):
        return reference.verify(*args, **kwargs)

    with pytest.raises(AssertionError, match="num_accepted > num_draft"):
        joint_distribution_result(ignores_num_draft, ragged=True, num_rows=2000)


# --- one set of argument checks for ops and reference -----------------------------------

_L, _T = torch.zeros(2, 4, 5), torch.zeros(2, 3, dtype=torch.long)  # [B, K+1, V], [B, K]
_TREE = (torch.zeros(2, 3, 5), torch.zeros(2, 2, dtype=torch.long),
         torch.full((2, 2), -1, dtype=torch.long))  # [B, N+1, V], tree_tokens, parents
SAME_MISTAKES = [  # (op, args, kwargs): each a mistake that verispec._args catches
    ("apply_policy", (torch.zeros(4),), {}),
    ("apply_policy", ([[0.0, 1.0]],), {}),
    ("apply_policy", (torch.zeros(2, 0),), {}),
    ("apply_policy", (torch.zeros(2, 4, dtype=torch.float64),), {}),
    ("apply_policy", (torch.zeros(2, 4),), dict(temperature=torch.ones(3))),
    ("apply_policy", (torch.zeros(2, 4),), dict(temperature="hot")),
    ("apply_policy", (torch.zeros(2, 4),), dict(top_p=True)),
    ("apply_policy", (torch.zeros(2, 4),), dict(top_k=2.0)),
    ("apply_policy", (torch.zeros(2, 4),), dict(top_k=torch.tensor([1.0, 2.0]))),
    ("apply_policy", (torch.zeros(2, 4),), dict(top_k=torch.tensor([True, False]))),
    ("sample", (torch.ones(3),), {}),
    ("sample", (torch.ones(1, 2),), dict(seed=-1)),
    ("sample", (torch.ones(1, 2),), dict(seed=1 << 64)),
    ("sample", (torch.ones(1, 2),), dict(offset=1.5)),
    ("sample", (torch.ones(1, 2),), dict(seed=torch.tensor([1, 2]))),
    ("sample", (torch.ones(1, 2),), dict(offset=torch.tensor(1.0))),
    ("sample", (torch.ones(2, 2),), dict(seeds=[1, 2])),
    ("sample", (torch.ones(2, 2),), dict(positions=[1, 2])),
    ("sample", (torch.ones(2, 2),), dict(seeds=[1], positions=[0, 0])),
    ("sample", (torch.ones(1, 2),), dict(seeds=[-1], positions=[0])),
    ("sample", (torch.ones(1, 2),), dict(seeds=[1], positions=[1 << 63])),
    ("sample", (torch.ones(1, 2),), dict(seeds=[1.0], positions=[0])),
    ("sample", (torch.ones(2, 2),), dict(seeds=torch.tensor([1.0, 2.0]), positions=[0, 0])),
    ("sample", (torch.ones(2, 2),), dict(seeds=[1, 2], positions=torch.tensor([0, 0, 0]))),
    ("verify", (torch.zeros(2, 5), _T), {}),
    ("verify", (torch.zeros(2, 0, 5), torch.zeros(2, 0)), {}),
    ("verify", (_L, torch.zeros(2, 2, dtype=torch.long)), {}),
    ("verify", (_L, torch.zeros(2, 3)), {}),
    ("verify", (_L, _T.tolist()), {}),
    ("verify", (_L, _T, torch.zeros(2, 2, 5)), {}),
    ("verify", (_L, _T, torch.zeros(2, 3, 5, dtype=torch.float64)), {}),
    ("verify", (_L, _T, [[0.0]]), {}),
    ("verify", (_L, _T), dict(num_draft=[1, 2, 3])),
    ("verify", (_L, _T), dict(num_draft=[1.0, 2.0])),
    ("verify", (_L, _T), dict(temperature=torch.ones(8))),
    ("verify", (_L, _T), dict(seed=-3)),
    ("verify", (_L, _T), dict(seed="3")),
    ("verify_keyed", (_L, _T), dict(seeds=None, positions=None)),
    ("verify_keyed", (_L, _T), dict(seeds=[1, 2], positions=None)),
    ("verify_keyed", (_L, torch.zeros(2, 2, dtype=torch.long)), dict(seeds=[1, 2],
                                                                     positions=[0, 0])),
    ("verify_tree", (torch.zeros(2, 0, 5),) + _TREE[1:], {}),
    ("verify_tree", (_TREE[0], torch.zeros(2, 3, dtype=torch.long), _TREE[2]), {}),
    ("verify_tree", (_TREE[0], _TREE[1], _TREE[2].float()), {}),
    ("verify_tree", _TREE + (torch.zeros(2, 2, 5),), {}),
    ("verify_tree", _TREE, dict(num_nodes=[1])),
    ("verify_tree", _TREE, dict(replacement=1)),
]


@pytest.mark.parametrize(("op", "args", "kwargs"), SAME_MISTAKES)
def test_ops_and_reference_word_the_same_mistake_alike(op, args, kwargs):
    from verispec import ops

    errors = []
    for module in (ops, reference):
        with pytest.raises((TypeError, ValueError)) as e:
            getattr(module, op)(*args, **kwargs)
        errors.append((type(e.value), str(e.value)))
    assert errors[0] == errors[1]
    assert errors[0][1].startswith(f"{op}: "), errors[0]


def test_reference_takes_seed_and_offset_tensors_as_the_ops_do():
    probs = torch.full((64, 8), 1 / 8)
    as_ints = reference.sample(probs, seed=3, offset=(1 << 64) - 5)
    as_tensors = reference.sample(probs, seed=torch.tensor([3]), offset=torch.tensor(-5))
    assert torch.equal(as_ints, as_tensors)
    assert not torch.equal(as_ints, reference.sample(probs, seed=4, offset=(1 << 64) - 5))
