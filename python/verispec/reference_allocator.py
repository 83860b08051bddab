"""The paged block allocator in plain Python: the test model and benchmark baseline.

Same design as the native ``verispec.BlockAllocator`` (csrc/cache/block_allocator.cpp):
a stack free list handing out block 0 first, a refcount per block, per sequence a
block table and a length, copy-on-write of a shared partly filled tail on append.
Because the design is the same, both hand out the same block ids for the same
operations, which lets tests compare them exactly.
"""

from __future__ import annotations

from verispec._C import CacheFullError


class PyBlockAllocator:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"BlockAllocator: num_blocks must be > 0, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"BlockAllocator: block_size must be > 0, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_list = list(range(num_blocks - 1, -1, -1))  # pop() gives block 0 first
        self.refcounts = [0] * num_blocks
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}
        self.copies: list[tuple[int, int, int]] = []
        self.next_id = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_list)

    def _seq(self, seq: int) -> list[int]:
        if seq not in self.tables:
            raise KeyError(f"unknown sequence id {seq}")
        return self.tables[seq]

    def add_sequence(self) -> int:
        seq, self.next_id = self.next_id, self.next_id + 1
        self.tables[seq], self.lengths[seq] = [], 0
        return seq

    def _take(self) -> int:
        b = self.free_list.pop()
        self.refcounts[b] = 1
        return b

    def _release(self, b: int) -> None:
        self.refcounts[b] -= 1
        if self.refcounts[b] == 0:
            self.free_list.append(b)

    def blocks_needed(self, seq: int, n: int) -> int:
        if n < 0:
            raise ValueError(f"append: n must be >= 0, got {n}")
        table, length = self._seq(seq), self.lengths[seq]
        if n == 0:
            return 0
        new = -(-(length + n) // self.block_size) - len(table)
        shared_tail = length % self.block_size != 0 and self.refcounts[table[-1]] > 1
        return new + int(shared_tail)

    def append(self, seq: int, n: int) -> list[int]:
        need = self.blocks_needed(seq, n)
        if need > len(self.free_list):
            raise CacheFullError(f"append: needs {need} free blocks, only {len(self.free_list)} free")
        if n == 0:
            return []
        table, length, bs = self.tables[seq], self.lengths[seq], self.block_size
        used = length % bs
        if used and self.refcounts[table[-1]] > 1:  # copy-on-write of the shared tail
            fresh = self._take()
            self.refcounts[table[-1]] -= 1
            self.copies.append((table[-1], fresh, used))
            table[-1] = fresh
        while len(table) * bs < length + n:
            table.append(self._take())
        self.lengths[seq] = length + n
        return [table[p // bs] * bs + p % bs for p in range(length, length + n)]

    def rollback(self, seq: int, new_len: int) -> None:
        table = self._seq(seq)
        if not 0 <= new_len <= self.lengths[seq]:
            raise ValueError(f"rollback: new_len must be in [0, {self.lengths[seq]}], got {new_len}")
        keep = -(-new_len // self.block_size)
        while len(table) > keep:
            self._release(table.pop())
        self.lengths[seq] = new_len

    def fork(self, seq: int) -> int:
        table = list(self._seq(seq))
        for b in table:
            self.refcounts[b] += 1
        child = self.add_sequence()
        self.tables[child], self.lengths[child] = table, self.lengths[seq]
        return child

    def free(self, seq: int) -> None:
        table = self._seq(seq)
        for b in reversed(table):
            self._release(b)
        del self.tables[seq], self.lengths[seq]

    def length(self, seq: int) -> int:
        self._seq(seq)
        return self.lengths[seq]

    def block_table(self, seq: int) -> list[int]:
        return list(self._seq(seq))

    def refcount(self, block: int) -> int:
        return self.refcounts[block]

    def take_block_copies(self) -> list[tuple[int, int, int]]:
        out, self.copies = self.copies, []
        return out
