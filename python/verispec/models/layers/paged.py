"""The paged-attention plan: one per forward, shared by every layer (LlamaModel, HFModel).

A forward's rows each attend over their own cached keys, found through their block
tables. Everything about that which does not depend on the layer is decided once, here,
on the host (from ``PagedBatch.host_tensor``, so no wait for the device), and uploaded
through the step's staging (``verispec.models.staging``):

- ``groups``: the rows that attend in one padded call (``base.attention_groups``, the
  rule of both models), each a :class:`RowGroup` holding its tokens in the batch, the
  padding of its queries to its longest row, its keys (a slice of the pool when a lone
  row's blocks are consecutive, else one gather index) and who sees what: a chain query
  keys ``0..position``, a tree query (``batch.tree_mask``) the row's prefix and its
  ancestors, both cut by a layer's sliding window (transformers' rule: ``key_pos >
  q_pos - window``; masks are built per window on first use and kept for the forward);
- the ``write`` of the new tokens' K/V (``base.KVWrite``);
- ``native``: the batch's index tensors as verispec's paged CPU kernel reads them
  (:class:`NativeIndex`, ``kernels.paged_attention`` / ``write_attend``).

Softcaps and attention sinks are per layer and do not change the plan: the attention
backends (``layers.attention``) apply them.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from verispec.models.base import KVWrite, PagedBatch, attention_groups
from verispec.models.staging import upload

__all__ = ["KERNEL_MAX_QUERIES", "NativeIndex", "PagedPlan", "RowGroup", "SMALL_ROW_QUERIES"]

# A group of at most this many queries a row attends with two batched matmuls (its
# scores, [kv_heads, queries * group, keys], stay small: a third of an SDPA call at these
# sizes); longer rows (prefill) call SDPA.
SMALL_ROW_QUERIES = 16
# Rows of up to this many new tokens attend in verispec's paged kernel on a float32 CPU
# model (LlamaModel.native_layer_ops, HFModel.native_attention): every decode, verify,
# tree and serving row and prefill chunks up to this size, so a token's attention does
# not depend on how its prompt was chunked or what shares its pass (as the quantized
# products' KERNEL_MAX_ROWS). Longer rows (a long prompt at once) use SDPA's blocked
# kernel: ~2x faster at 512 tokens, ~6x at 1024, rounded differently.
KERNEL_MAX_QUERIES = 512


class NativeIndex:
    """A batch's index tensors as verispec's paged CPU kernels read them (host tensors,
    kept alive for the forward's calls): positions [T] int64, query_start [B + 1] int64,
    context_lens [B] int32, block tables [B, M] int32 (rows dense), the tree mask [T, T]
    bool or None, slots [T] int32."""

    def __init__(self, batch: PagedBatch):
        host = batch.host_tensor
        self.positions = host("positions").to(torch.int64).contiguous()
        self.slots = host("slot_mapping").to(torch.int32).contiguous()
        self.query_start = host("query_start").to(torch.int64).contiguous()
        self.context_lens = host("context_lens").to(torch.int32).contiguous()
        tables = host("block_tables").to(torch.int32)
        self.tables = tables if tables.stride(1) == 1 else tables.contiguous()
        tree = host("tree_mask") if batch.tree_mask is not None else None
        self.tree = None if tree is None else tree.contiguous()
        self.tree_ptr = 0 if self.tree is None else self.tree.data_ptr()
        self.block_size = batch.kv.block_size
        self.num_slots = batch.kv.k[0].shape[0] * self.block_size
        self.num_tokens = self.positions.shape[0]


class RowGroup:
    """Rows attended together: b rows padded to n queries and l keys.

    ``lo, hi``: the group's tokens in the batch when its rows are consecutive, else
    ``tokens`` gathers them; ``q_index``: the padded index of each of its tokens (None:
    no padding); ``key_start`` (a lone row in consecutive blocks: its keys are a slice of
    the pool) or ``key_slots`` [b * l] (padding: slot 0, never seen).
    """

    def __init__(self, rows: list[int], plan: "PagedPlan"):
        starts, ctx_lens, pos = plan.starts, plan.ctx_lens, plan.positions
        self.rows = rows
        self.b = b = len(rows)
        q_lens = [starts[r + 1] - starts[r] for r in rows]
        self.n = n = max(q_lens)
        self.l = l = max(ctx_lens[r] for r in rows)
        self.lo, self.hi = starts[rows[0]], starts[rows[-1] + 1]
        self.tokens: Optional[torch.Tensor] = None
        if rows != list(range(rows[0], rows[-1] + 1)):
            self.tokens = torch.tensor([t for r in rows for t in range(starts[r], starts[r + 1])],
                                       dtype=torch.long)
        bs = plan.block_size
        self.q_index: Optional[torch.Tensor] = None
        q_pos = torch.zeros(b, n, dtype=torch.long)
        index = []
        for i, (r, nq) in enumerate(zip(rows, q_lens)):
            q_pos[i, :nq] = pos[starts[r]:starts[r] + nq]
            index.extend(range(i * n, i * n + nq))
        if len(index) != b * n:
            self.q_index = torch.tensor(index, dtype=torch.long)
        self.key_start: Optional[int] = None
        self.key_slots: Optional[torch.Tensor] = None
        tables = plan.block_tables
        if b == 1:  # the allocator hands a lone sequence blocks 0, 1, 2, ...
            table = tables[rows[0], :-(-l // bs)].tolist()
            if table and table[0] >= 0 and table == list(range(table[0], table[0] + len(table))):
                self.key_start = table[0] * bs
        key_idx = torch.arange(l)
        lens = torch.tensor([ctx_lens[r] for r in rows])
        valid = key_idx[None, :] < lens[:, None]                              # [b, l]
        if self.key_start is None:
            blocks = tables[rows][:, :-(-l // bs)].long()                      # [b, blocks]
            j = key_idx.expand(b, l)
            slots = torch.gather(blocks, 1, j // bs) * bs + j % bs
            self.key_slots = torch.where(valid, slots, 0).clamp_(min=0).reshape(-1)
        # Who sees what: key j of row i is valid below the row's context length; a chain
        # query sees keys 0..position, a tree query its prefix and its ancestors.
        key_pos = key_idx.expand(b, l).clone()
        if plan.tree is None:
            visible = (key_idx[None, None, :] <= q_pos[:, :, None]) & valid[:, None, :]
        else:
            visible = torch.zeros(b, n, l, dtype=torch.bool)
            for i, (r, nq) in enumerate(zip(rows, q_lens)):
                s, prefix = starts[r], ctx_lens[r] - nq
                if prefix < 0:
                    raise ValueError(f"{plan.who}: row {r} has {nq} new tokens but "
                                     f"context_lens {ctx_lens[r]}")
                visible[i, :nq, :prefix] = True
                visible[i, :nq, prefix:prefix + nq] = plan.tree[s:s + nq, s:s + nq]
                key_pos[i, prefix:prefix + nq] = pos[s:s + nq]
        visible[:, :, 0] |= ~(visible.any(-1))  # padded queries: key 0 (dropped anyway)
        self.q_pos, self.key_pos = q_pos, key_pos
        # Fresh prefills of one length (no padding, every row n == l keys) are plain
        # causal attention. ``is_causal`` further asks one row whose positions are 0..n-1.
        same_len = self.q_index is None and all(ctx_lens[r] == l for r in rows)
        self.fresh = plan.tree is None and same_len and n == l and n > 1
        self.is_causal = self.fresh and b == 1 and q_pos[0].tolist() == list(range(n))
        self._visible = visible
        self._masks: dict[Optional[int], Optional[torch.Tensor]] = {}
        self._biases: dict[tuple, tuple] = {}
        # one row of few queries whose keys are a slice of the pool: the lean path
        self.lean = b == 1 and n <= SMALL_ROW_QUERIES and self.key_start is not None
        self.device = plan.device
        self.staging = plan.staging
        if self.q_index is not None:
            self.q_index = upload(self.staging, self.q_index, torch.long, self.device)
        if self.tokens is not None:
            self.tokens = upload(self.staging, self.tokens, torch.long, self.device)
        if self.key_slots is not None:
            self.key_slots = upload(self.staging, self.key_slots, torch.long, self.device)

    def mask(self, window: Optional[int]) -> Optional[torch.Tensor]:
        """bool [b, n, l] of the keys each query sees under a sliding window (transformers'
        rule: key_pos > q_pos - window), or None when every query sees every key."""
        if window is not None and window <= 0:
            window = None
        if window not in self._masks:
            visible = self._visible
            if window is not None:
                visible = visible & (self.key_pos[:, None, :] > self.q_pos[:, :, None] - window)
                visible[:, :, 0] |= ~(visible.any(-1))
            all_visible = bool(visible.all())
            self._masks[window] = (None if all_visible
                                   else upload(self.staging, visible, torch.bool, self.device))
        return self._masks[window]

    def bias(self, window: Optional[int], group: int, dtype: torch.dtype):
        """One row's mask as an additive bias [n * group, l] (0 / -inf; row i * group + j
        for query i, head j of a KV group) with its weight for baddbmm: (bias, 1.0), or
        (a zero scalar, 0.0) when every query sees every key."""
        key = (window, group, dtype)
        if key not in self._biases:
            mask = self.mask(window)
            if mask is None:
                self._biases[key] = (torch.zeros((), dtype=dtype, device=self.device), 0.0)
            else:
                bias = torch.zeros(mask.shape[1:], dtype=dtype, device=self.device)
                bias.masked_fill_(~mask[0], -math.inf)
                self._biases[key] = (bias.repeat_interleave(group, dim=0), 1.0)
        return self._biases[key]

    def keys(self, flat: torch.Tensor) -> torch.Tensor:
        """This group's keys (or values) of one layer's flat pool [slots, KvH, D] ->
        [b, l, KvH, D]: a view of the pool for a slice, else a gather."""
        if self.key_start is not None:
            return flat[self.key_start:self.key_start + self.l][None]
        return flat.index_select(0, self.key_slots).view(self.b, self.l, *flat.shape[1:])


class PagedPlan:
    """Per-forward decisions shared by every layer: slots to write, rows' keys, masks,
    the native kernels' index. ``who`` names the caller in its errors."""

    def __init__(self, batch: PagedBatch, device: torch.device, *, who: str = "PagedBatch"):
        starts = batch.host_tensor("query_start").tolist()  # rising from 0 to T: check_batch
        self.who = who
        self.starts = starts
        self.ctx_lens = batch.host_tensor("context_lens").tolist()
        self.num_rows = len(self.ctx_lens)
        self.num_tokens = starts[-1]
        self.q_lens = [starts[r + 1] - starts[r] for r in range(self.num_rows)]
        self.positions = batch.host_tensor("positions").long()
        self.block_tables = batch.host_tensor("block_tables")
        self.block_size = batch.kv.block_size
        self.device = device
        self.kv = batch.kv
        # checked by check_batch: bool [T, T], a True diagonal
        self.tree = batch.host_tensor("tree_mask")  # the host copy: no wait for the device
        self.staging = batch.staging  # where the plan's host-built tensors are uploaded
        self.batch = batch
        self._write: Optional[KVWrite] = None
        self._groups: Optional[list[RowGroup]] = None
        self._native: Optional[NativeIndex] = None

    @property
    def write(self) -> KVWrite:
        """The new tokens' K/V write (``base.KVWrite``; built at first use: a backend that
        writes the cache itself never needs it)."""
        if self._write is None:
            self._write = KVWrite(self.batch.host_tensor("slot_mapping"), self.device,
                                  self.staging)
        return self._write

    @property
    def groups(self) -> list[RowGroup]:
        """The rows in padded attention calls (built, and checked, at first use)."""
        if self._groups is None:
            self._groups = [RowGroup(rows, self)
                            for rows in attention_groups(self.q_lens, self.ctx_lens)]
        return self._groups

    @property
    def native_index(self) -> NativeIndex:
        """The batch's index as the paged CPU kernels read it (built at first use)."""
        if self._native is None:
            self._native = NativeIndex(self.batch)
        return self._native

    @property
    def long_chain_rows(self) -> bool:
        """Whether a chain row has more than KERNEL_MAX_QUERIES new tokens (a long prompt
        at once, which SDPA attends faster than the paged kernel)."""
        return self.tree is None and max(self.q_lens) > KERNEL_MAX_QUERIES
