"""The one paged plan (``models.layers.paged``) and its attention backends, checked
directly against attention written plainly: for every query, its row's keys found
through the block table one by one, the visible ones chosen by the rule in
``PagedBatch``'s docstring (a chain query sees keys 0..position, a tree query its row's
prefix and its ancestors, a sliding window cuts keys at key_pos <= q_pos - window),
softcap tanh(s / c) * c, an attention sink as one extra logit per head, softmax in
float64.

Batches mix what the decoder sends: decode rows, verify chains, a prefill chunk, a fresh
prefill, draft trees, rows with no new tokens, block tables out of order (gathers) and
in order (slices). Each case runs the torch backend in both roundings
(``TorchAttention()`` and ``sdpa_groups=True``) and, where it applies (chains and trees
without a softcap or sinks), the native paged kernel and its window path
(``kernels.paged_attention``, ``kernels.write_attend``).

Tolerance: float32 against the float64 reference, 2e-5 absolute on outputs of size ~1.
Power: each case also checks that the reference with a wrong rule (the window one key
wider, the tree mask replaced by a causal chain, no softcap, no sinks) differs from the
backend by more than the tolerance, so a backend that ignored the rule would fail.
"""

from __future__ import annotations

import math
from typing import Optional

import pytest
import torch

from verispec.models.base import KVPools, PagedBatch
from verispec.models.layers import kernels
from verispec.models.layers.attention import TorchAttention
from verispec.models.layers.paged import PagedPlan

H, KVH, D, BS, NUM_BLOCKS = 4, 2, 8, 4, 24
TOL = 2e-5


