"""verify_tree and block verification (verify(method="block")): exactness and contract.

- lab: exact rational enumeration of small trees in every mode (deterministic
  candidates, sampled with and without replacement) and of block verification, with the
  recovered law of the emitted tokens equal to p token after token;
- joint-distribution G-tests of the native op (fixed seeds; false-alarm rate ALPHA = 1e-3
  per case): one tree call per row from the root of the toy world of tests/exactness.py,
  its first two emitted tokens (a row that emitted one token is continued by a sample of
  p, which keeps an exact verifier exact) against the target's exact joint; and power
  tests: the same statistic on deliberately wrong variants of the reference must reject;
- greedy emits the argmax path; native == reference on the same Philox coins;
- block verification's mean accepted length >= token-wise's on the same inputs;
- argument errors name the argument, row, column and value.
"""

import functools
import math
from fractions import Fraction as F

import numpy as np
import pytest
import torch

from exactness import (ALPHA, H0, TABLE_SIZE, _exact_joint, _g_test, _step,
                       joint_distribution_result)
from test_ops_invariants import _TorchWithCoins, philox_draw, philox_uniform
from verispec import lab, ops, reference

TREE_ACCEPT, TREE_EMIT = 5, 6  # philox.h Purpose values
# Two children at the root, two under each of them: 6 nodes, depth 2.
SHAPE = (-1, -1, 0, 0, 1, 1)


@pytest.fixture(autouse=True)
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- lab: exact rationals -------------------------------------------------------------


def _world(seed, v=3):
    """p(prefix): a distribution over v tokens for every prefix, some entries 0 but at
    least two positive (two siblings can be drawn without replacement)."""
    cache = {}

    def dist(prefix):
        if prefix not in cache:
            g = np.random.default_rng([seed, len(prefix), *prefix])
            w = [int(x) for x in g.integers(0, 5, v)]
            while sum(x > 0 for x in w) < 2:
                w[w.index(0)] = 1
            cache[prefix] = [F(x, sum(w)) for x in w]
        return cache[prefix]

    return dist


@pytest.mark.parametrize("world", range(4))
def test_lab_every_tree_mode_recovers_p_exactly(world):
    p, q = _world(2 * world), _world(2 * world + 1)
    target = lab.autoregressive(p, 3)
    parents = [-1, -1, 0, 0, 1, 2]
    for replacement in (True, False):
        out = lab.tree_outputs(p, parents, q=q, replacement=replacement)
        assert sum(out.values()) == 1
        assert lab.completed(out, p, 3) == target, replacement
    det = lab.tree_outputs(p, parents, tokens=[0, 2, 1, 0, 2, 2])
    assert lab.completed(det, p, 3) == target
    for k in (1, 2, 3):
        assert lab.completed(lab.block_outputs(p, q, k), p, 3) == target
        assert lab.completed(lab.chain_outputs(p, q, k), p, 3) == target


def test_lab_block_verification_accepts_at_least_token_wise():
    better = 0
    for world in range(6):
        p, q = _world(10 + world), _world(20 + world)
        for k in (1, 2, 3):
            block = lab.expected_accepted(lab.block_outputs(p, q, k))
            token = lab.expected_accepted(lab.chain_outputs(p, q, k))
            assert block >= token, (world, k)
            better += block > token
    assert better  # strictly better somewhere, so the comparison can fail


def test_lab_tree_arguments():
    p = _world(0)
    with pytest.raises(ValueError, match=r"parents\[1\] must be in \[-1, 1\), got 1"):
        lab.tree_outputs(p, [-1, 1], tokens=[0, 1])
    with pytest.raises(ValueError, match="tokens must give one token per node"):
        lab.tree_outputs(p, [-1, -1])


# --- the tree harness -------------------------------------------------------------------


