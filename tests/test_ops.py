"""verispec.ops (native kernels) against verispec.reference, plus the ops' own contract:
errors, determinism, torch.library registration and torch.compile, exactness in
distribution (tests/exactness.py), and the CUDA path where a GPU is present."""

import math

import pytest
import torch

from exactness import ALPHA, EXACTNESS_CASES, joint_distribution_result
from verispec import ops, reference

POLICIES = {
    "softmax": dict(),
    "temperature": dict(temperature=0.6),
    "greedy": dict(temperature=0.0),
    "top_k": dict(top_k=20),
    "top_p": dict(top_p=0.8),
    "min_p": dict(min_p=0.05),
    "all": dict(temperature=1.3, top_k=50, top_p=0.9, min_p=0.02),
}


def logits_for(n, v, seed=0, dtype=torch.float32, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(n, v, generator=gen)).to(dtype)


def assert_same_policy(actual, expected):
    assert actual.dtype == torch.float32 and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(actual == 0, expected == 0), "kept sets differ"


# --- apply_policy ---------------------------------------------------------------------


# Every policy at every size, except that the largest size runs only the filters that
# need a selection (to keep the reference's sorts cheap).
POLICY_SIZES = [
    pytest.param(n, v, policy, id=f"{name}-N{n}-V{v}")
    for n in (1, 7, 99) for v in (111, 1000, 32000) for name, policy in POLICIES.items()
    if not (n == 99 and v == 32000 and name not in ("all", "top_p"))
]


@pytest.mark.parametrize(("n", "v", "policy"), POLICY_SIZES)
def test_apply_policy_matches_reference(n, v, policy):
    x = logits_for(n, v, seed=n * v)
    assert_same_policy(ops.apply_policy(x, **policy), reference.apply_policy(x, **policy))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("policy", [POLICIES["softmax"], POLICIES["all"]], ids=["softmax", "all"])
def test_apply_policy_half_precision_logits(dtype, policy):
    x = logits_for(13, 517, seed=3, dtype=dtype)
    assert_same_policy(ops.apply_policy(x, **policy), reference.apply_policy(x, **policy))
    assert_same_policy(ops.apply_policy(x, **policy), ops.apply_policy(x.float(), **policy))


def test_apply_policy_ties_and_masks():
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0], [0.0, -math.inf, 0.0, -math.inf],
                      [2.0, 2.0, 2.0, 2.0]])
    for policy in ({}, dict(temperature=0.0), dict(top_k=1), dict(top_p=0.3), dict(min_p=1.0)):
        assert_same_policy(ops.apply_policy(x, **policy), reference.apply_policy(x, **policy))
    torch.testing.assert_close(ops.apply_policy(x, temperature=0.0)[:, :3],
                               torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]))


def test_apply_policy_per_row_tensors_match_scalar_calls():
    x = logits_for(4, 300, seed=5)
    temperature = torch.tensor([0.0, 0.5, 1.0, 2.0])
    top_k = torch.tensor([0, 10, 300, 3])
    top_p = torch.tensor([1.0, 0.9, 0.5, 0.95])
    min_p = torch.tensor([0.0, 0.1, 0.0, 0.3])
    probs = ops.apply_policy(x, temperature, top_k, top_p, min_p)
    for i in range(4):
        row = ops.apply_policy(x[i:i + 1], float(temperature[i]), int(top_k[i]),
                               float(top_p[i]), float(min_p[i]))
        torch.testing.assert_close(probs[i:i + 1], row, rtol=0, atol=0)
    assert_same_policy(probs, reference.apply_policy(x, temperature, top_k, top_p, min_p))
    # a 0-d tensor is one value for every row
    assert_same_policy(ops.apply_policy(x, torch.tensor(0.7)), ops.apply_policy(x, 0.7))


def test_apply_policy_strided_and_empty_inputs():
    x = logits_for(6, 200, seed=8)
    view = x[::2, 10:150]  # row stride 400, last dim contiguous
    assert_same_policy(ops.apply_policy(view, top_p=0.9), reference.apply_policy(view, top_p=0.9))
    column = x.t()[:50]    # last dim strided: copied to contiguous first
    assert_same_policy(ops.apply_policy(column, top_k=2), reference.apply_policy(column, top_k=2))
    assert ops.apply_policy(torch.zeros(0, 7)).shape == (0, 7)