def make_batch(rows: list[dict], *, seed: int, shuffle: bool = True):
    """rows: dicts of ``prefix`` (cached keys before this forward) and either ``n`` (a
    chain of n new tokens at positions prefix..prefix+n-1) or ``parents`` (a draft tree:
    node i's parent index, -1 for the root, positions prefix + depth). Returns the
    batch (random pools, every row's blocks taken from a shuffled free list) and the
    per-token tree rows for the reference."""
    g = torch.Generator().manual_seed(seed)
    free = torch.randperm(NUM_BLOCKS, generator=g).tolist() if shuffle else list(range(NUM_BLOCKS))
    kv = KVPools(k=[torch.randn(NUM_BLOCKS, BS, KVH, D, generator=g)],
                 v=[torch.randn(NUM_BLOCKS, BS, KVH, D, generator=g)], block_size=BS)
    positions, slots, starts, ctx, tables = [], [], [0], [], []
    trees: list[Optional[torch.Tensor]] = []
    width = max(-(-(r["prefix"] + len(r.get("parents", [])) + r.get("n", 0)) // BS)
                for r in rows)
    for r in rows:
        prefix = r["prefix"]
        if "parents" in r:
            parents = r["parents"]
            depth = []
            for p in parents:
                depth.append(0 if p < 0 else depth[p] + 1)
            n = len(parents)
            pos = [prefix + d for d in depth]
            anc = torch.zeros(n, n, dtype=torch.bool)
            for i in range(n):
                j = i
                while j >= 0:
                    anc[i, j] = True
                    j = parents[j]
            trees.append(anc)
        else:
            n = r["n"]
            pos = list(range(prefix, prefix + n))
            trees.append(None)
        length = prefix + n
        blocks = [free.pop(0) for _ in range(-(-length // BS))]
        tables.append(blocks + [-1] * (width - len(blocks)))
        positions += pos
        slots += [blocks[i // BS] * BS + i % BS for i in range(prefix, length)]
        starts.append(starts[-1] + n)
        ctx.append(length)
    t = starts[-1]
    tree_mask = None
    if any(m is not None for m in trees):
        tree_mask = torch.zeros(t, t, dtype=torch.bool)
        for r, m in enumerate(trees):
            s, e = starts[r], starts[r + 1]
            tree_mask[s:e, s:e] = m if m is not None else torch.ones(e - s, e - s).tril().bool()
    batch = PagedBatch(
        input_ids=torch.zeros(t, dtype=torch.long), positions=torch.tensor(positions),
        slot_mapping=torch.tensor(slots, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        context_lens=torch.tensor(ctx, dtype=torch.int32), query_start=torch.tensor(starts),
        logits_indices=torch.arange(t), kv=kv, tree_mask=tree_mask)
    q = torch.randn(t, H, D, generator=g)
    return batch, q


def reference(batch: PagedBatch, q: torch.Tensor, *, scaling: float,
              window: Optional[int] = None, softcap: Optional[float] = None,
              sinks: Optional[torch.Tensor] = None, tree_as_chain: bool = False,
              see_self: bool = True) -> torch.Tensor:
    """Attention of every new token, key by key through the block tables, in float64.
    The wrong rules of the power checks: ``tree_as_chain`` (ignore the tree mask),
    ``see_self=False`` (a chain query misses its own key)."""
    k_flat = batch.kv.k[0].reshape(-1, KVH, D).double()
    v_flat = batch.kv.v[0].reshape(-1, KVH, D).double()
    starts, ctx = batch.query_start.tolist(), batch.context_lens.tolist()
    pos = batch.positions.tolist()
    tree = None if tree_as_chain else batch.tree_mask
    out = torch.zeros(q.shape[0], H, D, dtype=torch.float64)
    for r in range(len(ctx)):
        s, e = starts[r], starts[r + 1]
        prefix = ctx[r] - (e - s)
        table = batch.block_tables[r].tolist()
        for t in range(s, e):
            keys, key_pos = [], []
            for j in range(ctx[r]):
                if tree is None:
                    seen, kp = j <= pos[t] if see_self else j < pos[t], j
                elif j < prefix:
                    seen, kp = True, j
                else:
                    seen, kp = bool(tree[t, s + j - prefix]), pos[s + j - prefix]
                if seen and (window is None or kp > pos[t] - window):
                    keys.append(table[j // BS] * BS + j % BS)
                    key_pos.append(kp)
            kk, vv = k_flat[keys], v_flat[keys]                             # [n, KvH, D]
            for h in range(H):
                scores = (kk[:, h // (H // KVH)] @ q[t, h].double()) * scaling
                if softcap is not None:
                    scores = torch.tanh(scores / softcap) * softcap
                if sinks is not None:
                    scores = torch.cat([scores, sinks[h].double().view(1)])
                p = torch.softmax(scores, dim=0)
                if sinks is not None:
                    p = p[:-1]
                out[t, h] = p @ vv[:, h // (H // KVH)]
    return out


CHAINS = {
    "decode": [dict(prefix=6, n=1), dict(prefix=13, n=1), dict(prefix=2, n=1)],
    "verify": [dict(prefix=9, n=4), dict(prefix=3, n=4)],
    "mixed": [dict(prefix=5, n=1), dict(prefix=0, n=7), dict(prefix=11, n=3),
              dict(prefix=4, n=0), dict(prefix=8, n=2)],
    "fresh_prefill": [dict(prefix=0, n=9)],
    "prefill_chunk": [dict(prefix=8, n=6)],
    "long_prefill_next_to_decode": [dict(prefix=0, n=20), dict(prefix=2, n=1),
                                    dict(prefix=30, n=1)],
}
TREES = {
    "one_tree": [dict(prefix=7, parents=[-1, 0, 0, 1, 1, 2])],
    "trees_and_chain": [dict(prefix=5, parents=[-1, 0, 1, 0, 3]), dict(prefix=10, n=3),
                        dict(prefix=2, parents=[-1, 0, 0, 0])],
}
SCALING = 1 / math.sqrt(D)
BACKENDS = [pytest.param(False, id="torch"), pytest.param(True, id="torch-sdpa-groups")]


def attend(batch, q, sdpa_groups, **kw):
    plan = PagedPlan(batch, torch.device("cpu"), who="test")
    k_flat = batch.kv.k[0].view(-1, KVH, D)
    v_flat = batch.kv.v[0].view(-1, KVH, D)
    return TorchAttention(sdpa_groups=sdpa_groups).attend(plan, q, k_flat, v_flat,
                                                          scaling=SCALING, **kw)


def assert_matches_and_has_power(got, want, wrong):
    err = (got.double() - want).abs().max().item()
    assert err <= TOL, f"max error {err:.3g} against the plain reference"
    miss = (got.double() - wrong).abs().max().item()
    assert miss > 10 * TOL, f"the wrong rule is only {miss:.3g} away: the case has no power"


@pytest.mark.parametrize("sdpa_groups", BACKENDS)
@pytest.mark.parametrize("case", [*CHAINS, *TREES])
@pytest.mark.parametrize("shuffle", [True, False], ids=["gathered", "sliced"])
def test_torch_backend_matches_plain_attention(case, sdpa_groups, shuffle):
    rows = {**CHAINS, **TREES}[case]
    batch, q = make_batch(rows, seed=len(case), shuffle=shuffle)
    got = attend(batch, q, sdpa_groups)
    want = reference(batch, q, scaling=SCALING)
    if batch.tree_mask is not None:
        wrong = reference(batch, q, scaling=SCALING, tree_as_chain=True)
    else:
        wrong = reference(batch, q, scaling=SCALING, see_self=False)
    assert_matches_and_has_power(got, want, wrong)


@pytest.mark.parametrize("sdpa_groups", BACKENDS)
@pytest.mark.parametrize("case", ["mixed", "prefill_chunk", "trees_and_chain",
                                  "long_prefill_next_to_decode"])
@pytest.mark.parametrize("window", [1, 3, 5])
def test_sliding_window(case, sdpa_groups, window):
    batch, q = make_batch({**CHAINS, **TREES}[case], seed=11 + window)
    got = attend(batch, q, sdpa_groups, window=window)
    want = reference(batch, q, scaling=SCALING, window=window)
    wrong = reference(batch, q, scaling=SCALING, window=window + 1)
    assert_matches_and_has_power(got, want, wrong)


@pytest.mark.parametrize("sdpa_groups", BACKENDS)
@pytest.mark.parametrize("case", ["decode", "verify", "mixed", "one_tree", "trees_and_chain"])
def test_softcap_and_sinks(case, sdpa_groups):
    batch, q = make_batch({**CHAINS, **TREES}[case], seed=5)
    q = q * 4  # scores past the cap
    sinks = torch.linspace(-1.0, 2.0, H)
    for kw, drop in (({"softcap": 1.5}, "softcap"), ({"sinks": sinks}, "sinks"),
                     ({"softcap": 2.0, "sinks": sinks, "window": 4}, "sinks")):
        got = attend(batch, q, sdpa_groups, **kw)
        want = reference(batch, q, scaling=SCALING, **kw)
        wrong = reference(batch, q, scaling=SCALING, **{**kw, drop: None})
        assert_matches_and_has_power(got, want, wrong)


@pytest.mark.parametrize("case", [*CHAINS, *TREES])
def test_native_kernel_matches_plain_attention(case):
    batch, q = make_batch({**CHAINS, **TREES}[case], seed=3)
    plan = PagedPlan(batch, torch.device("cpu"), who="test")
    out = torch.full((q.shape[0], H * D), float("nan"))
    kernels.paged_attention(plan.native_index, batch.kv.k[0], batch.kv.v[0], q.contiguous(), out,
                            H, KVH, D, SCALING, max_queries=0, threads=1)
    want = reference(batch, q, scaling=SCALING)
    wrong = reference(batch, q, scaling=SCALING, tree_as_chain=batch.tree_mask is not None,
                      see_self=batch.tree_mask is not None)
    assert_matches_and_has_power(out.view(-1, H, D), want, wrong)


@pytest.mark.parametrize("case", ["mixed", "verify", "trees_and_chain"])
@pytest.mark.parametrize("window", [None, 2, 5])
def test_native_write_attend_window(case, window):
    """write_attend writes the new tokens' K/V at their slots, then attends with the
    window: the reference reads the pools after the write."""
    batch, q = make_batch({**CHAINS, **TREES}[case], seed=21)
    g = torch.Generator().manual_seed(4)
    t = q.shape[0]
    new_k, new_v = torch.randn(t, KVH, D, generator=g), torch.randn(t, KVH, D, generator=g)
    plan = PagedPlan(batch, torch.device("cpu"), who="test")
    got = kernels.write_attend(q.transpose(0, 1)[None], new_k.transpose(0, 1)[None],
                               new_v.transpose(0, 1)[None], plan.native_index,
                               batch.kv.k[0], batch.kv.v[0], SCALING, window)[0]
    slots = batch.slot_mapping.long()
    assert torch.equal(batch.kv.k[0].view(-1, KVH, D)[slots], new_k)
    assert torch.equal(batch.kv.v[0].view(-1, KVH, D)[slots], new_v)
    want = reference(batch, q, scaling=SCALING, window=window)
    wrong = (reference(batch, q, scaling=SCALING, window=window + 1) if window else
             reference(batch, q, scaling=SCALING, tree_as_chain=batch.tree_mask is not None,
                       see_self=batch.tree_mask is not None))
    assert_matches_and_has_power(got, want, wrong)


def test_backends_agree_on_the_plan():
    """The plan is the one both roundings read: on one batch the two torch backends and
    the native kernel agree with each other to float32 rounding."""
    batch, q = make_batch(CHAINS["mixed"], seed=9)
    a = attend(batch, q, False)
    b = attend(batch, q, True)
    plan = PagedPlan(batch, torch.device("cpu"), who="test")
    c = torch.empty(q.shape[0], H * D)
    kernels.paged_attention(plan.native_index, batch.kv.k[0], batch.kv.v[0], q.contiguous(), c,
                            H, KVH, D, SCALING, max_queries=0, threads=1)
    torch.testing.assert_close(a, b, rtol=0, atol=TOL)
    torch.testing.assert_close(a, c.view(-1, H, D), rtol=0, atol=TOL)