def tree_joint_result(verify_tree_fn, *, mode, vocab=5, num_rows=40_000, ragged=False,
                      draft_quality="close", logits_dtype=torch.float32, temperature=1.0,
                      top_k=0, top_p=1.0, min_p=0.0, greedy=False, seed=0):
    """G-test p-value of the first two emitted tokens of one tree call per row.

    mode: 'top2' (deterministic candidates: the top-2 of q at every node of SHAPE),
    'iid' / 'norepl' (children drawn from q with / without replacement). The tree's
    logits follow the toy world of tests/exactness.py from the root prefix H0.
    Returns (p_value, mean accepted depth)."""
    policy = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    exact_policy = dict(policy, temperature=0.0 if greedy else temperature)
    gen = torch.Generator().manual_seed(seed)
    table = (1.5 * torch.randn(TABLE_SIZE, vocab, generator=gen)).to(logits_dtype)
    target_probs = reference.apply_policy(table, **exact_policy)
    if draft_quality == "close":
        q_table = torch.softmax(table.float() + 0.7 * torch.randn(TABLE_SIZE, vocab, generator=gen), -1)
    else:  # poor: sharp and unrelated to the target
        q_table = torch.softmax(3.0 * torch.randn(TABLE_SIZE, vocab, generator=gen), -1)
    n = len(SHAPE)
    rows = num_rows
    parents = torch.tensor(SHAPE).expand(rows, n).contiguous()
    tokens = torch.zeros(rows, n, dtype=torch.long)
    hashes = torch.zeros(rows, n + 1, dtype=torch.long)
    hashes[:, 0] = H0
    for parent in sorted(set(SHAPE)):  # the children of one parent at a time
        kids = [i for i in range(n) if SHAPE[i] == parent]
        q = q_table[hashes[:, parent + 1]]
        if mode == "top2":
            drawn = q.topk(len(kids), dim=-1).indices
        else:
            drawn = torch.multinomial(q, len(kids), replacement=mode == "iid", generator=gen)
        for j, i in enumerate(kids):
            tokens[:, i] = drawn[:, j]
            hashes[:, i + 1] = _step(hashes[:, parent + 1], drawn[:, j])
    logits = table[hashes]                                     # [rows, n + 1, V]
    draft_probs = None if mode == "top2" else q_table[hashes]
    num_nodes = None
    if ragged:
        num_nodes = torch.randint(0, n + 1, (rows,), generator=gen)
        past = torch.arange(n) >= num_nodes[:, None]
        tokens[past] = 0  # junk a correct op never reads
        logits[torch.arange(n + 1) > num_nodes[:, None]] = _junk_row(vocab).to(logits_dtype)
    out, emitted, nodes = verify_tree_fn(
        logits, tokens.int(), parents.int(), draft_probs, num_nodes=num_nodes,
        replacement=mode != "norepl", greedy=greedy, seed=seed, offset=7, **policy)
    check_tree_contract(out, emitted, nodes, tokens, parents,
                        num_nodes if ragged else torch.full((rows,), n), vocab)
    first = out[:, 0].long()
    second = out[:, 1].long()
    short = emitted == 1
    cont = target_probs[_step(torch.full((rows,), H0), first)]
    second = torch.where(short, torch.multinomial(cont, 1, generator=gen).squeeze(1), second)
    observed = torch.bincount(first * vocab + second, minlength=vocab * vocab).double()
    p_value = _g_test(observed, _exact_joint(table, exact_policy, vocab, 2))[0]
    return p_value, float((emitted - 1).double().mean())


def _junk_row(vocab):
    """Target logits peaked on token 0, for rows past num_nodes (never read)."""
    return 8.0 * torch.nn.functional.one_hot(torch.tensor(0), vocab).float()