@pytest.mark.parametrize(
    ("logits", "kwargs", "error", "message"),
    [
        (torch.zeros(4), {}, ValueError,
         r"apply_policy: logits must be float32/bfloat16/float16 \[N, V\], got float32 \[4\]"),
        (torch.zeros(2, 4, dtype=torch.float64), {}, ValueError, r"got float64 \[2, 4\]"),
        ([[0.0, 1.0]], {}, TypeError, "logits must be a torch.Tensor, got list"),
        (torch.zeros(2, 0), {}, ValueError, "V >= 1"),
        (torch.tensor([[0.0, 1.0], [0.0, math.nan]]), {}, ValueError,
         r"apply_policy: logits must not contain NaN or \+Inf, got nan at logits\[1, 1\]"),
        (torch.tensor([[0.0, 1.0], [math.inf, 0.0]]), {}, ValueError,
         r"got inf at logits\[1, 0\]"),
        (torch.tensor([[0.0, 1.0], [-math.inf, -math.inf]]), {}, ValueError,
         r"finite value in every row \(this one is all -Inf\) at logits\[1\]"),
        (torch.zeros(2, 4), dict(temperature=-0.5), ValueError,
         r"apply_policy: temperature must be finite and >= 0, got -0.5"),
        (torch.zeros(2, 4), dict(temperature=math.inf), ValueError, "got inf"),
        (torch.zeros(2, 4), dict(temperature=math.nan), ValueError, "got nan"),
        (torch.zeros(2, 4), dict(top_k=-1), ValueError, r"apply_policy: top_k must be >= 0, got -1$"),
        (torch.zeros(2, 4), dict(top_k=2.0), TypeError, "top_k must be an int"),
        (torch.zeros(2, 4), dict(top_p=0.0), ValueError, r"top_p must be in \(0, 1\]"),
        (torch.zeros(2, 4), dict(top_p=1.5), ValueError, r"top_p must be in \(0, 1\], got 1.5"),
        (torch.zeros(2, 4), dict(min_p=2.0), ValueError, r"min_p must be in \[0, 1\]"),
        (torch.zeros(2, 4), dict(temperature="hot"), TypeError, "temperature must be a number"),
        (torch.zeros(2, 4), dict(top_p=True), TypeError, "top_p must be a number"),
        (torch.zeros(2, 4), dict(temperature=torch.ones(3)), ValueError,
         r"temperature must be a number or a 1-D tensor of length 2, got shape \[3\]"),
        (torch.zeros(2, 4), dict(top_k=torch.tensor([1.0, 2.0])), ValueError,
         "top_k must be an integer tensor"),
        # per-row values are checked by the kernel, which names the row
        (torch.zeros(2, 4), dict(temperature=torch.tensor([1.0, -2.0])), ValueError,
         r"temperature must be finite and >= 0, got -2 at temperature\[1\]"),
        (torch.zeros(2, 4), dict(top_p=torch.tensor([0.5, 1.5])), ValueError,
         r"top_p must be in \(0, 1\], got 1.5 at top_p\[1\]"),
        (torch.zeros(2, 4), dict(top_k=torch.tensor([3, -1])), ValueError,
         r"top_k must be >= 0, got -1 at top_k\[1\]"),
        (torch.zeros(2, 4), dict(min_p=torch.tensor([-0.5, 0.0])), ValueError,
         r"min_p must be in \[0, 1\], got -0.5 at min_p\[0\]"),
    ],
)
def test_apply_policy_errors(logits, kwargs, error, message):
    with pytest.raises(error, match=message):
        ops.apply_policy(logits, **kwargs)


# --- sample ---------------------------------------------------------------------------


def test_sample_is_deterministic_per_seed_and_offset():
    probs = torch.full((1000, 8), 1 / 8)
    a = ops.sample(probs, seed=3, offset=5)
    assert a.dtype == torch.int32 and a.shape == (1000,)
    assert torch.equal(a, ops.sample(probs, seed=3, offset=5))
    assert torch.equal(a, ops.sample(probs, seed=torch.tensor(3), offset=torch.tensor([5])))
    assert not torch.equal(a, ops.sample(probs, seed=3, offset=6))
    assert not torch.equal(a, ops.sample(probs, seed=4, offset=5))
    assert not torch.equal(a, ops.sample(probs, seed=3 + (1 << 40), offset=5))  # all 64 bits
    top = ops.sample(probs, seed=(1 << 64) - 1, offset=(1 << 60) - 1)
    assert ((top >= 0) & (top < 8)).all()


def chisquare_pvalue(counts, probs):
    import scipy.stats

    probs = probs.double() / probs.double().sum()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a zero-probability token was drawn"
    expected = probs[keep] * counts.sum()
    return scipy.stats.chisquare(counts[keep].double().numpy(), expected.numpy()).pvalue


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sample_distribution_and_zero_mass(dtype):
    expected = torch.tensor([0.125, 0.0, 0.25, 0.125, 0.0, 0.5])
    n = 40_000
    tokens = ops.sample((expected.expand(n, 6) * 3.0).to(dtype), seed=1)  # unnormalised
    counts = torch.bincount(tokens.long(), minlength=6)
    assert chisquare_pvalue(counts, expected) > ALPHA, counts


