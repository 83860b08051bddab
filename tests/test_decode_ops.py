"""The per-layer CPU kernels of a decode step (csrc/include/verispec/layers/decode_ops.h):
RoPE with the cache write, paged attention, SwiGLU's silu * up, the residual norm.

Each is checked against a float64 (or torch) reference with a stated bound, on every
instruction set this CPU runs (same bits on each), for batch invariance (a token's
output is bit for bit the same alone, in a verify row, in a batch, in a tree, on any
thread count), and for its errors. Power: the same comparison fails for a kernel that
sees one key too many, or reads a neighbouring block.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from verispec import _C

from test_linear import _tiny_llama  # noqa: E402

ISAS = _C.linear_isas()
NH, NKV, HD, BS = 6, 2, 32, 4


def test_decode_exp_is_within_two_ulp_of_exp():
    xs = torch.linspace(-87.0, 88.0, 20001, dtype=torch.float32).tolist() + [0.0, -1e-8, 1e-8]
    got = torch.tensor([_C.decode_exp(x) for x in xs], dtype=torch.float64)
    ref = torch.tensor(xs, dtype=torch.float64).exp()
    ref32 = ref.float()
    ulp = (torch.nextafter(ref32, torch.tensor(math.inf)) - ref32).double()  # float32 ulp
    worst = ((got - ref).abs() / ulp).max().item()
    assert worst <= 2.0, worst
    # power: torch's float32 exp of x rounded one ulp off would be caught at this bound
    assert ((ref32.double() * (1 + 2.0 ** -21) - ref).abs() / ulp).max().item() > 2.0
    assert _C.decode_exp(-1000.0) == _C.decode_exp(-87.0) and _C.decode_exp(1000.0) == _C.decode_exp(88.0)
    assert math.isnan(_C.decode_exp(float("nan")))


# ---- paged attention ------------------------------------------------------------------

class Cache:
    """Random pools and rows of a paged cache: row r owns the blocks tables[r] (shuffled,
    not consecutive), its keys 0..ctx_lens[r] - 1 are written."""

    def __init__(self, ctx_lens, seed=0, num_blocks=64, hd=HD):
        g = torch.Generator().manual_seed(seed)
        self.hd = hd
        self.k = torch.randn(num_blocks * BS, NKV, hd, generator=g)
        self.v = torch.randn(num_blocks * BS, NKV, hd, generator=g)
        perm = torch.randperm(num_blocks, generator=g).tolist()
        width = max(-(-c // BS) for c in ctx_lens)
        self.tables = torch.full((len(ctx_lens), width), -1, dtype=torch.int32)
        used = 0
        for r, c in enumerate(ctx_lens):
            n = -(-c // BS)
            self.tables[r, :n] = torch.tensor(perm[used:used + n], dtype=torch.int32)
            used += n
        self.ctx = torch.tensor(ctx_lens, dtype=torch.int32)
        self.g = g

    def alone(self, row, keys):
        """The same pools with one row: row `row`'s first `keys` keys (a token of that row
        decoded alone)."""
        one = copy.copy(self)
        one.ctx = torch.tensor([keys], dtype=torch.int32)
        one.tables = self.tables[row:row + 1].clone()
        return one

    def slots(self, row, keys):
        j = torch.arange(keys)
        return self.tables[row].long()[j // BS] * BS + j % BS

    def attend(self, q, query_start, positions, *, tree=None, isa="auto", threads=1,
               max_queries=0, out=None, share_keys=True, window=0):
        q = q.contiguous()
        qs = torch.tensor(query_start, dtype=torch.int64)
        pos = torch.tensor(positions, dtype=torch.int64)
        out = torch.full((q.shape[0], NH * self.hd), float("nan")) if out is None else out
        tree_t = None if tree is None else tree.to(torch.bool).contiguous()
        _C._paged_attention_unchecked(
            q.data_ptr(), self.k.data_ptr(), self.v.data_ptr(), self.k.shape[0], q.shape[0],
            NH, NKV, self.hd, len(query_start) - 1, qs.data_ptr(), pos.data_ptr(),
            self.ctx.data_ptr(), self.tables.data_ptr(), self.tables.stride(0), self.tables.shape[1],
            0 if tree_t is None else tree_t.data_ptr(), BS, 1.0 / math.sqrt(self.hd), out.data_ptr(),
            max_queries, threads, isa, share_keys=share_keys, window=window)
        return out

    def reference(self, q, row, keys_seen):
        """float64 attention of one token q [NH, HD] over row `row`'s keys `keys_seen`."""
        s = self.slots(row, max(keys_seen) + 1)[keys_seen]
        k, v = self.k[s].double(), self.v[s].double()                 # [L, NKV, HD]
        out = []
        for h in range(NH):
            kv = h // (NH // NKV)
            w = torch.softmax(k[:, kv] @ q[h].double() / math.sqrt(self.hd), dim=0)
            out.append(w @ v[:, kv])
        return torch.cat(out)