def check_tree_contract(out, emitted, nodes, tokens, parents, num_nodes, vocab):
    """Shapes, padding, and that the accepted nodes form a root path holding the tokens."""
    b, n = tokens.shape
    assert out.shape == (b, n + 1) and out.dtype == torch.int32
    assert emitted.shape == (b,) and emitted.dtype == torch.int32
    assert nodes.shape == (b, n) and nodes.dtype == torch.int32
    out, emitted, nodes = out.long(), emitted.long(), nodes.long()
    pos = torch.arange(n + 1)
    live = pos < emitted[:, None]
    assert ((emitted >= 1) & (emitted <= num_nodes + 1)).all()
    assert ((out >= 0) & (out < vocab))[live].all()
    assert (out[~live] == -1).all()
    depth = emitted - 1
    on_path = pos[:n] < depth[:, None]
    assert (nodes[~on_path] == -1).all()
    node = nodes.clamp(min=0)
    assert ((node < num_nodes[:, None]) | ~on_path).all()
    assert (tokens.gather(1, node) == out[:, :n])[on_path].all(), "path tokens"
    parent_of = parents.gather(1, node)
    expected_parent = torch.cat([torch.full((b, 1), -1), nodes[:, :-1]], dim=1)
    assert (parent_of == expected_parent)[on_path].all(), "accepted nodes are not a root path"


TREE_CASES = {
    "top2": dict(mode="top2"),
    "top2_poor": dict(mode="top2", draft_quality="poor"),
    "iid": dict(mode="iid"),
    "iid_poor": dict(mode="iid", draft_quality="poor"),
    "norepl": dict(mode="norepl"),
    "norepl_poor": dict(mode="norepl", draft_quality="poor"),
    "ragged_iid": dict(mode="iid", ragged=True),
    "ragged_top2": dict(mode="top2", ragged=True),
    "temperature_top_k_norepl": dict(mode="norepl", temperature=0.7, top_k=3),
    "temperature_top_k_top2": dict(mode="top2", temperature=1.4, top_k=3),
    "bfloat16_iid": dict(mode="iid", logits_dtype=torch.bfloat16, top_p=0.9),
    "bfloat16_norepl_min_p": dict(mode="norepl", logits_dtype=torch.bfloat16, min_p=0.1),
}


@pytest.mark.parametrize("case", sorted(TREE_CASES))
def test_native_tree_emits_the_target_joint(case):
    p_value, depth = tree_joint_result(ops.verify_tree, **TREE_CASES[case])
    assert p_value > ALPHA, (case, p_value)
    assert depth > 0.15, depth  # the trees do get accepted


# The power tests' setting: the wrong variants below must fail it, the op and the
# reference pass it.
POWER = dict(num_rows=6000, draft_quality="poor", vocab=4)


@pytest.mark.parametrize("mode", ["top2", "iid", "norepl"])
@pytest.mark.parametrize("impl", ["native", "reference"])
def test_tree_passes_the_power_setting(impl, mode):
    fn = ops.verify_tree if impl == "native" else reference.verify_tree
    p_value, _ = tree_joint_result(fn, mode=mode, **POWER)
    assert p_value > ALPHA, (impl, mode, p_value)


def _residual_not_updated(r, q_i, p):
    return reference._correction_distribution_from(p, q_i, p)  # from p every time


def _not_renormalised(q, removed):
    out = q.clone()
    out[removed] = 0.0
    return out


_draw = reference._draw


def _sharpened_draw(dist, u):
    return _draw(dist ** 2 / (dist ** 2).sum(), u)


WRONG_TREES = {
    # deterministic candidates: the node's draw from a sharpened p (temperature applied
    # twice), which also shifts how often a candidate is hit
    "top2_sharpened_draw": ("_draw", _sharpened_draw, "top2"),
    # the residual restarts from p at every sibling instead of carrying r forward
    "residual_not_updated": ("_tree_residual", _residual_not_updated, "iid"),
    # without replacement, q_i keeps the removed mass out but is not renormalised
    "q_not_renormalised": ("_sibling_q", _not_renormalised, "norepl"),
    # after rejected siblings, the emitted token (and later tests) use p
    "correction_from_p": ("_tree_residual", lambda r, q_i, p: p, "iid"),
}