@pytest.mark.parametrize(
    ("probs", "kwargs", "error", "message"),
    [
        (torch.ones(3), {}, ValueError, r"sample: probs must be float32/bfloat16/float16 \[N, V\]"),
        (torch.tensor([[0.5, 0.5], [0.5, -0.5]]), {}, ValueError,
         r"sample: probs must be finite and >= 0, got -0.5 at probs\[1, 1\]"),
        (torch.tensor([[0.5, math.nan]]), {}, ValueError, r"got nan at probs\[0, 1\]"),
        (torch.tensor([[0.5, 0.5], [0.0, 0.0]]), {}, ValueError,
         r"sample: probs row has zero total mass at probs\[1\]"),
        (torch.ones(1, 2), dict(seed=-1), ValueError, r"sample: seed must be an int in \[0, 2\*\*64\), got -1"),
        (torch.ones(1, 2), dict(seed=1 << 64), ValueError, r"seed must be an int in \[0, 2\*\*64\)"),
        (torch.ones(1, 2), dict(offset=1 << 60), ValueError, r"offset must be an int in \[0, 2\*\*60\)"),
        (torch.ones(1, 2), dict(offset=1.5), TypeError, "offset must be an int or a one-element int64 tensor"),
        (torch.ones(1, 2), dict(seed=torch.tensor([1, 2])), ValueError,
         r"seed must be an int or a one-element int64 tensor, got int64 \[2\]"),
        (torch.ones(1, 2), dict(seed=torch.tensor(1.0)), ValueError, "one-element int64 tensor"),
    ],
)
def test_sample_errors(probs, kwargs, error, message):
    with pytest.raises(error, match=message):
        ops.sample(probs, **kwargs)


# --- verify: the contract -------------------------------------------------------------