def _queries(n, seed, hd=HD):
    return torch.randn(n, NH, hd, generator=torch.Generator().manual_seed(seed))


def _same_bits_everywhere(cache, q, qs, positions):
    """The pass on every instruction set, 1-3 threads and both layouts (share_keys):
    bit for bit the scalar one-thread per-token layout's output, which is returned."""
    base = cache.attend(q, qs, positions, isa="scalar", threads=1, share_keys=False)
    for isa in ISAS:
        for threads in (1, 2, 3):
            for share in (True, False):
                got = cache.attend(q, qs, positions, isa=isa, threads=threads, share_keys=share)
                assert torch.equal(got, base), (isa, threads, share)
    return base


def _worst_against_float64(cache, q, out, rows, positions, tokens):
    """The largest difference of the `tokens`' outputs from float64 attention over their
    rows' keys 0..position."""
    return max((out[t].double() - cache.reference(q[t], rows[t], list(range(positions[t] + 1))))
               .abs().max().item() for t in tokens)


def test_attention_matches_float64_reference_on_ragged_rows():
    # a decode row, a verify row of 5, a 17-token prefill chunk (> SMALL_ROW_QUERIES)
    cache = Cache([37, 23, 30], seed=1)
    counts = [1, 5, 17]
    qs = [0, 1, 6, 23]
    positions = [36] + list(range(18, 23)) + list(range(13, 30))
    q = _queries(23, 2)
    out = cache.attend(q, qs, positions)
    worst = 0.0
    for t in range(23):
        row = next(r for r in range(3) if qs[r] <= t < qs[r + 1])
        ref = cache.reference(q[t], row, list(range(positions[t] + 1)))
        worst = max(worst, (out[t].double() - ref).abs().max().item())
    assert worst < 2e-6, worst
    # power: a kernel that saw one key more (or read the neighbouring block) misses it
    wrong = cache.reference(q[1], 1, list(range(positions[1] + 2)))
    assert (out[1].double() - wrong).abs().max().item() > 1e-3
    assert counts == [qs[i + 1] - qs[i] for i in range(3)]


@pytest.mark.parametrize("hd", [64, 128, 80])
def test_attention_head_sizes_same_bits_on_every_isa_and_float64(hd):
    """Head sizes 64 and 128 (AVX-512 keeps q and the output in registers) and 80 (the
    loops): every instruction set gives the scalar path's bits, within 2e-6 of float64 for
    decode rows over long contexts and a verify row; power: one key more is caught."""
    cache = Cache([150, 37, 9], seed=4, hd=hd)
    q = _queries(7, 5, hd)
    qs, positions = [0, 1, 6, 7], [149] + list(range(32, 37)) + [8]
    base = cache.attend(q, qs, positions, isa="scalar", threads=1)
    for isa in ISAS:
        for threads in (1, 2):
            assert torch.equal(cache.attend(q, qs, positions, isa=isa, threads=threads), base), (isa, threads)
    worst = max((base[t].double() - cache.reference(q[t], row, list(range(positions[t] + 1))))
                .abs().max().item() for t, row in ((0, 0), (3, 1), (6, 2)))
    assert worst < 2e-6, worst
    wrong = cache.reference(q[0], 0, list(range(positions[0] + 2)))
    assert (base[0].double() - wrong).abs().max().item() > 1e-3


def test_attention_same_bits_on_every_isa_and_thread_count():
    cache = Cache([64, 9], seed=3)
    q = _queries(7, 4)
    qs, positions = [0, 6, 7], list(range(58, 64)) + [8]
    base = cache.attend(q, qs, positions, isa="scalar", threads=1)
    for isa in ISAS:
        for threads in (1, 2, 3):
            assert torch.equal(cache.attend(q, qs, positions, isa=isa, threads=threads), base), (isa, threads)


def test_attention_is_batch_invariant():
    """A token's output alone (a decode pass) = in a verify row = next to other rows."""
    cache = Cache([40, 20, 33], seed=5)
    q = _queries(12, 6)
    together = cache.attend(q, [0, 6, 7, 12], list(range(34, 40)) + [19] + list(range(28, 33)),
                            threads=2)
    for t, pos in enumerate(range(34, 40)):  # row 0's verify tokens, each decoded alone
        alone = cache.alone(0, pos + 1).attend(q[t:t + 1], [0, 1], [pos])
        assert torch.equal(alone[0], together[t]), t
    # row 2 at the front of another batch order
    cache2 = Cache([40, 20, 33], seed=5)
    cache2.tables, cache2.ctx = cache.tables[[2, 0]].clone(), cache.ctx[[2, 0]].clone()
    swapped = cache2.attend(torch.cat([q[7:12], q[0:6]]), [0, 5, 11],
                            list(range(28, 33)) + list(range(34, 40)))
    assert torch.equal(swapped[:5], together[7:12])


