"""Captured forwards at fixed shapes: one CUDA graph per (rows, queries, key blocks) bucket.

A decode or verify forward of a small model on a GPU is mostly launch overhead: a 1B
Llama token is ~16 layers x a dozen kernels launched from Python, and the plan of each
forward (which keys a row reads, which slots it writes) changes shape with the batch.
Here a forward whose batch fits a bucket runs at the bucket's shapes instead, so one
captured graph serves every batch that fits:

- **The bucket.** ``rows`` (the batch's rows, rounded up to a power of two), ``queries``
  (new tokens per row, rounded up to a power of two, at most MAX_QUERIES) and
  ``key_blocks`` (cache blocks per row, rounded up to a power of two). The forward runs
  ``rows * queries`` tokens: row r's new tokens are tokens ``r * queries ..``; the rest
  are padding (:func:`bucket_for`).
- **Static inputs.** Each bucket owns device buffers (:class:`GraphInputs`) that a
  forward fills before it runs: token ids, positions, write slots, block tables (first
  ``key_blocks`` entries), each row's cached prefix and a [queries, queries] mask of
  which new tokens each new token sees (a chain's lower triangle, a draft tree's
  ancestors). The host builds them from the batch's host copies and uploads them in two
  transfers through the step's staging (no wait); the graph reads them in place.
- **Padding writes nowhere.** A padded token's K/V "write" reads a slot no real token
  of the forward writes and writes the same values back (a fixed-shape write cannot
  skip rows); padded rows read row 0's blocks, padded queries see one key. Their logits
  are computed and never read.
- **Attention.** The forward's attention backend's own capturable path
  (``AttentionBackend.attend_static``, for backends whose class says ``capturable``;
  the others run eagerly): the torch backend's gathers each row's
  ``key_blocks * block_size`` keys through its block table and attends with the mask
  built in the graph from the static inputs, so nothing depends on the rows' context
  lengths but the bucket.
- **Trust.** A bucket is captured at its second forward (CAPTURE_AFTER: shapes seen once
  stay eager). The capture is replayed once and run eagerly on the same inputs; the
  real rows' logits must agree bit for bit, else the bucket stays eager for good (the
  eager run rewrote the same slots with its own values). Counted in ``stats()``.

The graphs themselves are ``torch.cuda.CUDAGraph`` (:class:`CudaGraph`), sharing one
memory pool per cache (a graph's output is copied out before another replays). Off
CUDA, :class:`RecordedGraph` stands in: "capture" keeps the body and "replay" runs it
again into the captured output, so everything around the graph (buckets, padding,
static inputs, the check, the fallback) is exercised on the CPU.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from verispec.models.layers.attention.sdpa import TorchAttention
from verispec.models.staging import upload

__all__ = ["Bucket", "CAPTURE_AFTER", "CudaGraph", "GraphCache", "GraphInputs",
           "MAX_GRAPHS", "MAX_QUERIES", "MAX_ROWS", "MAX_TOKENS", "RecordedGraph",
           "bucket_for"]

#: Rows of a forward that runs captured (more: eager).
MAX_ROWS = 64
#: New tokens a row (decode 1, a verify pass k + 1, a small tree); more: eager.
MAX_QUERIES = 16
#: rows * queries of a bucket (the tokens a captured forward computes); more: eager.
MAX_TOKENS = 512
#: A bucket is captured at its (CAPTURE_AFTER + 1)-th forward.
CAPTURE_AFTER = 1
#: Graphs kept per cache (least recently used dropped first).
MAX_GRAPHS = 48


def _pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class Bucket:
    """The shapes of a captured forward: ``rows`` x ``queries`` tokens, each row's keys
    gathered from ``key_blocks`` blocks."""

    rows: int
    queries: int
    key_blocks: int

    @property
    def tokens(self) -> int:
        return self.rows * self.queries


def bucket_for(q_lens: list[int], ctx_lens: list[int], block_size: int,
               max_blocks: int) -> Optional[Bucket]:
    """The bucket a batch of rows with ``q_lens`` new tokens and ``ctx_lens`` cached keys
    (after the forward) runs in, or None when it fits none (too many rows or tokens, a
    row of more than MAX_QUERIES new tokens, a context past ``max_blocks`` blocks).

    >>> bucket_for([1, 1, 1], [9, 17, 5], 4, 64)
    Bucket(rows=4, queries=1, key_blocks=8)
    """
    if not q_lens or len(q_lens) > MAX_ROWS:
        return None
    q = max(q_lens)
    if q < 1 or q > MAX_QUERIES:
        return None
    rows, queries = _pow2(len(q_lens)), _pow2(q)
    if rows * queries > MAX_TOKENS:
        return None
    need = max(-(-c // block_size) for c in ctx_lens)
    if need > max_blocks:
        return None
    return Bucket(rows, queries, min(_pow2(max(need, 1)), max_blocks))


class GraphInputs:
    """A bucket's static device buffers, filled by :meth:`fill` before each run; the
    graph body reads them through ``ids``, ``positions``, :meth:`write`, :meth:`keys`
    and ``mask`` (after :meth:`prepare`)."""

    def __init__(self, bucket: Bucket, block_size: int, num_slots: int,
                 device: torch.device):
        self.bucket = bucket
        self.block_size = block_size
        self.num_slots = num_slots
        self.device = device
        r, q, m = bucket.rows, bucket.queries, bucket.key_blocks
        n, keys = bucket.tokens, m * block_size
        self._n_ints = 2 * n + r * m + r
        self.ints = torch.zeros(self._n_ints, dtype=torch.long, device=device)
        self.flags = torch.zeros(n + r * q * q, dtype=torch.bool, device=device)
        self.ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = self.ints[:n]
        self.slots = self.ints[n:2 * n]
        self.tables = self.ints[2 * n:2 * n + r * m].view(r, m)
        self.prefix = self.ints[2 * n + r * m:]
        self.valid = self.flags[:n]
        self.qmask = self.flags[n:].view(r, q, q)
        # constants of the bucket (made once, outside any graph)
        j = torch.arange(keys, device=device)
        self._key_block = (j // block_size).expand(r, keys)
        self._key_offset = j % block_size
        self._key_index = j
        self.key_slots: Optional[torch.Tensor] = None
        self.mask: Optional[torch.Tensor] = None

    # -- host side: the batch into the static buffers --------------------------------

    def fill(self, batch: Any) -> Optional[torch.Tensor]:
        """Writes ``batch`` into the buffers (its host copies planned here, two uploads
        through ``batch.staging`` and device-side copies, no wait) and returns the padded
        index of each of ``batch.logits_indices`` (on the device), or None when no slot
        is free for the padding's writes (every slot of the pools written by the batch)."""
        bk, bs = self.bucket, self.block_size
        r, q, m, n = bk.rows, bk.queries, bk.key_blocks, bk.tokens
        host = batch.host_tensor
        starts = host("query_start").to(torch.long)
        ctx = host("context_lens").to(torch.long)
        rows = ctx.shape[0]
        q_lens = starts[1:] - starts[:-1]
        t = int(starts[-1])
        row_of = torch.repeat_interleave(torch.arange(rows), q_lens)          # [T]
        dst = row_of * q + (torch.arange(t) - starts[:-1][row_of])            # [T] padded index
        slots = host("slot_mapping").to(torch.long)
        real = slots >= 0
        # a slot no real token writes: the padding's "write" puts back what it read there
        taken = torch.zeros(t + 1, dtype=torch.bool)
        small = slots[real & (slots <= t)]
        taken[small] = True
        safe = int(torch.argmin(taken.to(torch.uint8)))
        if safe >= self.num_slots and int(real.sum()) < n:
            return None  # padding to place, and every slot written by the batch
        ints = torch.zeros(self._n_ints, dtype=torch.long)
        positions, pad_slots = ints[:n], ints[n:2 * n]
        positions[dst] = host("positions").to(torch.long)
        pad_slots.fill_(safe)
        pad_slots[dst[real]] = slots[real]
        tables = host("block_tables").to(torch.long)[:, :m]
        width = tables.shape[1]
        first = int(tables[0, 0]) if width and int(tables[0, 0]) >= 0 else 0
        table_view = ints[2 * n:2 * n + r * m].view(r, m)
        table_view.fill_(first)
        table_view[:rows, :width] = torch.where(tables >= 0, tables, first)
        prefix = ints[2 * n + r * m:]
        prefix.fill_(1)                                    # padded rows: see key 0 only
        prefix[:rows] = ctx - q_lens
        flags = torch.zeros(n + r * q * q, dtype=torch.bool)
        flags[dst[real]] = True
        qmask = flags[n:].view(r, q, q)
        i = torch.arange(q)
        tree = host("tree_mask") if batch.tree_mask is not None else None
        if tree is None:
            causal = i[None, :] <= i[:, None]                                # [q, q]
            inside = i[None, :] < q_lens[:, None]                             # [rows, q]
            qmask[:rows] = causal[None] & inside[:, None, :] & inside[:, :, None]
        else:
            for b in range(rows):
                lo, hi = int(starts[b]), int(starts[b + 1])
                qmask[b, :hi - lo, :hi - lo] = tree[lo:hi, lo:hi]
        # a padded query (past its row's tokens, or in a padded row) sees its row's
        # first new token, so its softmax has a key
        qmask[:, :, 0] |= ~qmask.any(-1)
        staging, device = batch.staging, self.device
        self.ints.copy_(upload(staging, ints, torch.long, device), non_blocking=True)
        self.flags.copy_(upload(staging, flags, torch.bool, device), non_blocking=True)
        ids = batch.input_ids.to(device)
        self.ids.zero_()
        self.ids.index_copy_(0, upload(staging, dst, torch.long, device), ids)
        picks = dst[host("logits_indices").to(torch.long)]
        return upload(staging, picks, torch.long, device)

    # -- device side: inside the graph ---------------------------------------------

    def prepare(self) -> None:
        """The forward's key slots [rows, keys] and mask [rows, queries, keys] from the
        static inputs (device ops only: part of the captured body)."""
        bk = self.bucket
        q = bk.queries
        blocks = torch.gather(self.tables, 1, self._key_block)
        self.key_slots = (blocks * self.block_size + self._key_offset).reshape(-1)
        rel = self._key_index[None, :] - self.prefix[:, None]                 # [rows, keys]
        in_prefix = rel < 0
        in_new = (rel >= 0) & (rel < q)
        pick = rel.clamp(0, q - 1)[:, None, :].expand(bk.rows, q, rel.shape[1])
        seen = torch.gather(self.qmask, 2, pick) & in_new[:, None, :]
        self.mask = in_prefix[:, None, :] | seen

    def write(self, flat_pool: torch.Tensor, values: torch.Tensor) -> None:
        """flat_pool [slots, KvH, D] <- values [tokens, KvH, D] at the real tokens' slots;
        a padded token writes back what its (unused) slot holds."""
        old = flat_pool.index_select(0, self.slots)
        flat_pool.index_copy_(0, self.slots, torch.where(self.valid[:, None, None], values, old))

    def attend(self, q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor,
               scaling: float) -> torch.Tensor:
        """q [tokens, H, Dk] against each row's gathered keys -> [tokens, H, Dv]: the torch
        backend's capturable path (``TorchAttention.attend_static``)."""
        return _TORCH.attend_static(self, q, k_flat, v_flat, scaling=scaling)


