"""The model protocol: what verispec needs from a model, and the paged KV pools.

A model is anything that declares its geometry and implements

    forward(batch: PagedBatch) -> logits [R, vocab_size]

over a flattened batch of new tokens from several sequences. Before reading, the model
writes the K/V of every new token into the pools at ``batch.slot_mapping`` (negative
slot = padding: write nothing); it then attends, for each new token of row b, to the
row's first ``positions[t] + 1`` cached tokens through ``block_tables[b]``. It returns
logits only for the flattened token indices in ``batch.logits_indices``.

Wrapping your own module::

    class MyModel:
        def __init__(self, net):
            self.net = net
            self.geometry = ModelGeometry(num_layers=..., num_kv_heads=..., head_dim=...,
                                          vocab_size=..., max_context=...,
                                          dtype=torch.float32, device=torch.device("cpu"))

        def forward(self, batch: PagedBatch) -> torch.Tensor:
            # write K/V of batch.input_ids into batch.kv.k[layer] / batch.kv.v[layer]
            # at batch.slot_mapping, attend through batch.block_tables, then
            return logits[batch.logits_indices]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence, runtime_checkable

import torch


@dataclass(frozen=True)
class ModelGeometry:
    """What verispec must know to allocate a model's KV pools and check its output."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_context: int
    dtype: torch.dtype
    device: torch.device
    # Per-layer cache shapes (num_kv_heads, k_head_dim, v_head_dim) when layers differ or
    # K and V head sizes differ (MLA, global vs local layers); None: every layer is
    # (num_kv_heads, head_dim, head_dim).
    layer_kv: Optional[tuple[tuple[int, int, int], ...]] = None
    # The width of the residual stream: the size of each hidden state a model writes to
    # KVPools.features for a drafter (None: a model that writes none).
    hidden_size: Optional[int] = None

    def __post_init__(self) -> None:
        if self.layer_kv is not None and len(self.layer_kv) != self.num_layers:
            raise ValueError(f"ModelGeometry: layer_kv must have num_layers = {self.num_layers} "
                             f"entries, got {len(self.layer_kv)}")

    def kv_shape(self, layer: int) -> tuple[int, int, int]:
        """(num_kv_heads, k_head_dim, v_head_dim) of layer ``layer``'s cache."""
        if self.layer_kv is not None:
            return self.layer_kv[layer]
        return (self.num_kv_heads, self.head_dim, self.head_dim)


def feature_name(key: int, num_layers: int) -> str:
    """The name of feature-pool ``key`` of a model of ``num_layers`` layers
    (verispec.drafters.Feature.key): layer_input(r), final or final_normed."""
    if key == num_layers + 1:
        return "final_normed"
    if key == num_layers:
        return "final"
    return f"layer_input({key})"


@dataclass
class KVPools:
    """One K and one V pool per layer: [num_blocks, block_size, num_kv_heads, head_dim]
    (per layer, K and V head sizes from ``ModelGeometry.kv_shape``).

    Slot s of a pool is element ``pool.view(-1, num_kv_heads, head_dim)[s]``.

    ``features``: the hidden states a drafter reads (``verispec.drafters.Feature``), one
    pool [num_blocks, block_size, hidden_size] per stream, keyed by ``Feature.key``: r in
    [0, num_layers] the residual stream entering layer r (num_layers: the last layer's
    output before the final norm), num_layers + 1 after the final norm. A model writes
    each token's states at its slot, as it writes its K/V, so they move, copy and roll
    back with the cache. Empty: the model writes none and does no extra work.
    """

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    block_size: int
    features: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def allocate(cls, geometry: ModelGeometry, num_blocks: int, block_size: int, *,
                 features: Sequence[int] = ()) -> "KVPools":
        def pool(*shape: int) -> torch.Tensor:
            return torch.zeros((num_blocks, block_size, *shape), dtype=geometry.dtype,
                               device=geometry.device)

        if features and geometry.hidden_size is None:
            raise ValueError(f"KVPools.allocate: feature pools {list(features)} need "
                             f"geometry.hidden_size, got None")
        shapes = [geometry.kv_shape(i) for i in range(geometry.num_layers)]
        return cls(k=[pool(h, dk) for h, dk, _ in shapes], v=[pool(h, dv) for h, _, dv in shapes],
                   block_size=block_size,
                   features={int(key): pool(geometry.hidden_size) for key in features})

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[0]

    def _all(self) -> tuple[torch.Tensor, ...]:
        return (*self.k, *self.v, *self.features.values())

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copies slot src[i] to slot dst[i] in every K, V and feature pool, reading every
        source before writing (duplicate destinations must carry equal values)."""
        for pool in self._all():
            flat = pool.view(-1, *pool.shape[2:])
            flat[dst] = flat[src]

    def copy_blocks(self, copies: list[tuple[int, int, int]]) -> None:
        """Performs the allocator's copy-on-write copies (src, dst, num_tokens)."""
        for src, dst, n in copies:
            for pool in self._all():
                pool[dst, :n] = pool[src, :n]

    def write_features(self, write: Callable[[torch.Tensor, torch.Tensor], None], key: int,
                       x: torch.Tensor) -> None:
        """Stream ``key``'s states of the forward's tokens, x [T, hidden], into its pool
        through the forward's cache write (``KVWrite``: slot < 0 writes nothing); no-op
        when no drafter asked for it."""
        pool = self.features.get(key)
        if pool is not None:  # as [slots, 1, hidden]: the K/V writes' [slots, heads, dim]
            write(pool.view(-1, 1, pool.shape[-1]), x.reshape(x.shape[0], 1, x.shape[-1]))


