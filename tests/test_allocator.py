"""Unit tests of the native block allocator, its batch fills and the DLPack views."""

import numpy as np
import pytest
import torch

import verispec


def make(num_blocks=16, block_size=4):
    return verispec.BlockAllocator(num_blocks, block_size)


def test_append_returns_slots_through_the_block_table():
    a = make()
    s = a.add_sequence()
    slots = a.append(s, 6) + a.append(s, 3)
    table = a.block_table(s)
    assert len(table) == 3 and a.length(s) == 9
    assert slots == [table[p // 4] * 4 + p % 4 for p in range(9)]
    assert a.num_free_blocks == 13


def test_rollback_releases_only_whole_trailing_blocks():
    a = make()
    s = a.add_sequence()
    a.append(s, 9)
    table = a.block_table(s)
    a.rollback(s, 5)
    assert a.block_table(s) == table[:2] and a.length(s) == 5
    a.rollback(s, 4)
    assert a.block_table(s) == table[:1]
    a.rollback(s, 0)
    assert a.block_table(s) == [] and a.num_free_blocks == 16


def test_fork_shares_and_copies_the_partial_tail_on_write():
    a = make()
    p = a.add_sequence()
    a.append(p, 6)
    c = a.fork(p)
    assert a.block_table(c) == a.block_table(p)
    assert [a.refcount(b) for b in a.block_table(p)] == [2, 2]
    assert a.blocks_needed(c, 1) == 1
    (slot,) = a.append(c, 1)
    (copy,) = a.take_block_copies()
    assert copy == (a.block_table(p)[1], a.block_table(c)[1], 2)
    assert slot == a.block_table(c)[1] * 4 + 2
    assert a.take_block_copies() == []
    # the parent's tail is its own again: appending copies nothing
    a.append(p, 1)
    assert a.num_pending_block_copies == 0


def test_cache_full_leaves_every_sequence_unchanged():
    a = make(num_blocks=4)
    s, t = a.add_sequence(), a.add_sequence()
    a.append(s, 7)
    a.append(t, 3)
    before = [(a.block_table(x), a.length(x)) for x in (s, t)]
    with pytest.raises(verispec.CacheFullError, match="needs 2 free blocks"):
        a.append(t, 6)
    out = torch.full((20,), 7, dtype=torch.int32)
    with pytest.raises(verispec.CacheFullError):
        a.append_batch([s, t], [1, 9], out)
    assert (out == 7).all()
    assert [(a.block_table(x), a.length(x)) for x in (s, t)] == before
    assert a.num_free_blocks == 1
    assert issubclass(verispec.CacheFullError, RuntimeError)


@pytest.mark.parametrize(
    "call, exc, message",
    [
        (lambda a, s: a.append(s, -1), ValueError, "n must be >= 0, got -1"),
        (lambda a, s: a.append(s + 99, 1), KeyError, "unknown sequence id"),
        (lambda a, s: a.rollback(s, 6), ValueError, r"new_len must be in \[0, 5\].*got 6"),
        (lambda a, s: a.rollback(s, -1), ValueError, "got -1"),
        (lambda a, s: a.fork(s + 99), KeyError, "unknown sequence"),
        (lambda a, s: a.length(s + 99), KeyError, "unknown sequence"),
        (lambda a, s: a.refcount(16), ValueError, r"block must be in \[0, 16\), got 16"),
    ],
)
def test_bad_input_raises_clear_errors(call, exc, message):
    a = make()
    s = a.add_sequence()
    a.append(s, 5)
    with pytest.raises(exc, match=message):
        call(a, s)
    assert a.length(s) == 5 and a.num_free_blocks == 14


def test_double_free_and_bad_geometry():
    a = make()
    s = a.add_sequence()
    a.free(s)
    with pytest.raises(KeyError, match="already freed"):
        a.free(s)
    with pytest.raises(ValueError, match="num_blocks must be > 0, got 0"):
        verispec.BlockAllocator(0, 16)
    with pytest.raises(ValueError, match="block_size must be > 0, got -2"):
        verispec.BlockAllocator(4, -2)
    with pytest.raises(ValueError, match="slot ids are int32"):
        verispec.BlockAllocator(1 << 22, 1 << 10)
    with pytest.raises(TypeError):
        verispec.BlockAllocator(-(1 << 70), 4)  # does not fit int64: no crash


def test_batch_fills_match_the_single_sequence_view():
    a = make(num_blocks=64, block_size=8)
    seqs = [a.add_sequence() for _ in range(5)]
    counts = [1, 8, 9, 0, 23]
    slots = torch.empty(50, dtype=torch.int32)
    a.append_batch(seqs, counts, slots)
    expect = [s for q in seqs for s in [a.block_table(q)[p // 8] * 8 + p % 8 for p in range(a.length(q))]]
    assert slots[:41].tolist() == expect and (slots[41:] == -1).all()

    tables = torch.zeros(5, 4, dtype=torch.int32)
    a.fill_block_tables(seqs, tables)
    for row, q in zip(tables.tolist(), seqs):
        t = a.block_table(q)
        assert row == t + [-1] * (4 - len(t))

    lens = torch.zeros(5, dtype=torch.int32)
    a.fill_context_lens(seqs, lens)
    assert lens.tolist() == counts

    starts, n = [0, 3, 8, 0, 20], [1, 5, 1, 0, 3]
    mapping = torch.zeros(12, dtype=torch.int32)
    a.fill_slot_mapping(seqs, starts, n, mapping)
    want = [a.block_table(q)[p // 8] * 8 + p % 8 for q, s0, c in zip(seqs, starts, n) for p in range(s0, s0 + c)]
    assert mapping[:10].tolist() == want and (mapping[10:] == -1).all()

    # the kernel form gives the same mapping from the filled tables
    rows = torch.tensor([i for i, c in enumerate(n) for _ in range(c)] + [-1, -1], dtype=torch.int32)
    pos = torch.tensor([p for s0, c in zip(starts, n) for p in range(s0, s0 + c)] + [0, -1], dtype=torch.int32)
    assert verispec.slot_mapping(tables, rows, pos, 8).tolist() == mapping.tolist()


def test_batch_fill_arguments_are_checked():
    a = make()
    s = a.add_sequence()
    a.append(s, 9)
    with pytest.raises(ValueError, match=r"block_tables must be int32 \[B, max_blocks\] = \[1, \?\], got int64 \[1, 4\]"):
        a.fill_block_tables([s], torch.zeros(1, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="has 2 columns, sequence 0 needs 3"):
        a.fill_block_tables([s], torch.zeros(1, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"context_lens must be int32 \[B\] = \[1\], got int32 \[2\]"):
        a.fill_context_lens([s], torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"positions \[8, 10\) of sequence 0 must lie in \[0, 9\)"):
        a.fill_slot_mapping([s], [8], [2], torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="must hold sum\\(counts\\) = 3 slots, got 2"):
        a.fill_slot_mapping([s], [0], [3], torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="counts must have len\\(seqs\\) = 1 entries, got 2"):
        a.append_batch([s], [1, 2], torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"slot_mapping must be contiguous, got shape \[4\] with strides \[2\]"):
        a.fill_slot_mapping([s], [0], [3], torch.zeros(8, dtype=torch.int32)[::2])
    with pytest.raises(ValueError, match="seqs must be distinct"):
        a.append_batch([s, s], [1, 1], torch.zeros(2, dtype=torch.int32))
    with pytest.raises(TypeError, match=r"block_tables must be a tensor supporting __dlpack__.*got list"):
        a.fill_block_tables([s], [[0, 0, 0]])
    with pytest.raises(KeyError):
        a.fill_context_lens([s, 99], torch.zeros(2, dtype=torch.int32))
    assert a.length(s) == 9


def test_block_tables_respect_row_stride():
    a = make()
    s = a.add_sequence()
    a.append(s, 5)
    wide = torch.full((1, 6), 9, dtype=torch.int32)
    a.fill_block_tables([s], wide[:, :3])
    assert wide.tolist() == [a.block_table(s) + [-1, 9, 9, 9]]


def test_dlpack_producers_other_than_torch():
    """Any DLPack producer works (numpy here), legacy capsules included."""
    a = make()
    s = a.add_sequence()
    a.append(s, 6)
    lens = np.zeros(1, dtype=np.int32)
    a.fill_context_lens([s], lens)
    assert lens.tolist() == [6]

    class LegacyOnly:
        """Exports through the pre-1.0 protocol only (no max_version keyword)."""

        def __init__(self, t):
            self.t = t

        def __dlpack_device__(self):
            return self.t.__dlpack_device__()

        def __dlpack__(self, stream=None):
            return torch.utils.dlpack.to_dlpack(self.t)

    out = torch.zeros(1, dtype=torch.int32)
    a.fill_context_lens([s], LegacyOnly(out))
    assert out.tolist() == [6]


def test_read_only_versioned_tensors_are_refused():
    a = make()
    s = a.add_sequence()
    ro = np.zeros(1, dtype=np.int32)
    ro.flags.writeable = False
    with pytest.raises((ValueError, BufferError, TypeError)):
        a.fill_context_lens([s], ro)
    assert ro.tolist() == [0]


def test_slot_mapping_kernel_errors():
    tables = torch.tensor([[3, -1]], dtype=torch.int32)
    rows = torch.tensor([0, 0], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"token 1 \(row 0, position 4\) is outside the block table"):
        verispec.slot_mapping(tables, rows, torch.tensor([0, 4], dtype=torch.int32), 4)
    with pytest.raises(ValueError, match=r"positions must be int32 \[T\] = \[2\], got int64 \[2\]"):
        verispec.slot_mapping(tables, rows, torch.tensor([0, 4]), 4)
    with pytest.raises(ValueError, match="block_size must be > 0, got 0"):
        verispec.slot_mapping(tables, rows, rows.clone(), 0)


@pytest.mark.cuda
def test_slot_mapping_cuda_matches_cpu():
    assert verispec.build_info()["cuda_compiled"], "a CUDA GPU is present but verispec was built without CUDA"
    g = torch.Generator().manual_seed(0)
    tables = torch.randint(0, 1000, (99, 7), generator=g, dtype=torch.int32)
    tables[5, 3:] = -1
    rows = torch.randint(-1, 99, (989,), generator=g, dtype=torch.int32)
    pos = torch.randint(-1, 7 * 16, (989,), generator=g, dtype=torch.int32)
    pos[rows == 5] = torch.clamp(pos[rows == 5], max=3 * 16 - 1)
    want = verispec.slot_mapping(tables, rows, pos, 16)
    got = verispec.slot_mapping(tables.cuda(), rows.cuda(), pos.cuda(), 16)
    assert torch.equal(got.cpu(), want)


def test_blocks_for_counts_the_allocators_blocks():
    """verispec.cache.blocks_for, the one count of a pool's blocks (the CLI, the
    benchmarks and the server's fit check): ceil(tokens / block_size), what the
    allocator takes for a new sequence of that length, plus the spare blocks."""
    from verispec.cache import SPARE_BLOCKS, blocks_for

    for block_size in (1, 4, 16):
        for tokens in range(0, 3 * block_size + 2):
            exact = blocks_for(tokens, block_size, spare=0)
            alloc = verispec.BlockAllocator(exact + 1, block_size)
            seq = alloc.add_sequence()
            assert alloc.blocks_needed(seq, tokens) == exact, (tokens, block_size)
            alloc.append(seq, tokens)  # takes exactly that many ...
            assert alloc.num_free_blocks == 1, (tokens, block_size)
            if exact >= 2:  # ... and one block fewer does not hold them (a pool has >= 1)
                short = verispec.BlockAllocator(exact - 1, block_size)
                with pytest.raises(verispec.CacheFullError):
                    short.append(short.add_sequence(), tokens)
            assert blocks_for(tokens, block_size) == exact + SPARE_BLOCKS == exact + 2
            assert blocks_for(tokens, block_size, spare=1) == exact + 1
    assert blocks_for(33) == 3 + 2  # block_size 16 by default
    for bad in (dict(tokens=-1), dict(block_size=0), dict(spare=-1)):
        args = dict(tokens=5, block_size=16, spare=0) | bad
        with pytest.raises(ValueError, match=r"blocks_for: tokens must be >= 0, block_size >= 1 "
                                             r"and spare >= 0, got tokens=-?\d+, block_size=\d+, "
                                             r"spare=-?\d+"):
            blocks_for(**args)