@pytest.mark.parametrize("variant", sorted(WRONG_TREES))
def test_wrong_tree_rules_are_rejected(monkeypatch, variant):
    name, fn, mode = WRONG_TREES[variant]
    monkeypatch.setattr(reference, name, fn)
    p_value, _ = tree_joint_result(reference.verify_tree, mode=mode, **POWER)
    assert p_value < ALPHA, (variant, p_value)


# --- greedy, same coins ------------------------------------------------------------------


@pytest.mark.parametrize("draft", ["top2", "iid"])
def test_greedy_tree_emits_the_argmax_path(draft):
    g = torch.Generator().manual_seed(3)
    b, v = 200, 4
    logits = torch.randn(b, len(SHAPE) + 1, v, generator=g)
    tokens = torch.stack([torch.randperm(v, generator=g)[:2] for _ in range(b * 3)]).view(b, 6)
    parents = torch.tensor(SHAPE).expand(b, 6)
    q = torch.softmax(torch.randn(b, 7, v, generator=g), -1) if draft == "iid" else None
    out, emitted, nodes = ops.verify_tree(logits, tokens, parents, q, greedy=True)
    for r in range(b):
        cur, path = -1, []
        while True:
            x = int(logits[r, cur + 1].argmax())
            kids = [c for c in range(6) if SHAPE[c] == cur and int(tokens[r, c]) == x]
            path.append(x)
            if not kids:
                break
            cur = kids[0]
        assert out[r, :len(path)].tolist() == path and int(emitted[r]) == len(path)
    ref = reference.verify_tree(logits, tokens, parents, q, greedy=True)
    for a, e in zip((out, emitted, nodes), ref):
        assert torch.equal(a, e)


def reference_tree_on_coins(logits, tokens, parents, q, *, seed, offset, **kwargs):
    """reference.verify_tree drawing the native op's Philox coins."""
    b, n = tokens.shape
    rows = np.arange(b)[:, None]
    accept = philox_uniform(seed, offset, rows, np.arange(n)[None, :], TREE_ACCEPT)
    emit = philox_draw(seed, offset, rows, np.arange(n + 1)[None, :], TREE_EMIT)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(reference, "torch", _TorchWithCoins([accept, emit]))
        return reference.verify_tree(logits, tokens, parents, q, seed=seed, offset=offset,
                                     **kwargs)


@pytest.mark.parametrize("mode", ["top2", "iid", "norepl"])
def test_native_tree_equals_reference_on_the_same_coins(mode):
    g = torch.Generator().manual_seed(11)
    b, v, n = 300, 7, len(SHAPE)
    logits = torch.randn(b, n + 1, v, generator=g)
    q = torch.softmax(logits + 0.8 * torch.randn(b, n + 1, v, generator=g), -1)
    parents = torch.tensor(SHAPE).expand(b, n).contiguous()
    tokens = torch.zeros(b, n, dtype=torch.long)
    for parent in sorted(set(SHAPE)):
        kids = [i for i in range(n) if SHAPE[i] == parent]
        if mode == "top2":
            drawn = q[:, parent + 1].topk(2, dim=-1).indices
        else:
            drawn = torch.multinomial(q[:, parent + 1], 2, replacement=mode == "iid", generator=g)
        tokens[:, kids] = drawn
    num_nodes = torch.randint(0, n + 1, (b,), generator=g)
    args = dict(num_nodes=num_nodes, replacement=mode != "norepl", temperature=0.9, top_k=5,
                seed=5, offset=9)
    qq = None if mode == "top2" else q
    got = ops.verify_tree(logits, tokens, parents, qq, **args)
    want = reference_tree_on_coins(logits, tokens, parents, qq, **args)
    differ = (got[0] != want[0]).any(dim=1) | (got[1] != want[1])
    # float32 ulps (a double accumulator against float32 sums) may move a coin across a
    # decision boundary: rare, never systematic.
    assert int(differ.sum()) <= 3, int(differ.sum())
    assert int((got[1] > 1).sum()) > b // 4  # paths do get accepted