@pytest.mark.parametrize("hd", [64, 128, 80])
def test_verify_rows_share_key_reads_with_the_same_bits(hd):
    """Verify rows whose keys span several of the kernel's 64-key tiles: the tokens of a
    row read each key once together (share_keys, the default), their outputs accumulated
    tile by tile, and come out bit for bit as each token attending alone (a decode pass)
    and as the layout where every token reads its own keys, on every instruction set and
    thread count; within 2e-6 of float64. Power: one key more (or less) is caught."""
    cache = Cache([203, 130, 64], seed=11, num_blocks=112, hd=hd)
    q = _queries(12, 12, hd)
    qs = [0, 7, 10, 12]
    positions = list(range(196, 203)) + [127, 128, 129] + [62, 63]
    base = _same_bits_everywhere(cache, q, qs, positions)
    rows = [0] * 7 + [1] * 3 + [2] * 2
    for t in range(12):  # each token alone, a decode pass of its row's first keys
        alone = cache.alone(rows[t], positions[t] + 1)
        assert torch.equal(alone.attend(q[t:t + 1], [0, 1], [positions[t]], threads=2)[0],
                           base[t]), t
    worst = _worst_against_float64(cache, q, base, rows, positions, (0, 6, 7, 9, 11))
    assert worst < 2e-6, worst
    # power: token 6 over one key less, token 7 over one key more, are far off
    assert (base[6].double() - cache.reference(q[6], 0, list(range(202)))).abs().max() > 1e-3
    assert (base[7].double() - cache.reference(q[7], 1, list(range(129)))).abs().max() > 1e-3


@pytest.mark.parametrize("hd", [64, 80])
def test_long_contexts_attend_in_key_chunks_with_the_same_bits(hd):
    """Past 512 keys the kernel attends each chunk of 512 on its own and merges the chunks
    in order (weights exp(m_c - max m)), so a decode token's chunks can be cut across
    threads. A token alone (its chunks cut across 2 or 3 threads, or not), in a verify row
    (read with the row's other tokens, tile by tile), in either layout, on every
    instruction set: the same bits, and within 2e-6 of float64 (1300 and 700 keys: 3 and
    2 chunks). Power: the chunks merged without their weights are far off."""
    cache = Cache([1300, 700], seed=21, num_blocks=520, hd=hd)
    q = _queries(9, 22, hd)
    qs, positions = [0, 6, 9], list(range(1294, 1300)) + [697, 698, 699]
    rows = [0] * 6 + [1] * 3
    base = _same_bits_everywhere(cache, q, qs, positions)
    for t in (0, 5, 6, 8):
        alone = cache.alone(rows[t], positions[t] + 1)
        for isa in ISAS:
            for threads in (1, 2, 3):
                got = alone.attend(q[t:t + 1], [0, 1], [positions[t]], isa=isa, threads=threads)
                assert torch.equal(got[0], base[t]), (t, isa, threads)
    worst = _worst_against_float64(cache, q, base, rows, positions, (0, 5, 6, 8))
    assert worst < 2e-6, worst
    # power: token 5 (1300 keys) with its chunks' softmaxes averaged unweighted
    s = cache.slots(0, 1300)
    k, v = cache.k[s].double(), cache.v[s].double()
    wrong = []
    for h in range(NH):
        kv = h // (NH // NKV)
        parts = [torch.softmax(k[c:c + 512, kv] @ q[5, h].double() / math.sqrt(hd), dim=0)
                 @ v[c:c + 512, kv] for c in range(0, 1300, 512)]
        wrong.append(sum(parts) / len(parts))
    assert (base[5].double() - torch.cat(wrong)).abs().max().item() > 1e-3