_TORCH = TorchAttention()


class RecordedGraph:
    """The stand-in for a CUDA graph off CUDA: ``capture`` runs the body once and keeps
    it; ``replay`` runs it again into the captured output tensor."""

    def __init__(self, pool: Any = None):
        self._body: Optional[Callable[[], torch.Tensor]] = None
        self.out: Optional[torch.Tensor] = None

    def capture(self, body: Callable[[], torch.Tensor]) -> torch.Tensor:
        self._body = body
        self.out = body()
        return self.out

    def replay(self) -> None:
        self.out.copy_(self._body())


class CudaGraph:
    """One ``torch.cuda.CUDAGraph`` of a body: warmed up on a side stream (as torch asks
    before a capture), captured into the cache's shared memory pool, replayed on the
    current stream."""

    def __init__(self, pool: Any = None):
        self.pool = pool
        self.graph: Any = None
        self.out: Optional[torch.Tensor] = None

    def capture(self, body: Callable[[], torch.Tensor]) -> torch.Tensor:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            body()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=self.pool):
            self.out = body()
        return self.out

    def replay(self) -> None:
        self.graph.replay()


class _Entry:
    def __init__(self, inputs: GraphInputs):
        self.inputs = inputs
        self.graph: Any = None
        self.refused = False


class GraphCache:
    """A model's captured forwards, one per (bucket, KV pools) key (module docstring).

    ``graph``: the graph class (:class:`CudaGraph` on a CUDA device, else
    :class:`RecordedGraph`). ``enabled``: False runs every forward eagerly.
    """

    def __init__(self, device: torch.device, *, graph: Optional[type] = None):
        self.device = torch.device(device)
        self.graph_type = graph or (CudaGraph if self.device.type == "cuda" else RecordedGraph)
        self.enabled = True
        self._entries: "OrderedDict[tuple, _Entry]" = OrderedDict()
        self._seen: dict[tuple, int] = {}
        self._pool: Any = None
        self._stats = dict(captures=0, replays=0, refused=0, evicted=0, eager=0)
        #: Why the latest capture failed (None: none did).
        self.last_error: Optional[str] = None

    def stats(self) -> dict[str, int]:
        """Counters since construction: ``captures`` (graphs captured and checked),
        ``replays`` (forwards served by a trusted graph), ``refused`` (captures whose
        check failed or that raised, ``last_error``: those buckets stay eager),
        ``evicted`` and ``eager`` (forwards
        that fit no bucket, or whose bucket is not captured yet or was refused)."""
        return dict(self._stats, graphs=len(self._entries))

    def clear(self) -> None:
        """Drops every graph (and what they hold of the device's memory)."""
        self._entries.clear()
        self._seen.clear()
        self._pool = None

    def forward(self, batch: Any, body: Callable[[GraphInputs], torch.Tensor],
                max_blocks: int) -> Optional[torch.Tensor]:
        """The logits of ``batch.logits_indices`` through the batch's bucket's graph, or
        None when this forward runs eagerly (the caller's own path). ``body(inputs)``
        runs the model at the bucket's shapes from ``inputs`` and returns the logits of
        every one of its tokens."""
        if not self.enabled:
            return None
        host = batch.host_tensor
        starts = host("query_start").tolist()
        q_lens = [b - a for a, b in zip(starts, starts[1:])]
        bucket = bucket_for(q_lens, host("context_lens").tolist(), batch.kv.block_size,
                            max_blocks)
        if bucket is None:
            self._stats["eager"] += 1
            return None
        kv = batch.kv
        key = (bucket, tuple(p.data_ptr() for p in (*kv.k, *kv.v, *kv.features.values())),
               kv.k[0].shape)
        entry = self._entries.get(key)
        if entry is None:
            seen = self._seen.get(key, 0)
            if len(self._seen) >= 8 * MAX_GRAPHS:  # keys of pools long gone: start over
                self._seen.clear()
            self._seen[key] = seen + 1
            if seen < CAPTURE_AFTER:
                self._stats["eager"] += 1
                return None
            num_slots = kv.k[0].shape[0] * kv.block_size
            entry = _Entry(GraphInputs(bucket, kv.block_size, num_slots, self.device))
            self._entries[key] = entry
            while len(self._entries) > MAX_GRAPHS:
                self._entries.popitem(last=False)
                self._stats["evicted"] += 1
        elif entry.refused:
            self._stats["eager"] += 1
            return None
        self._entries.move_to_end(key)
        picks = entry.inputs.fill(batch)
        if picks is None:
            self._stats["eager"] += 1
            return None
        if entry.graph is None:
            try:
                return self._capture(entry, body, picks)
            except Exception as e:  # noqa: BLE001 - a body that cannot be captured
                # here: this bucket runs eagerly (the caller's path rewrites the same
                # slots), and why is kept for stats()
                entry.refused = True
                self._stats["refused"] += 1
                self.last_error = f"{type(e).__name__}: {e}"
                return None
        entry.graph.replay()
        self._stats["replays"] += 1
        return entry.graph.out.index_select(0, picks)

    def _capture(self, entry: _Entry, body: Callable[[GraphInputs], torch.Tensor],
                 picks: torch.Tensor) -> torch.Tensor:
        """Captures the entry's graph, replays it, runs the body eagerly on the same
        inputs and keeps the graph only if the real rows' logits are equal bit for bit;
        returns the eager logits either way."""
        inputs = entry.inputs

        def run() -> torch.Tensor:
            inputs.prepare()
            return body(inputs)

        if self._pool is None and self.graph_type is CudaGraph:
            self._pool = torch.cuda.graph_pool_handle()
        graph = self.graph_type(self._pool)
        graph.capture(run)
        graph.replay()
        got = graph.out.index_select(0, picks)
        want = run().index_select(0, picks)
        if _same_bits(got, want):
            entry.graph = graph
            self._stats["captures"] += 1
        else:
            entry.refused = True
            self._stats["refused"] += 1
        return want


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.is_floating_point:
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return bool(torch.equal(a.contiguous().view(ints), b.contiguous().view(ints)))
    return bool(torch.equal(a, b))