# --- block verification ----------------------------------------------------------------

block_verify = functools.partial(ops.verify, method="block")

BLOCK_CASES = {
    "plain": dict(),
    "poor_depth3": dict(draft_quality="poor", vocab=5, depth=3),
    "ragged": dict(ragged=True),
    "temperature_top_k": dict(temperature=0.7, top_k=3),
    "bfloat16_top_p": dict(logits_dtype=torch.bfloat16, top_p=0.9),
    "q_equals_p": dict(draft_quality="same", temperature=0.9),
    "greedy": dict(greedy=True, draft_quality="poor"),
}


@pytest.mark.parametrize("case", sorted(BLOCK_CASES))
def test_native_block_verification_emits_the_target_joint(case):
    r = joint_distribution_result(block_verify, num_rows=40_000, **BLOCK_CASES[case])
    assert r.p_value > ALPHA, (case, str(r))


# Block power settings: each wrong variant must fail its setting; the op and the
# reference pass both.
BLOCK_POWER = {
    "correction_from_p": dict(num_rows=20_000, draft_quality="poor", vocab=4, depth=2),
    # the weight w_tau only shows after an accepted prefix: close drafts, many rows
    "residual_without_weight": dict(num_rows=300_000, vocab=4, depth=2, k=2),
}
WRONG_BLOCKS = {
    "correction_from_p": lambda p, q, w: p,
    "residual_without_weight": lambda p, q, w: reference._correction_distribution(p, q),
}


@pytest.mark.parametrize("setting", sorted(BLOCK_POWER))
@pytest.mark.parametrize("impl", ["native", "reference"])
def test_block_passes_the_power_settings(impl, setting):
    fn = ops.verify if impl == "native" else reference.verify
    r = joint_distribution_result(functools.partial(fn, method="block"), **BLOCK_POWER[setting])
    assert r.p_value > ALPHA, (impl, setting, str(r))


@pytest.mark.parametrize("variant", sorted(WRONG_BLOCKS))
def test_wrong_block_rules_are_rejected(monkeypatch, variant):
    monkeypatch.setattr(reference, "_block_correction_distribution", WRONG_BLOCKS[variant])
    r = joint_distribution_result(functools.partial(reference.verify, method="block"),
                                  **BLOCK_POWER[variant])
    assert r.p_value < ALPHA, (variant, str(r))


def test_block_accepts_at_least_as_many_as_token_wise():
    # Same inputs, many rows: mean accepted length, block minus token-wise, must not be
    # below zero by more than 4.5 standard errors (false alarm 3.4e-6 one-sided), and is
    # expected clearly above it for a close draft at k = 4.
    g = torch.Generator().manual_seed(2)
    b, k, v = 20_000, 4, 8
    logits = 1.5 * torch.randn(b, k + 1, v, generator=g)
    q = torch.softmax(logits[:, :k] + 0.9 * torch.randn(b, k, v, generator=g), -1)
    drafts = torch.multinomial(q.reshape(-1, v), 1, generator=g).view(b, k)
    token = ops.verify(logits, drafts, q, seed=1)[2].double()
    block = ops.verify(logits, drafts, q, seed=2, method="block")[2].double()
    diff = block.mean() - token.mean()
    se = math.sqrt(block.var() / b + token.var() / b)
    assert diff > 4.5 * se, (float(diff), se)