@pytest.mark.parametrize("nh,nkv,hd", [(32, 32, 64), (16, 4, 128), (12, 12, 80), (8, 2, 64)])
def test_decode_tokens_attend_several_kv_heads_an_item_with_the_same_bits(nh, nkv, hd):
    """Decode tokens take several KV heads a work item, as many as the thread count leaves
    (8 threads: few an item; 1 thread: up to 64 query heads): each head's output is bit for
    bit the same whatever heads share its item, over one key chunk or three (1300 keys,
    their chunks cut across items or not), on every instruction set and 1, 2, 3 or 8
    threads, alone or next to other rows, and within 2e-6 of float64.
    Power: an item that read its first KV head for every head (the register form of the
    values without the head's offset) differs from float64 by far more."""
    bs, rows, ctx = 16, 6, [70, 33, 129, 1, 512, 1300]
    g = torch.Generator().manual_seed(nh + hd)
    blocks = sum(-(-c // bs) for c in ctx)
    k = torch.randn(blocks * bs, nkv, hd, generator=g)
    v = torch.randn(blocks * bs, nkv, hd, generator=g)
    perm = torch.randperm(blocks, generator=g).to(torch.int32)  # scattered blocks
    width = max(-(-c // bs) for c in ctx)
    tables = torch.zeros(rows, width, dtype=torch.int32)
    at = 0
    for r, c in enumerate(ctx):
        n = -(-c // bs)
        tables[r, :n] = perm[at:at + n]
        at += n
    q = torch.randn(rows, nh, hd, generator=g)

    def attend(which, isa, threads):
        qq = q[which].contiguous()
        out = torch.full((len(which), nh * hd), float("nan"))
        qs = torch.arange(len(which) + 1, dtype=torch.int64)
        pos = torch.tensor([ctx[r] - 1 for r in which], dtype=torch.int64)
        lens = torch.tensor([ctx[r] for r in which], dtype=torch.int32)
        tab = tables[which].contiguous()
        _C._paged_attention_unchecked(
            qq.data_ptr(), k.data_ptr(), v.data_ptr(), k.shape[0], len(which), nh, nkv, hd,
            len(which), qs.data_ptr(), pos.data_ptr(), lens.data_ptr(), tab.data_ptr(),
            tab.stride(0), tab.shape[1], 0, bs, 1.0 / math.sqrt(hd), out.data_ptr(), 0, threads,
            isa)
        return out

    def reference(r):
        j = torch.arange(ctx[r])
        s = tables[r].long()[j // bs] * bs + j % bs
        kk, vv = k[s].double(), v[s].double()
        return torch.cat([torch.softmax(kk[:, h // (nh // nkv)] @ q[r, h].double() / math.sqrt(hd), 0)
                          @ vv[:, h // (nh // nkv)] for h in range(nh)])

    everyone = list(range(rows))
    base = attend(everyone, "scalar", 1)
    for r in everyone:
        assert (base[r].double() - reference(r)).abs().max().item() < 2e-6, r
    for isa in ISAS:
        for threads in (1, 2, 3, 8):
            assert torch.equal(attend(everyone, isa, threads), base), (isa, threads)
            for r in (0, 2, 5):
                assert torch.equal(attend([r], isa, threads)[0], base[r]), (isa, threads, r)
    if nkv > 1:  # power: every head read as KV head 0
        j = torch.arange(ctx[0])
        s = tables[0].long()[j // bs] * bs + j % bs
        kk, vv = k[s].double(), v[s].double()
        first_only = torch.cat([torch.softmax(kk[:, 0] @ q[0, h].double() / math.sqrt(hd), 0)
                                @ vv[:, 0] for h in range(nh)])
        assert (base[0].double() - first_only).abs().max().item() > 1e-3

def test_a_sliding_window_past_a_chunk_attends_the_same_alone_and_in_a_row():
    """A window of 600 keys (two chunks of the window's keys) at 1300 cached: decode
    alone on 1-3 threads (chunks cut or not) = in a verify row, every instruction set;
    within 2e-6 of float64 over the window's keys; power: the keys before the window."""
    cache = Cache([1300], seed=23, num_blocks=330)
    q = _queries(3, 24)
    positions = [1297, 1298, 1299]
    base = cache.attend(q, [0, 3], positions, isa="scalar", window=600)
    for isa in ISAS:
        for threads in (1, 2, 3):
            assert torch.equal(cache.attend(q, [0, 3], positions, isa=isa, threads=threads,
                                            window=600), base), (isa, threads)
            got = cache.alone(0, 1300).attend(q[2:3], [0, 1], [1299], isa=isa, threads=threads, window=600)
            assert torch.equal(got[0], base[2]), (isa, threads)
    ref = cache.reference(q[2], 0, list(range(700, 1300)))
    assert (base[2].double() - ref).abs().max().item() < 2e-6
    assert (base[2].double() - cache.reference(q[2], 0, list(range(1300)))).abs().max().item() > 1e-3


def test_tree_attention_equals_the_chain_of_each_path():
    """A tree row (root r, children a, b of r, c child of a) attends per node exactly
    as the path decoded as a chain: keys visited in cache order."""
    prefix = 21
    cache = Cache([prefix + 4], seed=7)
    q = _queries(4, 8)
    parent = [-1, 0, 0, 1]
    depth = [0, 1, 1, 2]
    tree = torch.zeros(4, 4, dtype=torch.bool)
    for i in range(4):
        j = i
        while j >= 0:
            tree[i, j] = True
            j = parent[j]
    positions = [prefix + d for d in depth]
    out = cache.attend(q, [0, 4], positions, tree=tree)
    for node in range(4):
        seen = list(range(prefix)) + [prefix + u for u in range(4) if tree[node, u]]
        ref = cache.reference(q[node], 0, seen)
        assert (out[node].double() - ref).abs().max().item() < 2e-6
        # the same keys laid out as a chain: the path's K/V copied to consecutive slots
        path = [u for u in range(4) if tree[node, u]]
        chain = Cache([prefix + len(path)], seed=7)
        s_tree = cache.slots(0, prefix + 4)
        s_chain = chain.slots(0, prefix + len(path))
        chain.k[s_chain[:prefix]] = cache.k[s_tree[:prefix]]
        chain.v[s_chain[:prefix]] = cache.v[s_tree[:prefix]]
        for i, u in enumerate(path):
            chain.k[s_chain[prefix + i]] = cache.k[s_tree[prefix + u]]
            chain.v[s_chain[prefix + i]] = cache.v[s_tree[prefix + u]]
        alone = chain.attend(q[node:node + 1], [0, 1], [prefix + len(path) - 1])
        assert torch.equal(alone[0], out[node]), node
    # power: without the mask, node 2 would see its sibling and differ
    chain_out = cache.attend(q, [0, 4], [prefix + i for i in range(4)])
    assert not torch.equal(chain_out[2], out[2])


def test_attention_skips_long_rows_when_asked():
    cache = Cache([30, 18], seed=9)
    q = _queries(19, 10)
    out = torch.full((19, NH * HD), 7.0)
    cache.attend(q, [0, 1, 19], [29] + list(range(18)), max_queries=16, out=out)
    assert not torch.equal(out[0], torch.full((NH * HD,), 7.0))
    assert torch.equal(out[1:], torch.full((18, NH * HD), 7.0))


def test_attention_errors_name_the_problem():
    cache = Cache([10], seed=11)
    q = _queries(1, 12)
    with pytest.raises(ValueError, match=r"token 0 \(row 0\) must have a position in \[0, context_lens = 10\) \(or -1: padding\), got 10"):
        cache.attend(q, [0, 1], [10])
    cache.tables[0, 1] = 10_000
    with pytest.raises(ValueError, match=r"row 0's block 1 must be in \[0, 64\), got 10000"):
        cache.attend(q, [0, 1], [5])
    cache.tables[0, 1] = -1
    with pytest.raises(ValueError, match=r"row 0's block 1 must be in"):
        cache.attend(q, [0, 1], [5])
    cache = Cache([10], seed=11)
    with pytest.raises(ValueError, match=r"query_start must rise from 0 to tokens = 1"):
        cache.attend(q, [0, 2], [5])
    cache.ctx[0] = 100
    with pytest.raises(ValueError, match=r"row 0's context_lens must be in \[0, 12\]"):
        cache.attend(q, [0, 1], [5])
    if "avx512" not in ISAS:
        with pytest.raises(ValueError, match="isa avx512 is not supported"):
            Cache([10]).attend(q, [0, 1], [5], isa="avx512")


def _write_attend(cache, q, k, v, slots, query_start, positions, threads=1):
    """_C._write_attend_unchecked on strided [1, heads, T, HD] views (transposes of
    [T, heads, HD] rows, as a transformers attention module passes them)."""
    qv, kv, vv = (x.transpose(0, 1)[None] for x in (q, k, v))
    assert not qv.is_contiguous()
    qs = torch.tensor(query_start, dtype=torch.int64)
    pos = torch.tensor(positions, dtype=torch.int64)
    sl = torch.tensor(slots, dtype=torch.int32)
    out = torch.full((1, q.shape[0], NH, cache.hd), float("nan"))
    _C._write_attend_unchecked(
        qv.data_ptr(), qv.stride(1), qv.stride(2), kv.data_ptr(), kv.stride(1), kv.stride(2),
        vv.data_ptr(), vv.stride(1), vv.stride(2), sl.data_ptr(), cache.k.data_ptr(),
        cache.v.data_ptr(), cache.k.shape[0], q.shape[0], NH, NKV, cache.hd,
        len(query_start) - 1, qs.data_ptr(), pos.data_ptr(), cache.ctx.data_ptr(),
        cache.tables.data_ptr(), cache.tables.stride(0), cache.tables.shape[1], 0, BS,
        1.0 / math.sqrt(cache.hd), out.data_ptr(), threads)
    return out[0].reshape(q.shape[0], NH * cache.hd)


def test_write_attend_equals_the_cache_write_then_attention():
    """HFModel's one call a layer: strided K/V written at the slots (padding: nowhere),
    then the same bits as paged attention over contiguous queries; a bad slot or batch
    raises before anything is written."""
    cache = Cache([9, 14], seed=13)
    g = torch.Generator().manual_seed(14)
    q = torch.randn(4, NH, HD, generator=g)
    k, v = torch.randn(4, NKV, HD, generator=g), torch.randn(4, NKV, HD, generator=g)
    # row 0 decodes key 8; row 1 verifies keys 11..13 with a padding token in between
    slots = [int(cache.slots(0, 9)[8]), int(cache.slots(1, 12)[11]), -1,
             int(cache.slots(1, 14)[13])]
    positions = [8, 11, -1, 13]
    want = Cache([9, 14], seed=13)
    for t, s in enumerate(slots):
        if s >= 0:
            want.k[s], want.v[s] = k[t], v[t]
    before_k = cache.k.clone()
    for threads in (1, 2):
        got = _write_attend(cache, q, k, v, slots, [0, 1, 4], positions, threads)
        assert torch.equal(cache.k, want.k) and torch.equal(cache.v, want.v)
        assert torch.equal(got, want.attend(q, [0, 1, 4], positions, threads=threads))
    assert not torch.equal(cache.k, before_k)  # power: the keys were written
    assert torch.equal(got[2], torch.zeros(NH * HD))  # padding attends to nothing
    for bad_slots, bad_pos, match in (
            ([0, 1, -1, 64 * BS], positions, r"token 3's slot must be < num_slots = 256"),
            (slots, [8, 11, -1, 14], r"token 3 \(row 1\) must have a position")):
        k2 = k + 1
        with pytest.raises(ValueError, match=match):
            _write_attend(cache, q, k2, v, bad_slots, [0, 1, 4], bad_pos)
        assert torch.equal(cache.k, want.k) and torch.equal(cache.v, want.v)


# ---- RoPE + cache write, silu * up, the residual norm -----------------------------------

def _rope_tables(max_pos, hd):
    inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))
    ang = torch.arange(max_pos, dtype=torch.float)[:, None] * inv[None, :]
    return (torch.cat([ang.cos(), ang.cos()], -1).contiguous(),
            torch.cat([-ang.sin(), ang.sin()], -1).contiguous())


@pytest.mark.parametrize("isa", ISAS)
def test_rope_kv_write_equals_torch_bitwise(isa):
    from verispec.models.layers.norm_rope import apply_rope
    g = torch.Generator().manual_seed(13)
    t = 5
    qkv = torch.randn(t, (NH + 2 * NKV) * HD, generator=g)
    cos, sin = _rope_tables(64, HD)
    positions = torch.tensor([3, 9, 10, 11, 63], dtype=torch.int64)
    slots = torch.tensor([7, -1, 0, 12, 40], dtype=torch.int32)
    k_pool, v_pool = torch.zeros(48, NKV, HD), torch.zeros(48, NKV, HD)
    q = torch.empty(t, NH, HD)
    _C._rope_kv_write_unchecked(qkv.data_ptr(), qkv.stride(0), t, NH, NKV, HD, positions.data_ptr(),
                                cos.data_ptr(), sin.data_ptr(), 64, slots.data_ptr(),
                                k_pool.data_ptr(), v_pool.data_ptr(), 48, q.data_ptr(), isa)
    x = qkv.view(t, NH + 2 * NKV, HD)
    qk = apply_rope(x[:, :NH + NKV], cos[positions][:, None], sin[positions][:, None])
    assert torch.equal(q, qk[:, :NH])
    kept = [i for i in range(t) if slots[i] >= 0]
    assert torch.equal(k_pool[slots[kept].long()], qk[kept, NH:])
    assert torch.equal(v_pool[slots[kept].long()], x[kept, NH + NKV:])
    written = torch.zeros(48, dtype=torch.bool)
    written[slots[kept].long()] = True
    assert not k_pool[~written].any() and not v_pool[~written].any()  # slot -1 wrote nothing
    with pytest.raises(ValueError, match=r"positions\[1\] must be in \[0, 64\) \(or -1 with slot -1: padding\), got 64"):
        bad = positions.clone()
        bad[1] = 64
        _C._rope_kv_write_unchecked(qkv.data_ptr(), qkv.stride(0), t, NH, NKV, HD, bad.data_ptr(),
                                    cos.data_ptr(), sin.data_ptr(), 64, slots.data_ptr(),
                                    k_pool.data_ptr(), v_pool.data_ptr(), 48, q.data_ptr(), isa)
    with pytest.raises(ValueError, match=r"slots\[4\] must be < num_slots = 40, got 40"):
        _C._rope_kv_write_unchecked(qkv.data_ptr(), qkv.stride(0), t, NH, NKV, HD,
                                    positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), 64,
                                    slots.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), 40,
                                    q.data_ptr(), isa)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def test_rotate_half_rope_equals_torch_bitwise():
    """HFModel's RoPE call: strided [1, heads, T, D] queries and keys (transposes of the
    projections, as a layer passes them) and cos / sin rows with a row stride give bit
    for bit torch's q * cos + rotate_half(q) * sin, into contiguous outputs; bad sizes
    raise before anything is written. Power: the half-swap done the other way round (the
    sign on the second half) is caught."""
    g = torch.Generator().manual_seed(21)
    t, d = 5, HD
    q = torch.randn(1, t, NH, d, generator=g).transpose(1, 2)
    k = torch.randn(1, t, NKV, d, generator=g).transpose(1, 2)
    table = torch.randn(2, t, d + 6, generator=g)  # rows of d + 6 floats: a row stride
    cos, sin = table[0:1, :, :d], table[1:2, :, :d]
    q_out, k_out = torch.empty(1, NH, t, d), torch.empty(1, NKV, t, d)

    def run(q_ptr, heads, tokens, head_dim, stride):
        _C._rotate_half_rope_unchecked(q_ptr, q.stride(1), q.stride(2), heads, k.data_ptr(),
                                       k.stride(1), k.stride(2), NKV, tokens, head_dim,
                                       cos.data_ptr(), sin.data_ptr(), stride, q_out.data_ptr(),
                                       k_out.data_ptr())

    run(q.data_ptr(), NH, t, d, cos.stride(1))
    want_q = q * cos[:, None] + _rotate_half(q) * sin[:, None]
    want_k = k * cos[:, None] + _rotate_half(k) * sin[:, None]
    assert torch.equal(q_out, want_q) and torch.equal(k_out, want_k)
    swapped = q * cos[:, None] + torch.cat((q[..., d // 2:], -q[..., :d // 2]), -1) * sin[:, None]
    assert not torch.equal(q_out, swapped)
    before = q_out.clone()
    for args, match in (((q.data_ptr(), NH, t, d - 1, cos.stride(1)), "head_dim even"),
                        ((q.data_ptr(), 0, t, d, cos.stride(1)), "heads >= 1"),
                        ((q.data_ptr(), NH, t, d, d - 2), "row stride >= head_dim"),
                        ((0, NH, t, d, cos.stride(1)), "null data pointer")):
        with pytest.raises(ValueError, match=match):
            run(*args)
    assert torch.equal(q_out, before)
    run(0, NH, 0, d, 0)  # no tokens: nothing read, nothing written
    assert torch.equal(q_out, before)


@pytest.mark.parametrize("isa", ISAS)
def test_silu_mul_matches_torch(isa):
    g = torch.Generator().manual_seed(17)
    gu = torch.randn(3, 2 * 100, generator=g) * 6
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    out = torch.empty(3, 100)
    _C._silu_mul_unchecked(gu.data_ptr(), 3, 100, gu.stride(0), out.data_ptr(), 100, isa)
    ref = (torch.nn.functional.silu(gu[:, :100].double()) * gu[:, 100:].double())
    assert ((out.double() - ref).abs() <= 4e-7 * ref.abs() + 1e-30).all()
    base = torch.empty(3, 100)
    _C._silu_mul_unchecked(gu.data_ptr(), 3, 100, gu.stride(0), base.data_ptr(), 100, "scalar")
    assert torch.equal(out, base)
    with pytest.raises(ValueError, match="silu_mul: rows must be >= 0, inter >= 1, ld >= 2 inter"):
        _C._silu_mul_unchecked(gu.data_ptr(), 3, 100, 150, out.data_ptr(), 100, isa)


def test_add_rms_norm_equals_add_then_norm():
    g = torch.Generator().manual_seed(19)
    x, delta, w = torch.randn(4, 96, generator=g), torch.randn(4, 96, generator=g), torch.randn(96, generator=g)
    expected_x = x + delta
    expected = torch.empty(4, 96)
    _C._rms_norm_unchecked(expected_x.data_ptr(), 4, 96, 96, w.data_ptr(), 1e-5, expected.data_ptr(), 96)
    out = torch.empty(4, 96)
    _C._add_rms_norm_unchecked(x.data_ptr(), 4, 96, 96, delta.data_ptr(), 96, w.data_ptr(), 1e-5,
                               out.data_ptr(), 96)
    assert torch.equal(x, expected_x) and torch.equal(out, expected)
    before = x.clone()
    with pytest.raises(ValueError, match="add_rms_norm: eps must be >= 0"):
        _C._add_rms_norm_unchecked(x.data_ptr(), 4, 96, 96, delta.data_ptr(), 96, w.data_ptr(), -1.0,
                                   out.data_ptr(), 96)
    assert torch.equal(x, before)  # nothing written on a refused call


# ---- in the model ---------------------------------------------------------------------

def _run(model, native, steps, num_blocks=24, block_size=4):
    from verispec.models.testing import PagedRunner
    model.native_layer_ops = native
    runner = PagedRunner(model, num_blocks=num_blocks, block_size=block_size)
    seqs = {}
    out = []
    for step in steps:
        for name in step:
            if name not in seqs:
                seqs[name] = runner.add_sequence()
        out.append(runner.step({seqs[n]: toks for n, toks in step.items()}))
    return out


def test_model_native_ops_match_torch_ops():
    model = _tiny_llama(seed=3)
    assert model.native_layer_ops
    g = torch.Generator().manual_seed(7)
    tok = lambda n: torch.randint(0, 97, (n,), generator=g).tolist()  # noqa: E731
    steps = [{"a": tok(20), "b": tok(3)}, {"a": tok(1), "b": tok(5), "c": tok(18)},
             {"a": tok(6), "b": tok(1), "c": tok(1)}]
    native, torch_ops = _run(model, True, steps), _run(model, False, steps)
    for rows_n, rows_t in zip(native, torch_ops):
        for a, b in zip(rows_n, rows_t):
            assert (a - b).abs().max().item() < 1e-4


def test_model_rows_are_batch_invariant(monkeypatch):
    """A sequence's logits are bit for bit the same decoded alone or next to others
    (decode rows, verify rows and a prefill chunk sharing its passes). One-row products
    go through verispec's linear kernel too (NATIVE_LINEAR_MIN_ROWS = 1), as a quantized
    model's always do."""
    from verispec.models.layers.linear import NATIVE_LINEAR_MIN_ROWS
    assert NATIVE_LINEAR_MIN_ROWS == 1
    model = _tiny_llama(seed=5)
    g = torch.Generator().manual_seed(9)
    tok = lambda n: torch.randint(0, 97, (n,), generator=g).tolist()  # noqa: E731
    a = [tok(9), tok(1), tok(4), tok(1)]
    others = [{"b": tok(3)}, {"b": tok(6), "c": tok(20)}, {"b": tok(1), "c": tok(1)}, {"c": tok(2)}]
    alone = _run(model, True, [{"a": x} for x in a])
    together = _run(model, True, [{"a": x, **o} for x, o in zip(a, others)])
    for i in range(len(a)):
        assert torch.equal(alone[i][0], together[i][0]), i
    # power: with torch's attention (padded SDPA groups) the rows are not bit-equal
    alone_t = _run(model, False, [{"a": x} for x in a])
    together_t = _run(model, False, [{"a": x, **o} for x, o in zip(a, others)])
    assert any(not torch.equal(alone_t[i][0], together_t[i][0]) for i in range(len(a)))


def test_padding_tokens_read_and_write_nothing():
    """Position -1 with slot -1 (the padding convention of PagedBatch): RoPE gives a zero
    query and writes no slot, attention gives zeros; -1 with a real slot is refused."""
    cos, sin = _rope_tables(16, HD)
    qkv = torch.randn(2, (NH + 2 * NKV) * HD)
    positions = torch.tensor([3, -1], dtype=torch.int64)
    slots = torch.tensor([5, -1], dtype=torch.int32)
    k_pool, v_pool, q = torch.zeros(8, NKV, HD), torch.zeros(8, NKV, HD), torch.full((2, NH, HD), 9.0)

    def rope(slots):
        _C._rope_kv_write_unchecked(qkv.data_ptr(), qkv.stride(0), 2, NH, NKV, HD,
                                    positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), 16,
                                    slots.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), 8,
                                    q.data_ptr())
    rope(slots)
    assert not q[1].any() and q[0].abs().sum() > 0
    assert k_pool[[i for i in range(8) if i != 5]].abs().sum() == 0
    with pytest.raises(ValueError, match=r"positions\[1\] .* got -1 with slot 2"):
        rope(torch.tensor([5, 2], dtype=torch.int32))
    cache = Cache([6], seed=21)
    out = cache.attend(_queries(2, 22), [0, 2], [5, -1])
    assert not out[1].any() and not torch.isnan(out).any()