def verify_inputs(b=6, k=4, v=50, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    target = (2 * torch.randn(b, k + 1, v, generator=gen)).to(dtype)
    drafts = torch.randint(0, v, (b, k), generator=gen)
    q = torch.softmax(torch.randn(b, k, v, generator=gen), dim=-1)
    return target, drafts, q


@pytest.mark.parametrize("how", [dict(greedy=True), dict(temperature=0.0),
                                 dict(greedy=True, temperature=0.7, top_k=3)])
@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_verify_greedy_contract_equals_reference(how, with_draft_probs):
    target, drafts, q = verify_inputs(b=40, k=5, v=30, seed=1)
    argmax = target.argmax(dim=-1)[:, :5]
    # row b drafts the argmax for its first b % 6 positions, then a different token
    match = torch.arange(5)[None, :] < (torch.arange(40) % 6)[:, None]
    drafts = torch.where(match, argmax, (argmax + 1 + drafts % 29) % 30)
    q = q if with_draft_probs else None
    got = ops.verify(target, drafts, q, seed=1, **how)
    want = reference.verify(target, drafts, q, seed=7, **how)  # greedy ignores the coins
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert torch.equal(got[2], (torch.arange(40) % 6).clamp(max=5).int())


def test_verify_per_row_greedy_and_policy():
    target, drafts, q = verify_inputs(b=4, k=3, v=20, seed=2)
    greedy = torch.tensor([True, False, True, False])
    temperature = torch.tensor([0.5, 0.0, 1.0, 1.0])
    tokens, emitted, accepted = ops.verify(target, drafts, q, greedy=greedy,
                                           temperature=temperature, seed=4)
    ref = reference.verify(target, drafts, q, greedy=greedy, temperature=temperature, seed=4)
    for row in (0, 1, 2):  # greedy rows (flag or temperature 0) are deterministic
        assert torch.equal(tokens[row], ref[0][row]) and emitted[row] == ref[1][row]
    # per-row tensors equal scalar calls, row by row (coins are addressed by row index)
    top_k = torch.tensor([0, 2, 5, 20])
    top_p = torch.tensor([0.5, 1.0, 0.9, 0.7])
    full = ops.verify(target, drafts, q, top_k=top_k, top_p=top_p, seed=9, offset=3)
    for row in range(4):
        scalar = ops.verify(target, drafts, q, top_k=int(top_k[row]), top_p=float(top_p[row]),
                            seed=9, offset=3)
        assert all(torch.equal(f[row], s[row]) for f, s in zip(full, scalar))


def test_verify_rows_draw_coins_by_row_index():
    target, drafts, q = verify_inputs(b=8, k=4, v=40, seed=3)
    same = target[:1].expand(8, -1, -1).contiguous()
    d = drafts[:1].expand(8, -1).contiguous()
    tokens, emitted, _ = ops.verify(same, d, q[:1].expand(8, -1, -1).contiguous(), seed=5)
    assert len({tuple(t[:e].tolist()) for t, e in zip(tokens, emitted)}) > 1
    a = ops.verify(target, drafts, q, seed=5, offset=11)
    assert all(torch.equal(x, y) for x, y in zip(a, ops.verify(target, drafts, q, seed=5, offset=11)))
    b = ops.verify(target, drafts, q, seed=5, offset=12)
    assert not all(torch.equal(x, y) for x, y in zip(a, b))


def test_verify_everything_accepted_when_q_equals_p():
    target, _, _ = verify_inputs(b=30, k=4, v=25, seed=4)
    policy = dict(temperature=0.8, top_k=10, top_p=0.9)
    p = ops.apply_policy(target.reshape(-1, 25), **policy).view(30, 5, 25)
    drafts = ops.sample(p[:, :4].reshape(-1, 25), seed=2).view(30, 4)
    for offset in range(5):
        tokens, emitted, accepted = ops.verify(target, drafts, p[:, :4], seed=1, offset=offset,
                                               **policy)
        assert (accepted == 4).all() and (emitted == 5).all()
        assert torch.equal(tokens[:, :4], drafts.int())


def test_verify_onehot_draft_outside_support_is_always_corrected():
    target = torch.tensor([[[0.0, 0.0, -math.inf, 0.0], [0.0, 0.0, 0.0, 0.0]]]).expand(500, 2, 4)
    drafts = torch.full((500, 1), 2)
    tokens, emitted, accepted = ops.verify(target, drafts, None, seed=1)
    assert (accepted == 0).all() and (tokens[:, 0] != 2).all() and (tokens[:, 1] == -1).all()


@pytest.mark.parametrize("greedy", [False, True])
def test_verify_ragged_num_draft_and_padding(greedy):
    target, drafts, q = verify_inputs(b=5, k=4, v=30, seed=6)
    num_draft = torch.tensor([0, 1, 4, 2, 3])
    # junk past num_draft is never read or checked
    drafts[0, :] = -7
    drafts[3, 2:] = 10**6
    target[1, 2:] = math.nan
    for offset in range(20):
        tokens, emitted, accepted = ops.verify(target, drafts, q, num_draft=num_draft,
                                               greedy=greedy, seed=2, offset=offset)
        assert (accepted <= num_draft.int()).all() and torch.equal(emitted, accepted + 1)
        pos = torch.arange(5)
        assert (tokens[pos[None, :] >= emitted[:, None]] == -1).all()
        live = tokens[pos[None, :] < emitted[:, None]]
        assert ((live >= 0) & (live < 30)).all()
    assert torch.equal(
        ops.verify(target, drafts, q, num_draft=[0, 1, 4, 2, 3], seed=2)[0],
        ops.verify(target, drafts, q, num_draft=num_draft.int(), seed=2)[0])


def test_verify_k_zero_and_empty_batch():
    target = logits_for(3, 9, seed=1).view(3, 1, 9)
    tokens, emitted, accepted = ops.verify(target, torch.zeros(3, 0, dtype=torch.long))
    assert tokens.shape == (3, 1) and (emitted == 1).all() and (accepted == 0).all()
    empty = ops.verify(torch.zeros(0, 3, 5), torch.zeros(0, 2, dtype=torch.long))
    assert [t.shape for t in empty] == [(0, 3), (0,), (0,)]


def test_verify_roundoff_falls_back_to_p():
    # p(y) = 0 under top-k 1 while q puts mass on y and everywhere p does: every proposal
    # is rejected and max(p - q, 0) has no mass, so the correction comes from p.
    target = torch.tensor([[[0.0, 1.0, 3.0], [0.0, 0.0, 0.0]]]).expand(200, 2, 3)
    q = torch.tensor([0.5, 0.0, 1.0]).expand(200, 1, 3)
    tokens, _, accepted = ops.verify(target, torch.zeros(200, 1, dtype=torch.long), q, top_k=1,
                                     seed=3)
    assert (accepted == 0).all() and (tokens[:, 0] == 2).all()


def test_verify_bfloat16_logits_equal_their_float32_values():
    target, drafts, q = verify_inputs(b=16, k=3, v=64, seed=7, dtype=torch.bfloat16)
    a = ops.verify(target, drafts, q, top_p=0.9, seed=3)
    b = ops.verify(target.float(), drafts, q, top_p=0.9, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


B, K, V = 2, 3, 5


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "message"),
    [
        ((torch.zeros(2, 5), torch.zeros(2, 3, dtype=torch.long)), {}, ValueError,
         r"verify: target_logits must be float32/bfloat16/float16 \[B, K\+1, V\], got float32 \[2, 5\]"),
        ((torch.zeros(B, 0, V), torch.zeros(B, 0)), {}, ValueError, r"K\+1 >= 1"),
        ((torch.zeros(B, K + 1, V), torch.zeros(B, K - 1, dtype=torch.long)), {}, ValueError,
         r"verify: draft_tokens must be an integer tensor \[B, K\] = \[2, 3\], got int64 \[2, 2\]"),
        ((torch.zeros(B, K + 1, V), torch.zeros(B, K)), {}, ValueError,
         r"draft_tokens must be an integer tensor \[B, K\] = \[2, 3\], got float32 \[2, 3\]"),
        ((torch.zeros(B, K + 1, V), torch.zeros(B, K, dtype=torch.long), torch.zeros(B, K - 1, V)),
         {}, ValueError,
         r"verify: draft_probs must be float \[B, K, V\] = \[2, 3, 5\] or None, got float32 \[2, 2, 5\]"),
        ((torch.zeros(B, K + 1, V), torch.zeros(B, K, dtype=torch.long),
          torch.zeros(B, K, V, dtype=torch.float64)), {}, ValueError,
         r"draft_probs must be float32/bfloat16/float16 \[B, K, V\], got float64"),
        ((torch.zeros(B, K + 1, V), torch.tensor([[0, 5, 0], [0, 0, 0]])), {}, ValueError,
         r"verify: draft_tokens must be in \[0, V\) = \[0, 5\), got 5 at draft_tokens\[0, 1\]"),
        ((torch.zeros(B, K + 1, V), torch.tensor([[0, 0, 0], [0, 0, -1]])), {}, ValueError,
         r"got -1 at draft_tokens\[1, 2\]"),
        ((torch.zeros(B, K + 1, V), torch.tensor([[0, 0, 0], [0, 1 << 40, 0]])), {}, ValueError,
         r"draft_tokens must be in \[0, V\) = \[0, 5\), got 2147483647 at draft_tokens\[1, 1\]"),
        ((torch.zeros(B, K + 1, V), torch.zeros(B, K, dtype=torch.long)),
         dict(num_draft=[1, 4]), ValueError,
         r"verify: num_draft must be in \[0, K\] = \[0, 3\], got 4 at num_draft\[1\]"),
        ((torch.zeros(B, K + 1, V), torch.zeros(B, K, dtype=torch.long)),
         dict(num_draft=[-1, 0]), ValueError, r"got -1 at num_draft\[0\]"),
        ((torch.zeros(B, K + 1, V), torch.zeros(B, K, dtype=torch.long)),
         dict(num_draft=[1, 2, 3]), ValueError,
         r"num_draft must be an integer tensor \[B\] = \[2\], got int64 \[3\]"),
        ((torch.zeros(B, K + 1, V).index_fill_(2, torch.tensor([3]), math.nan),
          torch.zeros(B, K, dtype=torch.long)), {}, ValueError,
         r"verify: target_logits must not contain NaN or \+Inf, nor a row of only -Inf, "
         r"got nan at target_logits\[0, 0\]"),
        ((torch.zeros(B, K + 1, V).index_fill_(1, torch.tensor([2]), -math.inf),
          torch.zeros(B, K, dtype=torch.long)), {}, ValueError,
         r"nor a row of only -Inf at target_logits\[0, 2\]"),
        ((torch.zeros(B, K + 1, V), torch.zeros(B, K, dtype=torch.long),
          torch.full((B, K, V), 0.2).index_fill_(2, torch.tensor([0]), -1.0)), {}, ValueError,
         r"verify: draft_probs must be finite and >= 0, got -1 at draft_probs\[0, 0\]"),
        ((torch.zeros(B, K + 1, V), torch.zeros(B, K, dtype=torch.long)),
         dict(temperature=-1.0), ValueError, r"verify: temperature must be finite and >= 0, got -1$"),
        ((torch.zeros(B, K + 1, V), torch.zeros(B, K, dtype=torch.long)),
         dict(top_p=torch.tensor([1.0, 0.0])), ValueError,
         r"verify: top_p must be in \(0, 1\], got 0 at top_p\[1\]"),
        ((torch.zeros(B, K + 1, V), torch.zeros(B, K, dtype=torch.long)),
         dict(temperature=torch.ones(8)), ValueError,
         r"verify: temperature must be a number or a 1-D tensor of length 2, got shape \[8\]"),
        ((torch.zeros(B, K + 1, V), torch.zeros(B, K, dtype=torch.long)),
         dict(greedy=torch.ones(2)), ValueError, r"greedy must be a bool or a bool tensor \[B\] = \[2\]"),
        ((torch.zeros(B, K + 1, V), torch.zeros(B, K, dtype=torch.long)),
         dict(greedy=1), TypeError, r"greedy must be a bool or a bool tensor"),
        ((torch.zeros(B, K + 1, V), torch.zeros(B, K, dtype=torch.long)),
         dict(seed=-3), ValueError, r"verify: seed must be an int in \[0, 2\*\*64\), got -3"),
        ((torch.zeros(B, K + 1, V), torch.zeros(B, K, dtype=torch.long)),
         dict(offset=1 << 61), ValueError, r"verify: offset must be an int in \[0, 2\*\*60\)"),
    ],
)
def test_verify_errors(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        ops.verify(*args, **kwargs)


def test_native_binding_checks_every_tensor():
    # The binding checks what reaches it too, for callers of verispec._C.
    from verispec import _C

    tokens = torch.empty(B, K + 1, dtype=torch.int32)
    counts = torch.empty(B, dtype=torch.int32)
    args = [torch.zeros(B, K + 1, V), torch.zeros(B, K, dtype=torch.int32), None, None,
            tokens, counts, counts.clone(), 1.0, 0, 1.0, 0.0, 0, 0]
    bad = list(args)
    bad[2] = torch.zeros(B, K, V, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"verify: draft_probs must be float32 \[B, K, V\] = "
                                         r"\[2, 3, 5\], got bfloat16 \[2, 3, 5\]"):
        _C.verify(*bad)
    bad = list(args)
    bad[4] = torch.empty(B, K + 1, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"verify: tokens must be int32 \[B, K\+1\] = \[2, 4\], got int64"):
        _C.verify(*bad)
    bad = list(args)
    bad[1] = "tokens"
    with pytest.raises(TypeError, match="verify: draft_tokens must be a tensor supporting __dlpack__"):
        _C.verify(*bad)
    with pytest.raises(ValueError, match=r"apply_policy: probs must be float32 \[N, V\] = \[2, 4\]"):
        _C.apply_policy(torch.zeros(2, 4), torch.zeros(2, 5), 1.0, 0, 1.0, 0.0)
    with pytest.raises(ValueError, match="probs row stride must be >= vocab"):
        _C.apply_policy(torch.zeros(2, 4), torch.zeros(1, 4).expand(2, 4), 1.0, 0, 1.0, 0.0)
    _C.verify(*args)
    assert (counts == 1).all()


# --- torch.library and torch.compile ---------------------------------------------------


def test_custom_ops_pass_opcheck():
    target, drafts, q = verify_inputs(b=3, k=2, v=11, seed=9)
    torch.library.opcheck(torch.ops.verispec.apply_policy.default,
                          (target[:, 0], 0.7, 3, 0.9, 0.0, None, None, None, None))
    torch.library.opcheck(torch.ops.verispec.sample.default,
                          (torch.rand(4, 11), 5, 1, None, None))
    torch.library.opcheck(torch.ops.verispec.verify.default,
                          (target, drafts.int(), q, None, 1.0, 0, 1.0, 0.0, None, None, None,
                           None, 3, 4, None, None))


def test_eager_calls_skip_the_dispatcher_and_match_the_registered_ops():
    """Eager ops call the implementation directly (no torch._dynamo import on the first
    call, no dispatch overhead) and give what the registered torch.library op gives."""
    import subprocess
    import sys
    code = (
        "import sys, torch\n"
        "from verispec import ops\n"
        "t = torch.randn(2, 3, 7)\n"
        "p = ops.apply_policy(t[:, 0], temperature=0.9, top_k=4)\n"
        "ops.sample(p, seed=1)\n"
        "ops.verify(t, torch.zeros(2, 2, dtype=torch.int32), seed=2)\n"
        "assert 'torch._dynamo' not in sys.modules, 'the eager path went through dispatch'\n")
    subprocess.run([sys.executable, "-c", code], check=True)
    target, drafts, q = verify_inputs(b=3, k=2, v=11, seed=9)
    assert torch.equal(ops.apply_policy(target[:, 0], 0.7, 3, 0.9),
                       torch.ops.verispec.apply_policy(target[:, 0], 0.7, 3, 0.9, 0.0,
                                                       None, None, None, None))
    got = ops.verify(target, drafts, q, temperature=0.7, seed=3, offset=4)
    want = torch.ops.verispec.verify(target, drafts.int(), q, None, 0.7, 0, 1.0, 0.0, None, None,
                                     None, None, 3, 4, None, None)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_ops_compile_fullgraph(backend):
    target, drafts, q = verify_inputs(b=5, k=3, v=40, seed=10)

    def step(target, drafts, q, offset):
        probs = ops.apply_policy(target[:, 0], temperature=0.8, top_p=0.9)
        tokens = ops.sample(probs, seed=1, offset=offset)
        out = ops.verify(target, drafts, q, temperature=0.8, top_p=0.9, seed=1, offset=offset)
        return probs, tokens, *out

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    for offset in (0, 1, torch.tensor(2)):
        for got, want in zip(compiled(target, drafts, q, offset), step(target, drafts, q, offset)):
            assert torch.equal(got, want)


# --- verify: exact in distribution ------------------------------------------------------



@pytest.mark.parametrize("case", EXACTNESS_CASES.values(), ids=EXACTNESS_CASES.keys())
def test_verify_is_exact_in_distribution(case):
    result = joint_distribution_result(ops.verify, **case)
    assert result.p_value > ALPHA, result


# Power: the same harness at the same row count rejects the native op used wrongly, so a
# pass above means something.
POWER_CASE = dict(draft_quality="poor", num_rows=60_000)


def test_power_correction_resampled_from_p_is_caught():
    # the classic bug, built from the native ops: after a rejection, emit a fresh sample
    # of p instead of the residual's
    def correction_from_p(target_logits, draft_tokens, draft_probs=None, *, num_draft=None,
                          greedy=False, seed=0, offset=0, **policy):
        tokens, emitted, accepted = ops.verify(target_logits, draft_tokens, draft_probs,
                                               num_draft=num_draft, greedy=greedy, seed=seed,
                                               offset=offset, **policy)
        rows = torch.arange(target_logits.shape[0])
        at = accepted.long()
        p = ops.apply_policy(target_logits[rows, at], **policy)
        fresh = ops.sample(p, seed=seed, offset=offset + (1 << 40))
        rejected = at < draft_tokens.shape[1]
        tokens[rows[rejected], at[rejected]] = fresh[rejected]
        return tokens, emitted, accepted

    result = joint_distribution_result(correction_from_p, **POWER_CASE)
    assert result.p_value < ALPHA, result


def test_onehot_verification_is_exact_whatever_drew_the_proposal():
    # Not a bug: with q = one-hot(y) the output is p for any choice of y that does not
    # look at the coins, so verifying sampled drafts as deterministic ones stays exact.
    def as_onehot(target_logits, draft_tokens, draft_probs=None, **kwargs):
        return ops.verify(target_logits, draft_tokens, None, **kwargs)

    result = joint_distribution_result(as_onehot, **POWER_CASE)
    assert result.p_value > ALPHA, result


def test_power_wrong_draft_probs_are_caught():
    def uniform_q(target_logits, draft_tokens, draft_probs=None, **kwargs):
        return ops.verify(target_logits, draft_tokens, torch.full_like(draft_probs, 1 / 6),
                          **kwargs)

    result = joint_distribution_result(uniform_q, **POWER_CASE)
    assert result.p_value < ALPHA, result


def test_power_bonus_from_the_wrong_position_is_caught():
    def bonus_at_k(target_logits, draft_tokens, draft_probs=None, *, num_draft=None, **kw):
        k = draft_tokens.shape[1]
        shifted = target_logits.clone()
        rows = torch.arange(target_logits.shape[0])
        shifted[rows, num_draft.long()] = target_logits[:, k]
        return ops.verify(shifted, draft_tokens, draft_probs, num_draft=num_draft, **kw)

    result = joint_distribution_result(bonus_at_k, ragged=True, **POWER_CASE)
    assert result.p_value < ALPHA, result


def test_power_case_passes_for_the_native_op():
    result = joint_distribution_result(ops.verify, **POWER_CASE)
    assert result.p_value > ALPHA, result


# --- CUDA ------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("v", [111, 32000, 128256])
def test_cuda_apply_policy_matches_cpu(dtype, v):
    x = logits_for(37, v, seed=v, dtype=dtype)
    for policy in POLICIES.values():
        got = ops.apply_policy(x.cuda(), **policy).cpu()
        want = ops.apply_policy(x, **policy)
        assert torch.equal(got, want)  # bit for bit: exact sums, the same float math


@pytest.mark.cuda
def test_cuda_sample_and_verify_draw_the_cpu_coins():
    probs = torch.softmax(logits_for(500, 1000, seed=1), dim=-1)
    got = ops.sample(probs.cuda(), seed=4, offset=2).cpu()
    want = ops.sample(probs, seed=4, offset=2)
    assert torch.equal(got, want)
    target, drafts, q = verify_inputs(b=64, k=5, v=300, seed=3)
    for kwargs in (dict(greedy=True), dict(temperature=0.0, top_k=3)):
        a = ops.verify(target.cuda(), drafts.cuda(), q.cuda(), seed=1, **kwargs)
        b = ops.verify(target, drafts, q, seed=1, **kwargs)
        assert all(torch.equal(x.cpu(), y) for x, y in zip(a, b))
    a = ops.verify(target.cuda(), drafts.cuda(), q.cuda(), top_p=0.9, seed=1, offset=5)
    b = ops.verify(target, drafts, q, top_p=0.9, seed=1, offset=5)
    assert all(torch.equal(x.cpu(), y) for x, y in zip(a, b))


@pytest.mark.cuda
def test_cuda_per_row_policies_match_scalar_calls():
    """Per-row tensors run the filtering kernels for every row; scalar calls without a
    filter run the kernels compiled without one: the same bits either way."""
    x = logits_for(6, 128256, seed=7).cuda()
    temperature = torch.tensor([0.0, 0.5, 1.0, 2.0, 1.0, 0.8], device="cuda")
    top_k = torch.tensor([0, 10, 0, 3, 1, 128255], device="cuda")
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.95, 0.3, 0.999], device="cuda")
    min_p = torch.tensor([0.0, 0.1, 0.0, 0.3, 0.0, 0.0], device="cuda")
    probs = ops.apply_policy(x, temperature, top_k, top_p, min_p)
    for i in range(6):
        row = ops.apply_policy(x[i:i + 1], float(temperature[i]), int(top_k[i]),
                               float(top_p[i]), float(min_p[i]))
        assert torch.equal(probs[i:i + 1], row), i
    want = ops.apply_policy(x.cpu(), temperature.cpu(), top_k.cpu(), top_p.cpu(), min_p.cpu())
    assert torch.equal(probs.cpu(), want)
    assert int(probs[4].ne(0).sum()) == 1 and int(probs[3].ne(0).sum()) <= 3