def test_native_block_equals_reference_on_the_same_coins():
    from test_ops_invariants import reference_verify_on_coins
    g = torch.Generator().manual_seed(4)
    b, k, v = 400, 4, 9
    logits = torch.randn(b, k + 1, v, generator=g)
    q = torch.softmax(logits[:, :k] + 0.6 * torch.randn(b, k, v, generator=g), -1)
    drafts = torch.multinomial(q.reshape(-1, v), 1, generator=g).view(b, k)
    nd = torch.randint(0, k + 1, (b,), generator=g)
    args = dict(num_draft=nd, seed=3, offset=8, method="block", temperature=0.8)
    got = ops.verify(logits, drafts, q, **args)
    want = reference_verify_on_coins(logits, drafts, q, **args)
    differ = (got[0] != want[0]).any(dim=1)
    assert int(differ.sum()) <= 3, int(differ.sum())
    assert int(got[2].sum()) > b  # drafts are accepted


def test_block_method_argument():
    x = torch.zeros(1, 2, 3)
    with pytest.raises(ValueError, match="method must be 'token' or 'block', got 'tree'"):
        ops.verify(x, torch.zeros(1, 1, dtype=torch.int32), method="tree")
    with pytest.raises(ValueError, match="method must be 'token' or 'block'"):
        reference.verify(x, torch.zeros(1, 1, dtype=torch.int32), method="chain")


def test_block_with_one_hot_drafts_is_token_wise():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(50, 4, 6, generator=g)
    drafts = torch.randint(0, 6, (50, 3), generator=g)
    a = ops.verify(logits, drafts, seed=4)
    b = ops.verify(logits, drafts, seed=4, method="block")
    for x, y in zip(a, b):
        assert torch.equal(x, y)


# --- errors ----------------------------------------------------------------------------


def _tree_inputs(v=5):
    logits = torch.randn(2, 4, v)
    tokens = torch.tensor([[0, 1, 2], [3, 4, 0]], dtype=torch.int32)
    parents = torch.tensor([[-1, -1, 0], [-1, 0, 1]], dtype=torch.int32)
    return logits, tokens, parents


@pytest.mark.parametrize("impl", [ops.verify_tree, reference.verify_tree])
def test_tree_argument_errors(impl):
    logits, tokens, parents = _tree_inputs()
    bad_parents = parents.clone()
    bad_parents[1, 2] = 2
    with pytest.raises(ValueError, match=r"parents must be -1 .* got 2 at parents\[1, 2\]"):
        impl(logits, tokens, bad_parents)
    bad_parents[1, 2] = -2
    with pytest.raises(ValueError, match=r"got -2 at parents\[1, 2\]"):
        impl(logits, tokens, bad_parents)
    dup = tokens.clone()
    dup[0, 1] = 0
    with pytest.raises(ValueError, match=r"distinct tokens.* got 0 .*at tree_tokens\[0, 1\]"):
        impl(logits, dup, parents)
    q = torch.full((2, 4, 5), 0.2)
    with pytest.raises(ValueError, match=r"distinct tokens.*tree_tokens\[0, 1\]"):
        impl(logits, dup, parents, q, replacement=False)
    impl(logits, dup, parents, q)  # i.i.d. siblings may repeat a token
    oob = tokens.clone()
    oob[1, 0] = 5
    with pytest.raises(ValueError, match=r"tree_tokens must be in \[0, V\) = \[0, 5\), got 5 at "
                                         r"tree_tokens\[1, 0\]"):
        impl(logits, oob, parents)
    with pytest.raises(ValueError, match=r"num_nodes must be in \[0, N\] = \[0, 3\], got 4 at "
                                         r"num_nodes\[1\]"):
        impl(logits, tokens, parents, num_nodes=torch.tensor([3, 4]))
    # ragged: nodes past num_nodes are never checked
    impl(logits, oob, bad_parents, num_nodes=torch.tensor([3, 0]))


