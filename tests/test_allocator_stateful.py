"""Stateful property test: the native allocator against the Python model.

Hypothesis drives random interleavings of add/append/rollback/fork/free (including
calls that must fail). After every step the native allocator must agree with the
model exactly (same block ids, lengths, refcounts, free counts, copy-on-write
copies), and its refcounts must equal those derived from the block tables alone.
"""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import verispec
from verispec.reference_allocator import PyBlockAllocator

NUM_BLOCKS = 24
BLOCK_SIZE = 4


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.native = verispec.BlockAllocator(NUM_BLOCKS, BLOCK_SIZE)
        self.model = PyBlockAllocator(NUM_BLOCKS, BLOCK_SIZE)
        self.live: list[int] = []
        self.dead: list[int] = []

    def both(self, method: str, *args):
        """Calls both; they must return the same or raise the same exception type."""
        errors = []
        results = []
        for impl in (self.native, self.model):
            try:
                results.append(getattr(impl, method)(*args))
                errors.append(None)
            except (verispec.CacheFullError, KeyError, ValueError) as e:
                errors.append(type(e))
                results.append(None)
        assert errors[0] == errors[1], f"{method}{args}: native {errors[0]}, model {errors[1]}"
        assert results[0] == results[1], f"{method}{args}: {results[0]} != {results[1]}"
        return results[0], errors[0]

    @rule()
    def add(self):
        seq, _ = self.both("add_sequence")
        self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), n=st.integers(-1, 30))
    def append(self, data, n):
        seq = data.draw(st.sampled_from(self.live))
        free_before = self.native.num_free_blocks
        length_before = self.native.length(seq)
        _, err = self.both("append", seq, n)
        if err is not None:  # a failed call changes nothing
            assert self.native.num_free_blocks == free_before
            assert self.native.length(seq) == length_before

    @precondition(lambda self: self.live)
    @rule(data=st.data(), back=st.integers(-2, 12))
    def rollback(self, data, back):
        seq = data.draw(st.sampled_from(self.live))
        self.both("rollback", seq, self.native.length(seq) - back)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        child, _ = self.both("fork", data.draw(st.sampled_from(self.live)))
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.live))
        self.both("free", seq)
        self.live.remove(seq)
        self.dead.append(seq)

    @precondition(lambda self: self.dead)
    @rule(data=st.data())
    def use_after_free(self, data):
        seq = data.draw(st.sampled_from(self.dead))
        for method, args in (("free", ()), ("append", (1,)), ("length", ())):
            _, err = self.both(method, seq, *args)
            assert err is KeyError

    @rule()
    def take_copies(self):
        self.both("take_block_copies")

    @invariant()
    def agree(self):
        assert self.native.num_free_blocks == self.model.num_free_blocks
        assert sorted(self.native.sequence_ids()) == sorted(self.live)
        derived = [0] * NUM_BLOCKS
        for seq in self.live:
            table = self.native.block_table(seq)
            assert table == self.model.block_table(seq)
            assert self.native.length(seq) == self.model.length(seq)
            assert len(table) == -(-self.native.length(seq) // BLOCK_SIZE)
            for b in table:
                derived[b] += 1
        for b in range(NUM_BLOCKS):
            assert self.native.refcount(b) == derived[b] == self.model.refcount(b)
        assert self.native.num_free_blocks == derived.count(0)

    def teardown(self):
        for seq in self.live:
            self.native.free(seq)
        # Every block comes home.
        assert self.native.num_free_blocks == NUM_BLOCKS
        assert self.native.num_sequences == 0


SETTINGS = settings(max_examples=150, stateful_step_count=60, deadline=None, derandomize=True)
AllocatorMachine.TestCase.settings = SETTINGS
TestAllocatorMachine = AllocatorMachine.TestCase


def test_machine_detects_a_wrong_model(monkeypatch):
    """Power: the same machine must catch a model that differs (rollback keeps one
    block too many), so the agreement check above can fail."""

    def leaky_rollback(self, seq, new_len):
        table = self._seq(seq)
        if not 0 <= new_len <= self.lengths[seq]:
            raise ValueError("bad")
        keep = -(-new_len // self.block_size) + 1
        while len(table) > keep:
            self._release(table.pop())
        self.lengths[seq] = new_len

    monkeypatch.setattr(PyBlockAllocator, "rollback", leaky_rollback)
    case = AllocatorMachine.TestCase
    monkeypatch.setattr(case, "settings", settings(SETTINGS, report_multiple_bugs=False))
    with pytest.raises(AssertionError):
        case("runTest").runTest()