@pytest.mark.cuda
@pytest.mark.parametrize("v", [1, 7, 513, 128256])
def test_cuda_sample_matches_cpu_at_awkward_vocabularies(v):
    """The inverse-CDF pick splits a row into one chunk per thread: vocabularies smaller
    than, just over and far over the 512 threads of a block."""
    probs = torch.softmax(logits_for(300, v, seed=v), dim=-1)
    probs[::7, : max(v // 2, 1) - 1] = 0.0  # leading zeros: empty chunks before the mass
    got = ops.sample(probs.cuda(), seed=2, offset=v).cpu()
    want = ops.sample(probs, seed=2, offset=v)
    assert bool((got >= 0).all()) and bool((probs.gather(1, got[:, None].long()) > 0).all())
    assert torch.equal(got, want)


@pytest.mark.cuda
def test_cuda_errors_name_the_row():
    x = torch.zeros(4, 50, device="cuda")
    x[2, 7] = math.nan
    with pytest.raises(ValueError, match=r"got nan at logits\[2, 7\]"):
        ops.apply_policy(x)
    target = torch.zeros(3, 3, 10, device="cuda")
    drafts = torch.zeros(3, 2, dtype=torch.long, device="cuda")
    drafts[1, 1] = 12
    with pytest.raises(ValueError, match=r"got 12 at draft_tokens\[1, 1\]"):
        ops.verify(target, drafts)
    with pytest.raises(ValueError, match=r"got 5 at num_draft\[0\]"):
        ops.verify(target, drafts.clamp(max=9), num_draft=torch.tensor([5, 0, 0], device="cuda"))


@pytest.mark.cuda
@pytest.mark.parametrize("case", ["plain", "top_k", "top_p", "all_knobs_depth3", "onehot_drafts",
                                  "ragged", "bfloat16"])
def test_cuda_verify_is_exact_in_distribution(case):
    result = joint_distribution_result(ops.verify, device="cuda", **EXACTNESS_CASES[case])
    assert result.p_value > ALPHA, result


@pytest.mark.cuda
def test_cuda_graph_replays_with_new_offsets():
    target, drafts, q = (t.cuda() for t in verify_inputs(b=8, k=4, v=500, seed=5))
    offset = torch.zeros(1, dtype=torch.int64, device="cuda")
    ops.verify(target, drafts, q, seed=1, offset=offset)  # warm up outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.verify(target, drafts, q, seed=1, offset=offset)
    for step in range(3):
        offset.fill_(step)
        graph.replay()
        want = ops.verify(target, drafts, q, seed=1, offset=step)
        assert all(torch.equal(x, y) for x, y in zip(out, want))