def test_tree_value_errors_name_the_row():
    logits, tokens, parents = _tree_inputs()
    nan = logits.clone()
    nan[1, 2, 3] = float("nan")
    with pytest.raises(ValueError, match=r"NaN or \+Inf.*got nan at target_logits\[1, 2\]"):
        ops.verify_tree(nan, tokens, parents)
    masked = logits.clone()
    masked[0, 3] = float("-inf")
    with pytest.raises(ValueError, match=r"only -Inf at target_logits\[0, 3\]"):
        ops.verify_tree(masked, tokens, parents)
    q = torch.full((2, 4, 5), 0.2)
    q[0, 0, 0] = -1.0
    with pytest.raises(ValueError, match=r"draft_probs must be finite and >= 0, got -1 at "
                                         r"draft_probs\[0, 0\]"):
        ops.verify_tree(logits, tokens, parents, q)
    with pytest.raises(ValueError, match=r"draft_probs must be float \[B, N\+1, V\]"):
        ops.verify_tree(logits, tokens, parents, q[:, :3])
    with pytest.raises(ValueError, match=r"parents must be an integer tensor \[B, N\]"):
        ops.verify_tree(logits, tokens, parents[:, :2])
    with pytest.raises(TypeError, match="replacement must be a bool"):
        ops.verify_tree(logits, tokens, parents, q, replacement=1)
    with pytest.raises(ValueError, match=r"temperature must be .*got -1"):
        ops.verify_tree(logits, tokens, parents, temperature=-1.0)


def test_tree_without_nodes_is_a_plain_sample():
    logits = torch.randn(3, 1, 4)
    out, emitted, nodes = ops.verify_tree(logits, torch.zeros(3, 0, dtype=torch.int32),
                                          torch.zeros(3, 0, dtype=torch.int32), seed=2)
    assert emitted.tolist() == [1, 1, 1] and nodes.shape == (3, 0)
    assert ((out[:, 0] >= 0) & (out[:, 0] < 4)).all()


def test_tree_compiles_as_a_custom_op():
    logits, tokens, parents = _tree_inputs()
    fn = torch.compile(lambda x, t, p: ops.verify_tree(x, t, p, seed=1), fullgraph=True,
                       backend="eager")
    for a, e in zip(fn(logits, tokens, parents), ops.verify_tree(logits, tokens, parents, seed=1)):
        assert torch.equal(a, e)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["top2", "iid", "norepl"])
def test_cuda_tree_matches_cpu(mode):
    g = torch.Generator().manual_seed(8)
    b, v, n = 64, 1000, len(SHAPE)
    logits = torch.randn(b, n + 1, v, generator=g)
    q = torch.softmax(logits + 0.5 * torch.randn(b, n + 1, v, generator=g), -1)
    tokens = torch.stack([torch.randperm(v, generator=g)[:n] for _ in range(b)])
    if mode == "iid":
        tokens = torch.multinomial(q[:, 0], n, replacement=True, generator=g)
    parents = torch.tensor(SHAPE).expand(b, n)
    qq = None if mode == "top2" else q
    args = dict(replacement=mode != "norepl", top_k=50, seed=3, offset=4)
    cpu = ops.verify_tree(logits, tokens, parents, qq, **args)
    gpu = ops.verify_tree(logits.cuda(), tokens.cuda(), parents.cuda(),
                          None if qq is None else qq.cuda(), **args)
    assert all(torch.equal(c, g.cpu()) for c, g in zip(cpu, gpu))  # bit for bit


@pytest.mark.cuda
def test_cuda_block_matches_cpu():
    g = torch.Generator().manual_seed(9)
    b, k, v = 64, 4, 1000
    logits = torch.randn(b, k + 1, v, generator=g)
    q = torch.softmax(logits[:, :k] + 0.5 * torch.randn(b, k, v, generator=g), -1)
    drafts = torch.multinomial(q.reshape(-1, v), 1, generator=g).view(b, k)
    cpu = ops.verify(logits, drafts, q, method="block", seed=1)
    gpu = ops.verify(logits.cuda(), drafts.cuda(), q.cuda(), method="block", seed=1)
    assert all(torch.equal(c, g_.cpu()) for c, g_ in zip(cpu, gpu))