@dataclass
class PagedBatch:
    """A flattened batch of T new tokens from B sequences.

    input_ids      [T] int64   new tokens, row after row
    positions      [T] int64   position of each token in its sequence
    slot_mapping   [T] int32   KV slot to write for each token (< 0: padding)
    block_tables   [B, M] int32  each row's block table (-1 past its end)
    context_lens   [B] int32   cached length of each row after this forward
    query_start    [B + 1] int64  row b's tokens are input_ids[query_start[b]:query_start[b+1]]
    logits_indices [R] int64   flattened token indices whose logits to return
    kv             KVPools     the model's pools
    tree_mask      [T, T] bool | None  a draft tree: token t of row b sees the row's keys
                               before its new tokens (cache indices < context_lens[b] - n_b,
                               n_b the row's new tokens) and the row's new tokens u with
                               tree_mask[t, u] (the new tokens are cached in input order at
                               indices context_lens[b] - n_b ..); positions then give RoPE
                               positions only (siblings share one: committed length + depth
                               - 1). tree_mask[t, t] is True; entries across rows are False.
                               SpecDecoder sets it (the core's PassLayout::tree_mask) on the
                               verify pass of a tree step whose rows branch: a committed
                               token sees the row's earlier new tokens, a node those and its
                               ancestors. None: token t sees the row's keys
                               0..positions[t] (a chain)
    host           dict | None the caller's CPU copies of the index tensors (every field
                               above but input_ids and kv; tree_mask too when set), when it
                               has them: a model that plans on the host reads them through
                               host_tensor() without waiting for the device
    target_features  FeatureView | None  a draft pass of a drafter that reads the
                               target's hidden states: the target's feature pools and
                               this pass's rows' target block tables
                               (verispec.drafters.FeatureView); None otherwise
    staging        PlanStaging | None  where the forward uploads what it plans on the host
                               (verispec.models.staging.upload: pinned, asynchronous, into
                               the step's device arena); SpecDecoder sets it. None: plain
                               copies
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start: torch.Tensor
    logits_indices: torch.Tensor
    kv: KVPools
    host: Optional[dict] = None
    tree_mask: Optional[torch.Tensor] = None
    staging: Optional[Any] = None
    target_features: Optional[Any] = None

    _HOST_FIELDS = ("positions", "slot_mapping", "block_tables", "context_lens", "query_start",
                    "logits_indices", "tree_mask")

    @property
    def num_rows(self) -> int:
        return self.context_lens.shape[0]

    def host_tensor(self, name: str) -> torch.Tensor:
        """Index tensor `name` on the CPU: the caller's host copy when it gave one (no
        wait for the device), else a copy of the field."""
        if name not in self._HOST_FIELDS:
            raise ValueError(f"PagedBatch.host_tensor: name must be one of {self._HOST_FIELDS}, "
                             f"got {name!r}")
        if self.host is not None and name in self.host:
            return self.host[name]
        value = getattr(self, name)
        return None if value is None else value.cpu()


@runtime_checkable
class Model(Protocol):
    geometry: ModelGeometry

    def forward(self, batch: PagedBatch) -> torch.Tensor: ...


# Rows attended in one padded call (padded to the group's most queries and keys) while
# the padded work b * n_max * L_max is at most this many times the useful work
# sum(n_b * L_b); see attention_groups.
PADDED_WORK_LIMIT = 2.0


def attention_groups(q_lens: list[int], ctx_lens: list[int]) -> list[list[int]]:
    """How a forward's rows share attention calls (the rule of LlamaModel and HFModel):
    lists of row indices (rows with no new tokens left out), each attended in one call
    padded to its most queries and keys.

    All rows together while the padding stays within PADDED_WORK_LIMIT x the useful
    work (plain decoding, equal verify rows). Otherwise rows with the same number of new
    tokens go together, a group split (longest contexts first) where its key padding
    would pass the limit: so one speculating row, or one long prefill, next to many
    decoding rows costs its own call instead of padding every row to its size."""
    rows = [r for r, n in enumerate(q_lens) if n > 0]
    if not rows:
        return []
    useful = sum(q_lens[r] * ctx_lens[r] for r in rows)
    padded = len(rows) * max(q_lens[r] for r in rows) * max(ctx_lens[r] for r in rows)
    if padded <= PADDED_WORK_LIMIT * useful:
        return [rows]
    by_n: dict[int, list[int]] = {}
    for r in rows:
        by_n.setdefault(q_lens[r], []).append(r)
    groups = []
    for n in sorted(by_n):
        group: list[int] = []
        keys = 0
        for r in sorted(by_n[n], key=lambda r: -ctx_lens[r]):  # the first sets the padding
            padded_keys = (len(group) + 1) * ctx_lens[group[0]] if group else 0
            if padded_keys > PADDED_WORK_LIMIT * (keys + ctx_lens[r]):
                groups.append(sorted(group))
                group, keys = [], 0
            group.append(r)
            keys += ctx_lens[r]
        groups.append(sorted(group))
    return groups


def check_batch(batch: PagedBatch, geometry: ModelGeometry, who: str) -> None:
    """The checks every model's forward makes before reading a batch: the pools match the
    geometry (per layer: K/V heads, K and V head sizes, dtype), the batch's shapes agree,
    query_start rises from 0 to T (the rows' plans rely on it) and a tree_mask is bool
    [T, T] with a True diagonal. ``who`` names the caller in the error (e.g.
    "LlamaModel.forward")."""
    g = geometry
    if len(batch.kv.k) != g.num_layers or len(batch.kv.v) != g.num_layers:
        raise ValueError(f"{who}: batch.kv must hold {g.num_layers} K and V pools (one per "
                         f"layer), got {len(batch.kv.k)} and {len(batch.kv.v)}")
    for i, (kp, vp) in enumerate(zip(batch.kv.k, batch.kv.v)):
        kvh, dk, dv = g.kv_shape(i)
        if (kp.dim() != 4 or tuple(kp.shape[2:]) != (kvh, dk) or vp.dim() != 4
                or tuple(vp.shape[2:]) != (kvh, dv) or kp.dtype != g.dtype
                or vp.dtype != g.dtype):
            raise ValueError(f"{who}: layer {i}'s KV pools must be {g.dtype} K [num_blocks, "
                             f"block_size, {kvh}, {dk}] and V [..., {kvh}, {dv}], got "
                             f"{kp.dtype} {list(kp.shape)} and {vp.dtype} {list(vp.shape)}")
    t = batch.input_ids.shape[0]
    for name in ("positions", "slot_mapping"):
        if getattr(batch, name).shape != (t,):
            raise ValueError(f"{who}: batch.{name} must be [T] = [{t}], "
                             f"got {list(getattr(batch, name).shape)}")
    b = batch.context_lens.shape[0]
    if batch.query_start.shape != (b + 1,) or batch.block_tables.shape[0] != b:
        raise ValueError(f"{who}: with B = {b} rows, query_start must be [B + 1] and "
                         f"block_tables [B, M]; got {list(batch.query_start.shape)} and "
                         f"{list(batch.block_tables.shape)}")
    if b == 0 or t == 0:
        raise ValueError(f"{who}: the batch must hold at least one row and one token")
    starts = batch.host_tensor("query_start").tolist()
    if starts[0] != 0 or starts[-1] != t or any(a > c for a, c in zip(starts, starts[1:])):
        raise ValueError(f"{who}: query_start must rise from 0 to T = {t}, got {starts}")
    tree = batch.tree_mask
    if tree is not None:
        tree = batch.host_tensor("tree_mask")  # the host copy: no wait for the device
        if tuple(tree.shape) != (t, t) or tree.dtype != torch.bool:
            raise ValueError(f"{who}: batch.tree_mask must be bool [T, T] = [{t}, {t}], got "
                             f"{tree.dtype} {list(tree.shape)}")
        if not bool(tree.diagonal().all()):
            raise ValueError(f"{who}: batch.tree_mask must let every token see itself (a True "
                             f"diagonal); token {int((~tree.diagonal()).nonzero()[0])} does not")


class KVWrite:
    """Where a forward writes its new tokens' K/V: one decision per forward, used by every
    layer (LlamaModel's and HFModel's attention plans).

    Slots < 0 are padding and write nothing. Consecutive slots (a row decoding or
    verifying in its own blocks) are one slice copy; anything else an index_copy_.
    """

    def __init__(self, slot_mapping: torch.Tensor, device: torch.device,
                 staging: Optional[Any] = None):
        from verispec.models.staging import upload

        slots = slot_mapping.tolist()
        self.start: Optional[int] = None
        self.index: Optional[torch.Tensor] = None
        self.src: Optional[torch.Tensor] = None  # tokens to write, when some are padding
        kept = [i for i, s in enumerate(slots) if s >= 0]
        if len(kept) == len(slots):
            if slots == list(range(slots[0], slots[0] + len(slots))):
                self.start = slots[0]
                return
        else:
            self.src = upload(staging, kept, torch.long, device)
        self.index = upload(staging, [slots[i] for i in kept], torch.long, device)

    def __call__(self, flat_pool: torch.Tensor, values: torch.Tensor) -> None:
        """flat_pool [slots, kv_heads, head_dim] <- values [T, kv_heads, head_dim]."""
        if self.start is not None:
            flat_pool[self.start:self.start + values.shape[0]] = values
            return
        if self.src is not None:
            values = values.index_select(0, self.src)
        flat_pool.index_copy_(0, self.index, values)
