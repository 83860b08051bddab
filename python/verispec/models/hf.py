"""HFModel: any transformers causal LM as a verispec model, on verispec's paged KV pools.

    import transformers, verispec
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    target = verispec.models.HFModel(hf)                     # Qwen, Mistral, Gemma, Phi, ...
    dec = verispec.SpecDecoder(target, verispec.drafters.NGram(), k="auto")

How: transformers computes attention through a registry of attention functions
(``transformers.AttentionInterface``). HFModel registers one function,
``ATTN_IMPLEMENTATION``, selects it on the wrapped model, and calls the model with
explicit ``position_ids``, ``use_cache=False`` (no transformers cache, no mask built by
transformers) and ``logits_to_keep`` (the LM head runs on the rows verify needs; the
model's own final softcap / logit scaling stays); the forward's plan reaches the function
through a context variable (so layers that do not pass keyword arguments down work too).
Per layer the function writes the new tokens' K/V into the layer's pools at the
batch's slot mapping and attends each row's queries over the row's context through
its block table, applying what the module passes: ``scaling``, ``sliding_window`` (per
layer), ``softcap``, attention sinks (``s_aux``), and the batch's tree mask.

No per-architecture code: the cache geometry (K/V heads, K and V head sizes per layer)
is probed with one recording forward at construction, which also proves the function is
really called by every layer. Refused at construction, with the reason: models whose
attention does not go through the interface, layers that compute their own attention
mask and pass it to the function (it masks by position, window and tree only), a
config window that no layer passes down or keeps (unless max_context fits in it), hybrids
whose other layers keep state of their own (recurrent, convolution, a sparse-attention
indexer's keys: that state would need its own cache and rollback), bidirectional
(encoder) models, encoder-decoders, chunked attention (applied by transformers' mask,
not passed down), and models whose forward fails without the mask transformers builds
for its own attention (ALiBi Falcon adds its position bias to it).

Tensor parallelism: ``HFModel(hf_model, tp=tp)`` cuts the model in place along its
config's ``base_model_tp_plan`` (``verispec.models.hf_tp``), one rank of a group.

The wrapped model keeps working for transformers' own generate only after
``set_attn_implementation("sdpa")`` (HFModel selected its function on it).
"""

from __future__ import annotations

import contextvars
import math
import copy
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.nn.modules import module as _nn_module  # its global hooks (_fast_call)

from verispec.models import batch_invariant as _bi
from verispec.models import hf_capture
from verispec.models.base import (KVWrite, ModelGeometry, PagedBatch, attention_groups,
                                  check_batch)
# Forwards of NATIVE_LINEAR_MIN_ROWS..NATIVE_LINEAR_MAX_ROWS tokens (decoding, verify passes) of a
# float32 CPU model run their linear layers on verispec's CPU kernel, as LlamaModel's do.
from verispec.models.llama import (KERNEL_MAX_QUERIES, NATIVE_LINEAR_MAX_ROWS,
                                   NATIVE_LINEAR_MIN_ROWS, native_linear, native_rms_norm)
from verispec.models.staging import upload

__all__ = ["ATTN_IMPLEMENTATION", "HFModel"]

#: The name verispec's paged attention function is registered under in transformers'
#: AttentionInterface (``from_pretrained(..., attn_implementation=ATTN_IMPLEMENTATION)``).
ATTN_IMPLEMENTATION = "verispec_paged"
# The plan (or the construction probe) of the forward running in this thread, read by
# every layer's attention call: a context variable rather than a keyword argument, which
# some models' layers do not pass down to their attention.
_CONTEXT: contextvars.ContextVar[Any] = contextvars.ContextVar("verispec_hf_forward",
                                                                default=None)
# Layer types (config.layer_types) that are plain attention over the KV cache.
_ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "attention", "global", "local")
# Rows of at most this many queries, and any row with softcapping or sinks, attend with
# two batched matmuls; longer rows (prefill) call SDPA.
SMALL_ROW_QUERIES = 16
# The check of a tensor-parallel cut (HFModel._shard): logits of this many tokens before
# and after, within this fraction of their largest (rounding only; a wrong cut misses by
# O(1)), by dtype (None: any other).
SHARD_CHECK_TOKENS = 6
SHARD_CHECK_RTOL = {torch.float64: 1e-6, torch.float32: 1e-4, None: 3e-2}

_registered = False


def register_attention() -> None:
    """Registers verispec's paged attention function in transformers' AttentionInterface
    under ATTN_IMPLEMENTATION (idempotent). Needed before
    ``from_pretrained(..., attn_implementation=ATTN_IMPLEMENTATION)``; HFModel calls it."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTN_IMPLEMENTATION, _paged_attention)
        _registered = True


_NOT_PASSED = object()


@hf_capture.opaque
def _paged_attention(module, query, key, value, attention_mask, *, scaling=None, dropout=0.0,
                     sliding_window=_NOT_PASSED, softcap=None, s_aux=None, **kwargs):
    """transformers' attention-function signature: query [1, H, T, Dk], key [1, KvH, T, Dk],
    value [1, KvH, T, Dv] (the new tokens, after RoPE / q-k norms) -> ([1, T, H, Dv], None).
    ``attention_mask`` is None for every model HFModel accepts (it builds no mask); a layer
    that passes its own is refused at construction (_Probe) and never silently ignored."""
    ctx = _CONTEXT.get()
    if ctx is None:
        raise RuntimeError(
            f"{type(module).__name__}: the model's attention implementation is "
            f"{ATTN_IMPLEMENTATION!r}, which runs only inside verispec.models.HFModel.forward; "
            f"call model.set_attn_implementation('sdpa') to use the model on its own")
    if attention_mask is not None:
        ctx.masked(module, attention_mask)
    if sliding_window is _NOT_PASSED:
        # a layer that passes no window at all, whose window transformers applies through
        # its mask alone: the one it keeps on the module, if any (Qwen2-MoE's sliding
        # layers). A window passed as None is no window (EXAONE 4 keeps the config's
        # window on every module and passes it on its sliding layers only).
        sliding_window = getattr(module, "sliding_window", None)
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int):
            sliding_window = None
    return ctx.attend(module, query, key, value, scaling=scaling, window=sliding_window,
                      softcap=softcap, sinks=s_aux), None


def _describe(mask: Any) -> str:
    """An attention mask a layer passed, as errors name it: "dtype [shape]"."""
    return f"{getattr(mask, 'dtype', type(mask).__name__)} {list(getattr(mask, 'shape', []))}"


@dataclass
class _LayerRecord:
    module: Any
    num_heads: int
    q_head_dim: int
    num_kv_heads: int
    k_head_dim: int
    v_head_dim: int
    causal: bool
    window: Optional[int] = None  # the sliding window the layer attends with


class _Probe:
    """The recording context of the construction forward: what each layer passes."""

    def __init__(self) -> None:
        self.layers: list[_LayerRecord] = []
        self.mask: Optional[str] = None  # the first layer passing its own mask, described

    def masked(self, module, mask) -> None:
        if self.mask is None:
            self.mask = f"{type(module).__name__} passes {_describe(mask)}"

    def attend(self, module, query, key, value, *, scaling, window, softcap, sinks):
        self.layers.append(_LayerRecord(
            module=module, num_heads=query.shape[1], q_head_dim=query.shape[3],
            num_kv_heads=key.shape[1], k_head_dim=key.shape[3],
            v_head_dim=value.shape[3],
            causal=getattr(module, "is_causal", True) is not False,
            window=window if window is not None and window > 0 else None))
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[3])


class _Group:
    """Rows attended together: b rows padded to n queries and l keys."""

    def __init__(self, rows: list[int], plan: "_Plan"):
        starts, ctx_lens, pos = plan.starts, plan.ctx_lens, plan.positions
        self.b = b = len(rows)
        q_lens = [starts[r + 1] - starts[r] for r in rows]
        self.n = n = max(q_lens)
        self.l = l = max(ctx_lens[r] for r in rows)
        # the group's tokens in the batch: [lo, hi) when its rows are consecutive, else
        # gathered by `tokens`
        self.lo, self.hi = starts[rows[0]], starts[rows[-1] + 1]
        self.tokens: Optional[torch.Tensor] = None
        if rows != list(range(rows[0], rows[-1] + 1)):
            self.tokens = torch.tensor([t for r in rows for t in range(starts[r], starts[r + 1])],
                                       dtype=torch.long)
        bs = plan.block_size
        # Queries: padded index of each of the group's tokens (None: no padding).
        self.q_index: Optional[torch.Tensor] = None
        q_pos = torch.zeros(b, n, dtype=torch.long)
        index = []
        for i, (r, nq) in enumerate(zip(rows, q_lens)):
            q_pos[i, :nq] = pos[starts[r]:starts[r] + nq]
            index.extend(range(i * n, i * n + nq))
        if len(index) != b * n:
            self.q_index = torch.tensor(index, dtype=torch.long)
        # Keys: a slice of the pool (one row in consecutive blocks), else slot indices.
        self.key_start: Optional[int] = None
        self.key_slots: Optional[torch.Tensor] = None
        tables = plan.block_tables
        if b == 1:
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
                    raise ValueError(f"PagedBatch: row {r} has {nq} new tokens but context_lens "
                                     f"{ctx_lens[r]}")
                visible[i, :nq, :prefix] = True
                visible[i, :nq, prefix:prefix + nq] = plan.tree[s:s + nq, s:s + nq]
                key_pos[i, prefix:prefix + nq] = pos[s:s + nq]
        visible[:, :, 0] |= ~(visible.any(-1))  # padded queries: key 0 (dropped anyway)
        self.q_pos, self.key_pos = q_pos, key_pos
        self.is_causal = (plan.tree is None and b == 1 and n == l and n > 1
                          and q_pos[0].tolist() == list(range(n)))
        self.all_visible = bool(visible.all())
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


class _Plan:
    """Per-forward decisions shared by every layer: slots to write, rows' keys, masks."""

    def __init__(self, batch: PagedBatch, pool_of: dict[int, int], device: torch.device):
        starts = batch.host_tensor("query_start").tolist()  # rising from 0 to T: check_batch
        self.starts = starts
        self.ctx_lens = batch.host_tensor("context_lens").tolist()
        self.positions = batch.host_tensor("positions").long()
        self.block_tables = batch.host_tensor("block_tables")
        self.block_size = batch.kv.block_size
        self.device = device
        self.kv = batch.kv
        self.pool_of = pool_of
        self.calls = 0
        # checked by check_batch: bool [T, T], a True diagonal
        self.tree = batch.host_tensor("tree_mask")  # the host copy: no wait for the device
        self.staging = batch.staging  # where the plan's host-built tensors are uploaded
        self.write = KVWrite(batch.host_tensor("slot_mapping"), device, batch.staging)
        self.q_lens = [starts[r + 1] - starts[r] for r in range(len(self.ctx_lens))]
        self._groups: Optional[list[_Group]] = None
        self._batch = batch
        self.native = False
        self.keys: Optional[_bi.KeyPlan] = None  # the batch-invariant mode's key plan
        self._native: Optional[dict[str, Any]] = None
        self._native_rows: tuple = ()  # the paged kernel's per-forward row arguments
        self._pools: dict[int, tuple] = {}

    def masked(self, module, mask) -> None:
        raise RuntimeError(f"HFModel.forward: {type(module).__name__} passed its own attention "
                           f"mask ({_describe(mask)}), which verispec's paged attention cannot "
                           f"apply (the construction probe saw none)")

    def prepare_batch_invariant(self) -> None:
        """Every layer attends in ``batch_invariant.attention`` (HFModel's batch-invariant
        mode), over the key plan built now, before the first layer writes the cache."""
        self.keys = _bi.KeyPlan(self._batch, self.device)

    def prepare(self, native: bool) -> None:
        """Decides, before the first layer writes the cache, how layers attend: with
        ``native`` (HFModel.native_attention), layers without softcap or sinks attend in
        verispec's paged CPU kernel unless a chain row has more than KERNEL_MAX_QUERIES
        new tokens, and its checks of the batch run now; otherwise the padded groups are
        built now (their checks too)."""
        self.native = native and self._native_index() is not None
        if not self.native:
            self.groups  # noqa: B018 - built (and checked) before any write
            return
        from verispec import _C

        index, k, v = self._native, self.kv.k[0], self.kv.v[0]
        tables, tree = index["tables"], index["tree"]
        # q and out are not read when checking: any live pointer
        _C._paged_attention_unchecked(
            k.data_ptr(), k.data_ptr(), v.data_ptr(), k.shape[0] * k.shape[1],
            len(self.positions), 1, 1, 1, tables.shape[0], index["query_start"].data_ptr(),
            index["positions"].data_ptr(), index["context_lens"].data_ptr(), tables.data_ptr(),
            tables.stride(0), tables.shape[1], 0 if tree is None else tree.data_ptr(),
            self.block_size, 1.0, k.data_ptr(), 0, 1, check_only=True)

    @property
    def groups(self) -> list[_Group]:
        """The rows in padded attention calls (built at the first layer that needs them)."""
        if self._groups is None:
            self._groups = [_Group(rows, self)
                            for rows in attention_groups(self.q_lens, self.ctx_lens)]
        return self._groups

    def _native_index(self) -> Optional[dict[str, Any]]:
        """The batch's index tensors as the paged kernel reads them, checked once; None
        when the kernel does not take this batch (a chain row of more than
        KERNEL_MAX_QUERIES tokens: a long prompt at once, which SDPA attends faster)."""
        if self._native is None:
            if self.tree is None and max(self.q_lens) > KERNEL_MAX_QUERIES:
                self._native = {}
            else:
                host = self._batch.host_tensor
                tables = host("block_tables").to(torch.int32)
                self._native = dict(
                    positions=self.positions.contiguous(),
                    query_start=host("query_start").to(torch.int64).contiguous(),
                    context_lens=host("context_lens").to(torch.int32).contiguous(),
                    tables=tables if tables.stride(1) == 1 else tables.contiguous(),
                    tree=None if self.tree is None else self.tree.contiguous(),
                    slots=host("slot_mapping").to(torch.int32).contiguous())
                index = self._native
                tables, tree = index["tables"], index["tree"]
                # the kernel's row arguments, the same for every layer of the forward
                self._native_rows = (
                    tables.shape[0], index["query_start"].data_ptr(),
                    index["positions"].data_ptr(), index["context_lens"].data_ptr(),
                    tables.data_ptr(), tables.stride(0), tables.shape[1],
                    0 if tree is None else tree.data_ptr(), self.block_size)
        return self._native or None

    def _write_attend_native(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             pool: int, scaling: float, window: Optional[int]
                             ) -> Optional[torch.Tensor]:
        """A float32 CPU layer in verispec's paged kernel (verispec/layers/decode_ops.h: each
        token's keys in cache order, the same bits whatever shares the pass), in one native
        call that writes the new tokens' K/V to the pools and attends, reading the strided
        [1, heads, T, D] tensors the module passes (no views, transposes or copies made
        here); -> [1, T, H, D]. None (nothing written) when the tensors or pools are not
        laid out for it."""
        entry = self._pools.get(pool)
        if entry is None:  # the pools' layout, once a forward: (KV heads, head size, the
            # pool arguments: the slots to write, the pools and their slot count)
            k_pool, v_pool = self.kv.k[pool], self.kv.v[pool]
            ok = (k_pool.dtype == v_pool.dtype == torch.float32 and k_pool.is_cpu
                  and k_pool.dim() == 4 and k_pool.shape == v_pool.shape
                  and k_pool.is_contiguous() and v_pool.is_contiguous())
            entry = self._pools[pool] = (
                k_pool.shape[2], k_pool.shape[3],
                (self._native["slots"].data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(),
                 k_pool.shape[0] * k_pool.shape[1])) if ok else ()
        if not entry:
            return None
        kvh, d, pools = entry
        _, h, t, _ = query.shape
        if not (query.dtype is key.dtype is value.dtype is torch.float32 and query.is_cpu
                and query.shape[3] == key.shape[3] == value.shape[3] == d
                and key.shape[1] == kvh and h % kvh == 0):
            return None
        if query.stride(3) != 1 or key.stride(3) != 1 or value.stride(3) != 1:
            query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
        out = torch.empty((1, t, h, d), dtype=torch.float32)
        qs, ks, vs = query.stride(), key.stride(), value.stride()
        _native()._write_attend_unchecked(
            query.data_ptr(), qs[1], qs[2], key.data_ptr(), ks[1], ks[2],
            value.data_ptr(), vs[1], vs[2], *pools, t, h, kvh, d, *self._native_rows, scaling,
            out.data_ptr(), torch.get_num_threads(),
            window=window if window is not None and window > 0 else 0)
        return out

    def attend(self, module, query, key, value, *, scaling, window, softcap, sinks):
        pool = self.pool_of.get(id(module))
        if pool is None:
            raise RuntimeError(f"HFModel: attention module {type(module).__name__} "
                               f"(layer_idx {getattr(module, 'layer_idx', None)}) was not seen "
                               f"when the model was probed")
        self.calls += 1
        _, kvh, t, dk = key.shape
        dv = value.shape[3]
        h = query.shape[1]
        if scaling is None:
            scaling = 1.0 / math.sqrt(dk)
        if self.native and softcap is None and sinks is None:
            out = self._write_attend_native(query, key, value, pool, scaling, window)
            if out is not None:
                return out
        k_flat = self.kv.k[pool].view(-1, kvh, dk)
        v_flat = self.kv.v[pool].view(-1, kvh, dv)
        self.write(k_flat, key[0].transpose(0, 1))
        self.write(v_flat, value[0].transpose(0, 1))
        if self.keys is not None:
            return _bi.attention(query[0].transpose(0, 1), k_flat, v_flat, self.keys,
                                 scaling=scaling, window=window, softcap=softcap,
                                 sinks=sinks)[None]
        if len(self.groups) == 1 and self.groups[0].lean and softcap is None and sinks is None:
            return self._attend_lean(self.groups[0], query[0], k_flat, v_flat, scaling, window)
        q = query[0].transpose(0, 1)                                           # [T, H, Dk]
        g0 = self.groups[0]
        if len(self.groups) == 1 and g0.tokens is None and g0.lo == 0 and g0.hi == t:
            return self._attend_group(g0, q, k_flat, v_flat, scaling, window, softcap,
                                      sinks)[None]
        out = q.new_empty(t, h, dv)
        for g in self.groups:
            if g.tokens is None:
                out[g.lo:g.hi] = self._attend_group(g, q[g.lo:g.hi], k_flat, v_flat, scaling,
                                                    window, softcap, sinks)
            else:
                out.index_copy_(0, g.tokens, self._attend_group(
                    g, q.index_select(0, g.tokens), k_flat, v_flat, scaling, window, softcap,
                    sinks))
        return out[None]

    @staticmethod
    def _attend_lean(g: _Group, q, k_flat, v_flat, scaling, window):
        """The common call (plain decoding, a verify pass): one row of few queries whose
        keys are a slice of the pool, no softcap or sinks. q [H, n, Dk] -> [1, n, H, Dv]
        in two batched matmuls over views of the pool (the mask and scaling fused into
        the first)."""
        h, n, dk = q.shape
        kvh, dv = k_flat.shape[1], v_flat.shape[2]
        grp = h // kvh
        k = k_flat[g.key_start:g.key_start + g.l]                               # [L, KvH, Dk]
        v = v_flat[g.key_start:g.key_start + g.l]
        qg = q.view(kvh, grp, n, dk).transpose(1, 2).reshape(kvh, n * grp, dk)  # row i * grp + j
        bias, weight = g.bias(window, grp, q.dtype)
        scores = torch.baddbmm(bias, qg, k.permute(1, 2, 0), beta=weight, alpha=scaling)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
        out = torch.bmm(probs, v.transpose(0, 1))                               # [KvH, n*grp, Dv]
        return out.view(kvh, n, grp, dv).transpose(0, 1).reshape(1, n, h, dv)

    @staticmethod
    def _attend_group(g: _Group, q, k_flat, v_flat, scaling, window, softcap, sinks):
        """q [T_g, H, Dk] of the group's tokens -> [T_g, H, Dv]."""
        h, dk = q.shape[1], q.shape[2]
        kvh, dv = k_flat.shape[1], v_flat.shape[2]
        if g.key_start is not None:
            k = k_flat[g.key_start:g.key_start + g.l][None]                   # [1, L, KvH, Dk]
            v = v_flat[g.key_start:g.key_start + g.l][None]
        else:
            k = k_flat.index_select(0, g.key_slots).view(g.b, g.l, kvh, dk)
            v = v_flat.index_select(0, g.key_slots).view(g.b, g.l, kvh, dv)
        if g.q_index is None:
            qp = q.reshape(g.b, g.n, h, dk)
        else:
            qp = q.new_zeros(g.b * g.n, h, dk)
            qp[g.q_index] = q
            qp = qp.view(g.b, g.n, h, dk)
        if softcap is None and sinks is None and g.n > SMALL_ROW_QUERIES:
            # a fresh prefill that no window cuts is plain causal attention
            causal = g.is_causal and (window is None or window <= 0 or window >= g.l)
            mask = None if causal else g.mask(window)
            out = F.scaled_dot_product_attention(
                qp.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                attn_mask=None if mask is None else mask[:, None], is_causal=causal,
                scale=scaling, enable_gqa=h != kvh).transpose(1, 2)           # [b, n, H, Dv]
        else:
            out = _attend_matmul(qp, k, v, g.mask(window), scaling, softcap, sinks)
        out = out.reshape(g.b * g.n, h, dv)
        return out if g.q_index is None else out[g.q_index]


def _attend_matmul(q, k, v, mask, scaling, softcap, sinks):
    """q [b, n, H, Dk], k [b, L, KvH, Dk], v [b, L, KvH, Dv], mask bool [b, n, L] or None
    -> [b, n, H, Dv], as transformers' eager attention: scores * scaling, softcap
    (tanh(s / c) * c), mask, sinks (one extra logit per head, dropped after the softmax),
    softmax in float32. Query head h reads KV head h // (H / KvH)."""
    b, n, h, dk = q.shape
    l, kvh, dv = k.shape[1], k.shape[2], v.shape[3]
    grp = h // kvh
    qg = q.reshape(b, n, kvh, grp, dk).permute(0, 2, 1, 3, 4).reshape(b * kvh, n * grp, dk)
    if b == 1:  # one row (plain decoding, a verify pass): views of the pool, no copies
        kt, vt = k[0].permute(1, 2, 0), v[0].transpose(0, 1)                  # [KvH, Dk, L], [KvH, L, Dv]
    else:
        kt = k.permute(0, 2, 3, 1).reshape(b * kvh, dk, l)
        vt = v.permute(0, 2, 1, 3).reshape(b * kvh, l, dv)
    scores = torch.bmm(qg, kt) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(b, kvh, n, grp, l)
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, :, None, :], -math.inf)
    if sinks is not None:
        sink = sinks.reshape(1, kvh, 1, grp, 1).to(scores.dtype).expand(b, kvh, n, grp, 1)
        combined = torch.cat([scores, sink], dim=-1)
        combined = combined - combined.amax(dim=-1, keepdim=True)
        probs = torch.softmax(combined, dim=-1, dtype=torch.float32)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    probs = probs.to(v.dtype).reshape(b * kvh, n * grp, l)
    out = torch.bmm(probs, vt)                                              # [b*KvH, n*grp, Dv]
    return out.view(b, kvh, n, grp, dv).permute(0, 2, 1, 3, 4).reshape(b, n, h, dv)


class _CpuKernels:
    """The switch HFModel's CPU kernels read at each call (one object per model, shared
    by its modules; ``HFModel.native_linear`` / ``native_norm`` / ``native_rope`` flip
    it). ``rope`` can be True only where ``rope_found``: some attention module's RoPE
    function was checked and a dispatcher bound in its place (_install_rope)."""

    def __init__(self) -> None:
        self.linear = True
        self.norm = True
        self.rope = self.rope_found = False


def _product(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor],
             kernels: _CpuKernels) -> torch.Tensor:
    """x @ w^T + bias for HFModel's float32 CPU linear layers: products of
    NATIVE_LINEAR_MIN_ROWS..NATIVE_LINEAR_MAX_ROWS rows (decoding, verify passes) on
    verispec's kernel (``verispec.ops.linear``: it streams the weight once for up to 8
    rows; see verispec.models.llama), anything else through F.linear."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if (kernels.linear and NATIVE_LINEAR_MIN_ROWS <= rows <= NATIVE_LINEAR_MAX_ROWS
            and x.dtype is torch.float32 and w.dtype is torch.float32 and x.is_cpu
            and w.is_cpu and w.dim() == 2 and w.shape[1] == k):
        if not x.is_contiguous():
            x = x.contiguous()
        if w.stride(1) != 1 and w.stride(0) != 1:  # neither of matmul_layout's layouts
            w = w.contiguous()
        out = native_linear(x, w, torch.get_num_threads())
        if bias is not None:
            out += bias
        return out
    return F.linear(x, w, bias)


@hf_capture.opaque
def _linear_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear.forward of a float32 CPU model wrapped by HFModel (see _product)."""
    params = self._parameters
    if "weight" in params and "bias" in params:  # as nn.Linear keeps them
        return _product(x, params["weight"], params["bias"], self._verispec_kernels)
    return _product(x, self.weight, self.bias, self._verispec_kernels)


class _Siblings:
    """Linear layers that read the same input one after another (q/k/v projections,
    gate/up): one product over their weights stacked in one matrix, each layer's output
    its slice of it. Seven products per Llama layer become four, as in LlamaModel's fused
    layout; each layer's weight becomes a view of the stacked matrix (no copy kept)."""

    def __init__(self, modules: list[torch.nn.Module], kernels: _CpuKernels) -> None:
        from verispec.models.llama import matmul_layout

        self.kernels = kernels
        self.weight = matmul_layout(torch.cat([m.weight.data for m in modules]))
        self.bias = (None if modules[0].bias is None
                     else torch.cat([m.bias.data for m in modules]))
        self.sizes = []
        start = 0
        for m in modules:
            stop = start + m.weight.shape[0]
            m.weight.data = self.weight[start:stop]
            if self.bias is not None:
                m.bias.data = self.bias[start:stop]
            self.sizes.append(stop - start)
            start = stop
        self.input: Optional[torch.Tensor] = None   # the leader's input, until the last reads
        self.outputs: Optional[tuple[torch.Tensor, ...]] = None  # each sibling's slice


@hf_capture.opaque
def _sibling_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A fused sibling's forward: the first computes every sibling's output for its input;
    the others take their slice when they are called with that same tensor (else, as in
    a code path the probe did not see, their own product)."""
    s: _Siblings = self._verispec_siblings
    i = self._verispec_sibling
    if i == 0:
        s.input, s.outputs = x, _product(x, s.weight, s.bias, s.kernels).split_with_sizes(
            s.sizes, -1)
    elif s.input is not x:
        return _product(x, self.weight, self.bias, s.kernels)
    out = s.outputs[i].contiguous()
    if i == len(s.sizes) - 1:
        s.input = s.outputs = None
    return out


def _record_linear_inputs(model: torch.nn.Module, run) -> list[tuple[torch.nn.Module, Any]]:
    """(module, input tensor) of every nn.Linear call in one forward ``run()``."""
    calls: list[tuple[torch.nn.Module, Any]] = []
    handles = [m.register_forward_pre_hook(lambda mod, args: calls.append((mod, args[0])))
               for m in model.modules() if type(m) is torch.nn.Linear]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return calls


def _sibling_groups(model: torch.nn.Module, calls) -> list[list[torch.nn.Module]]:
    """Runs of consecutive linear calls on the same input tensor whose layers can share
    one product: float32 CPU weights, the same input size, biases on all or none, each
    layer called once per forward, no hooks, no weight shared with another layer."""
    count: dict[int, int] = {}
    for m, _ in calls:
        count[id(m)] = count.get(id(m), 0) + 1
    owners: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1

    def fusable(m: torch.nn.Module) -> bool:
        w = m.weight
        return (count[id(m)] == 1 and w.dtype == torch.float32 and w.device.type == "cpu"
                and owners.get(id(w), 0) == 1
                and (m.bias is None or owners.get(id(m.bias), 0) == 1)
                and not (m._forward_hooks or m._forward_pre_hooks))

    groups, run = [], []
    for m, x in calls:
        if run and x is run[-1][1]:
            run.append((m, x))
            continue
        groups.append(run)
        run = [(m, x)]
    groups.append(run)
    out = []
    for run in groups:
        mods = [m for m, _ in run]
        if (len(mods) >= 2 and all(fusable(m) for m in mods)
                and len({m.in_features for m in mods}) == 1
                and len({m.bias is None for m in mods}) == 1):
            out.append(mods)
    return out


@hf_capture.opaque
def _norm_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """An RMSNorm module's forward (checked at wrap time to compute plain RMSNorm) as one
    pass of verispec's CPU kernel for float32 CPU inputs; the module's own otherwise."""
    w = self._parameters.get("weight")
    if w is None:  # a buffer or plain attribute (_is_plain_rms_norm accepted the tensor)
        w = self.weight
    dim = w.shape[0]
    if (self._verispec_kernels.norm and x.dtype == torch.float32 and x.is_cpu
            and x.shape[-1] == dim):
        return native_rms_norm(x if x.is_contiguous() else x.contiguous(), w,
                               self._verispec_eps)
    return type(self).forward(self, x)


# --- transformers' rotate-half RoPE on verispec's kernel ----------------------------------
# Most modeling modules define their own copy of apply_rotary_pos_emb (q * cos +
# rotate_half(q) * sin, the same for k): about a dozen small torch ops per layer, ~10% of
# a SmolLM2 decode forward on a CPU. Where a module's function computes those very bits
# (checked on random strided inputs, _computes_rotate_half_rope), the name in the module's
# namespace is bound to a dispatcher that runs verispec's one-call kernel inside the
# forwards of HFModels with CPU kernels on, and the original function everywhere else.

_ROPE_NAME = "apply_rotary_pos_emb"
# (heads, KV heads, tokens, head size) of the random inputs a RoPE function is checked on
_ROPE_CHECK_SHAPES = ((4, 2, 3, 8), (3, 1, 1, 64), (2, 2, 5, 128))


def _rope_native(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """rotate_half_rope_f32 (verispec/layers/decode_ops.h) of a forward's [1, heads, T, D] queries
    and keys with [1, T, D] cos / sin rows, all float32 on the CPU, the last dimension
    dense; -> contiguous (q, k) as transformers' apply_rotary_pos_emb returns them, or
    None for any other input (the caller then runs the original)."""
    if not (q.dtype == k.dtype == cos.dtype == sin.dtype == torch.float32
            and q.dim() == 4 and k.dim() == 4 and cos.dim() == 3 and q.is_cpu and k.is_cpu
            and cos.is_cpu and sin.is_cpu):
        return None
    _, h, t, d = q.shape
    kvh = k.shape[1]
    if (q.shape[0] != 1 or k.shape[0] != 1 or k.shape[2] != t or k.shape[3] != d or d % 2
            or cos.shape != (1, t, d) or sin.shape != cos.shape
            or q.stride(3) != 1 or k.stride(3) != 1):
        return None
    if cos.stride(2) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    q_out = torch.empty((1, h, t, d), dtype=torch.float32)
    k_out = torch.empty((1, kvh, t, d), dtype=torch.float32)
    _native()._rotate_half_rope_unchecked(
        q.data_ptr(), q.stride(1), q.stride(2), h, k.data_ptr(), k.stride(1), k.stride(2), kvh,
        t, d, cos.data_ptr(), sin.data_ptr(), cos.stride(1), q_out.data_ptr(), k_out.data_ptr())
    return q_out, k_out


def _rope_dispatch(original):
    """The dispatcher bound in place of a modeling module's checked apply_rotary_pos_emb:
    verispec's kernel inside an HFModel forward with native_rope on, for the call shape
    _rope_native takes (q, k, cos, sin; unsqueeze_dim 1); ``original`` otherwise."""
    import functools

    @hf_capture.opaque
    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        kernels = getattr(_CONTEXT.get(), "kernels", None)
        if (kernels is not None and kernels.rope and not args
                and (not kwargs or (len(kwargs) == 1 and kwargs.get("unsqueeze_dim") == 1))):
            out = _rope_native(q, k, cos, sin)
            if out is not None:
                return out
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb._verispec_original = original
    return apply_rotary_pos_emb


def _computes_rotate_half_rope(fn) -> bool:
    """Whether ``fn(q, k, cos, sin)`` returns exactly (bit for bit) what verispec's kernel
    computes, on random [1, heads, T, D] queries and keys laid out as a layer passes them
    (transposed views) and random [1, T, D] cos / sin, for several head counts, token
    counts and head sizes."""
    g = torch.Generator().manual_seed(0)
    for h, kvh, t, d in _ROPE_CHECK_SHAPES:
        q = torch.randn(1, t, h, d, generator=g).transpose(1, 2)
        k = torch.randn(1, t, kvh, d, generator=g).transpose(1, 2)
        cos, sin = torch.randn(1, t, d, generator=g), torch.randn(1, t, d, generator=g)
        with torch.inference_mode():
            try:
                want = fn(q, k, cos, sin)
            except Exception:  # noqa: BLE001 - any failure: not this function
                return False
            got = _rope_native(q, k, cos, sin)
        if not (isinstance(want, tuple) and len(want) == 2 and got is not None
                and all(torch.is_tensor(w) and w.dtype == x.dtype and w.shape == x.shape
                        and torch.equal(w, x) for w, x in zip(want, got))):
            return False
    return True


def _install_rope(model: torch.nn.Module) -> bool:
    """Binds _rope_dispatch in place of apply_rotary_pos_emb in the namespace of each
    modeling module whose classes' forwards the model runs, where that function passes
    _computes_rotate_half_rope (once per module: a dispatcher already bound stays).
    Returns whether any of the model's modules reads a dispatcher."""
    import inspect

    seen: set[int] = set()
    found = False
    for module in model.modules():
        forward = getattr(type(module), "forward", None)
        space = getattr(inspect.unwrap(forward), "__globals__", None) if forward else None
        if not isinstance(space, dict) or id(space) in seen:
            continue
        seen.add(id(space))
        fn = space.get(_ROPE_NAME)
        if not callable(fn):
            continue
        if getattr(fn, "_verispec_original", None) is not None:
            found = True
        elif _computes_rotate_half_rope(fn):
            space[_ROPE_NAME] = _rope_dispatch(fn)
            found = True
    return found


def _native():
    """verispec's compiled module (imported on first use: a plain import of this module
    does not load it)."""
    global _C_MODULE
    if _C_MODULE is None:
        from verispec import _C

        _C_MODULE = _C
    return _C_MODULE


_C_MODULE = None


def _fast_call(self: torch.nn.Module, *args, **kwargs):
    """__call__ of a model's own module classes under HFModel's CPU kernels (_fast_class):
    straight to the module's forward, skipping nn.Module.__call__'s bookkeeping (the
    arguments packed twice, the hook checks: ~2-3% of a SmolLM2 decode step); with hooks
    registered (a profiler's, a user's), nn.Module.__call__ as usual."""
    if (self._forward_hooks or self._forward_pre_hooks or self._backward_hooks
            or self._backward_pre_hooks or _nn_module._global_forward_hooks
            or _nn_module._global_forward_pre_hooks or _nn_module._global_backward_hooks
            or _nn_module._global_backward_pre_hooks):
        return torch.nn.Module.__call__(self, *args, **kwargs)
    return self.forward(*args, **kwargs)


_FAST_CLASSES: dict[type, type] = {}


def _fast_class(cls: type) -> type:
    """A subclass of ``cls`` (same name and module) whose instances are called through
    _fast_call."""
    sub = _FAST_CLASSES.get(cls)
    if sub is None:
        sub = type(cls.__name__, (cls,), {"__call__": _fast_call, "__module__": cls.__module__,
                                          "__qualname__": cls.__qualname__})
        _FAST_CLASSES[cls] = sub
    return sub


def _install_fast_calls(model: torch.nn.Module) -> None:
    """The model's own module classes (its layers, attention, MLP, ...; not the model
    itself, not torch's modules such as nn.Linear, not modules with their own __call__ or
    compiled) become _fast_class subclasses; _uninstall_cpu_kernels puts them back."""
    for module in model.modules():
        cls = type(module)
        if (module is not model and cls.__call__ is torch.nn.Module.__call__
                and not cls.__module__.startswith("torch.")
                and getattr(module, "_compiled_call_impl", None) is None):
            module._verispec_class = cls
            module.__class__ = _fast_class(cls)


def _install_cpu_kernels(model: torch.nn.Module, run) -> _CpuKernels:
    """Puts verispec's CPU kernels under a float32 CPU model's linear layers and plain
    RMSNorm modules (instance-level forwards; values and parameters unchanged, weight
    matrices in matmul_layout: row-major where verispec's kernel runs them).
    Linear layers that one recording forward ``run()`` shows reading the same input one
    after another share one product (_Siblings). The model's own modules are then called
    straight through (_install_fast_calls)."""
    import types

    from verispec.models.llama import matmul_layout

    kernels = _CpuKernels()
    groups = _sibling_groups(model, _record_linear_inputs(model, run))
    with torch.no_grad():
        fused = set()
        for mods in groups:
            siblings = _Siblings(mods, kernels)
            for i, m in enumerate(mods):
                m._verispec_siblings, m._verispec_sibling = siblings, i
                m._verispec_kernels = kernels
                m.forward = types.MethodType(_sibling_forward, m)
                fused.add(id(m))
        for module in model.modules():
            if id(module) in fused:
                continue
            if type(module) is torch.nn.Linear and module.weight.dtype == torch.float32:
                module.weight.data = matmul_layout(module.weight.data)
                module._verispec_kernels = kernels
                module.forward = types.MethodType(_linear_forward, module)
            elif _is_plain_rms_norm(module):
                module._verispec_kernels = kernels
                module.forward = types.MethodType(_norm_forward, module)
    kernels.rope = kernels.rope_found = _install_rope(model)
    _install_fast_calls(model)
    return kernels


def _uninstall_cpu_kernels(model: torch.nn.Module) -> None:
    """Undoes _install_cpu_kernels (a model wrapped again, e.g. to be cut for tensor
    parallelism): the modules' own forwards back, and each fused sibling's weight its
    own tensor again (same values), so that cutting one does not leave a stale stack.
    Programs captured over those forwards (hf_capture) are invalidated."""
    hf_capture.invalidate()
    with torch.no_grad():
        for m in model.modules():
            if "_verispec_class" in vars(m):
                m.__class__ = m._verispec_class
                del m._verispec_class
            if not hasattr(m, "_verispec_kernels"):
                continue
            if hasattr(m, "_verispec_siblings"):
                m.weight.data = m.weight.data.clone()
                if m.bias is not None:
                    m.bias.data = m.bias.data.clone()
                del m._verispec_siblings, m._verispec_sibling
            vars(m).pop("forward", None)
            vars(m).pop("_verispec_class_forward", None)
            del m._verispec_kernels


def _is_plain_rms_norm(module: torch.nn.Module) -> bool:
    """Whether a module computes weight * x / sqrt(mean(x^2) + eps) (checked on a random
    input against verispec's kernel), so that kernel may run it."""
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    w = getattr(module, "weight", None)
    if (not type(module).__name__.endswith("RMSNorm") or not isinstance(eps, float)
            or not isinstance(w, torch.Tensor) or w.dim() != 1 or w.dtype != torch.float32
            or w.device.type != "cpu" or not w.is_contiguous() or list(module.children())):
        return False
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, w.shape[0], generator=g) * 3
    with torch.no_grad():
        want = module(x)
    got = native_rms_norm(x, w, eps)
    if want.shape != got.shape or not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
        return False
    module._verispec_eps = eps
    return True


# --- the batch-invariant mode (verispec.models.batch_invariant) ---------------------------


@hf_capture.opaque
def _bi_linear_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear.forward in the batch-invariant mode: fixed (ROWS, in) x (in, out) products."""
    return _bi.linear(x, self.weight, self.bias)


@hf_capture.opaque
def _bi_rows_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A norm module's own forward in the batch-invariant mode, on fixed chunks of ROWS rows."""
    forward = self._verispec_class_forward
    return _bi.rows(lambda c: forward(self, c), x)


def _norm_is_row_wise(module: torch.nn.Module) -> bool:
    """Whether a norm module normalizes each row over its last dimension alone, so that
    running it on chunks of rows changes nothing but rounding: its output on a random
    [3, 5, d] input against the chunked one."""
    d = None
    for p in module.parameters(recurse=False):
        if p.dim() == 1:
            d = p.shape[0]
    d = d or getattr(module, "normalized_shape", (None,))[-1]
    if not isinstance(d, int) or d < 1:
        return False
    p0 = next(module.parameters(), None)
    dtype = p0.dtype if p0 is not None else torch.float32
    device = p0.device if p0 is not None else torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, d, generator=g) * 3).to(device=device, dtype=dtype)
    forward = type(module).forward
    try:
        with torch.no_grad():
            want = forward(module, x)
            got = _bi.rows(lambda c: forward(module, c), x, 4)
    except Exception:  # noqa: BLE001 - a norm that needs more than one input: not wrapped
        return False
    return (torch.is_tensor(want) and want.shape == got.shape
            and torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2))


def _install_batch_invariant(model: torch.nn.Module) -> None:
    """Puts the batch-invariant ops under a model's nn.Linear layers and row-wise norm
    modules (instance-level forwards, undone by _uninstall_cpu_kernels)."""
    import types

    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module._verispec_kernels = None
            module.forward = types.MethodType(_bi_linear_forward, module)
        elif (type(module).__name__.endswith("Norm") and not list(module.children())
              and _norm_is_row_wise(module)):
            module._verispec_kernels = None
            module._verispec_class_forward = type(module).forward
            module.forward = types.MethodType(_bi_rows_forward, module)


# aten ops that compute each output element from inputs without summing floats (data
# movement, allocation, masks), besides the pointwise-tagged ops and views
_ROW_LOCAL_OPS = frozenset((
    "embedding", "index_select", "index", "gather", "cat", "stack", "clone", "copy_", "copy",
    "_to_copy", "empty", "empty_like", "empty_strided", "zeros", "zeros_like", "ones",
    "ones_like", "full", "full_like", "arange", "new_zeros", "new_empty", "new_ones",
    "new_full", "new_empty_strided", "fill_", "fill", "index_copy_", "index_copy",
    "index_put_", "index_put", "scatter", "scatter_", "repeat", "repeat_interleave",
    "_unsafe_view", "split", "split_with_sizes", "unbind", "chunk", "flip", "roll",
    "lift_fresh", "lift_fresh_copy", "_local_scalar_dense", "scalar_tensor", "triu", "tril",
    "masked_fill", "masked_fill_", "where", "constant_pad_nd", "slice_scatter",
    "select_scatter", "detach", "alias", "contiguous", "resize_", "set_", "sym_size",
    "sym_stride", "sym_numel", "_assert_async", "is_nonzero"))
# products that are exact when they reduce over one term (RoPE's angle outer products)
_PRODUCT_OPS = {"mm": 0, "bmm": 0, "matmul": 0, "addmm": 1, "baddbmm": 1, "dot": 0, "mv": 0}


def _row_local(func: Any, args: tuple) -> bool:
    """Whether an aten op's result for one token cannot depend on the others in its pass."""
    name = func.overloadpacket.__name__
    if torch.Tag.pointwise in func.tags or func.is_view or name in _ROW_LOCAL_OPS:
        return True
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if tensors and not any(t.is_floating_point() or t.is_complex() for t in tensors):
        return True  # integer and boolean arithmetic is exact in any order
    if name in _PRODUCT_OPS:
        a = args[_PRODUCT_OPS[name]]
        return isinstance(a, torch.Tensor) and a.shape[-1] == 1
    if name in ("dropout", "feature_dropout", "alpha_dropout"):  # identity in eval mode
        return len(args) > 2 and args[2] is False
    return False


def _batch_invariant_problems(run) -> list[str]:
    """The ops of one forward ``run()`` outside the batch-invariant ops (linear layers,
    wrapped norms, attention) that may round a token by what shares its pass, as
    "aten.op (in Module)"; empty when there are none."""
    from torch.nn.modules import module as nn_module
    from torch.utils._python_dispatch import TorchDispatchMode

    stack: list[str] = []
    found: dict[str, None] = {}

    class Check(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if _bi._depth == 0 and not _row_local(func, args):
                where = stack[-1] if stack else "the model's forward"
                found.setdefault(f"aten.{func.overloadpacket.__name__} (in {where})")
            return func(*args, **(kwargs or {}))

    def enter(module, args) -> None:
        stack.append(type(module).__name__)

    def leave(module, args, output) -> None:  # returns None: the output stays
        if stack:
            stack.pop()

    pre = nn_module.register_module_forward_pre_hook(enter)
    post = nn_module.register_module_forward_hook(leave)
    try:
        with Check():
            run()
    finally:
        pre.remove()
        post.remove()
    return list(found)


def _shallow_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A new module object sharing every parameter, buffer and child with ``module``, whose
    children can be replaced without touching the original."""
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    return clone


def _refuse(model: Any, why: str) -> ValueError:
    return ValueError(f"HFModel: {type(model).__name__} is not supported: {why}")


class HFModel:
    """A transformers ``*ForCausalLM`` (any dtype, any device) as a verispec model.

    ``max_context`` caps the context (default: the config's ``max_position_embeddings``).
    ``tokenizer`` (optional: a transformers tokenizer or verispec's Tokenizer) records the
    vocabulary, so SpecDecoder can refuse a draft with a different tokenizer.
    ``cpu_kernels`` (float32 models on an x86 CPU with AVX2 or AVX-512): run the model's
    ``nn.Linear`` layers of verify passes and its plain RMSNorm modules on verispec's CPU
    kernels, and store its weight matrices in the layout those read fastest
    (``verispec.models.llama.matmul_layout``; same values). This sets
    instance-level ``forward`` methods on those modules of ``hf_model``, and gives its own
    module classes below the top level same-named subclasses called straight through
    ``forward`` while no hooks are registered (``_install_fast_calls``). Where the
    model's modeling module defines an ``apply_rotary_pos_emb`` that computes
    rotate-half RoPE bit for bit as verispec's kernel does (checked on random inputs),
    that name in the module's namespace is bound to a dispatcher running the kernel
    inside this model's forwards (``native_rope``) and the original function anywhere
    else, so unwrapped models of the same class compute exactly what they did.
    ``tp`` (a ``verispec.distributed.TensorParallel``): make this model one rank of a
    tensor-parallel group by cutting ``hf_model``'s modules in place along its config's
    ``base_model_tp_plan`` (``verispec.models.hf_tp``; every rank must pass the same model);
    ``geometry`` then reports this rank's KV heads. ``verispec.distributed.shard`` does it
    for a wrapped model.
    ``capture`` (default True): run decode and verify forwards as captured programs
    (``HFModel.capture``, ``verispec.models.hf_capture``); off for tensor parallelism and
    for a model compiled with ``torch.compile``.
    ``batch_invariant``: every forward gives a token's logits the same bits whatever the
    number of tokens in its pass and whatever shares it (docs/design.md, "Batch-invariant
    mode"), on any device: the model's ``nn.Linear`` layers and its row-wise norm modules
    run on fixed chunks of rows and every layer attends in
    ``verispec.models.batch_invariant.attention`` (windows, softcaps, sinks and trees as
    the paged attention honours them); ``cpu_kernels`` and ``capture`` are then off.
    Refused (ValueError naming the ops and modules) where one recording forward shows
    the model computing anything else that torch may round by the pass's shape, e.g. a
    mixture-of-experts router's softmax and top-k or expert products outside
    ``nn.Linear``; and with ``tp``.
    """

    def __init__(self, hf_model: Any, *, max_context: Optional[int] = None,
                 tokenizer: Any = None, cpu_kernels: bool = True, tp: Any = None,
                 capture: bool = True, batch_invariant: bool = False) -> None:
        if not isinstance(hf_model, torch.nn.Module) or not hasattr(hf_model, "config"):
            raise TypeError(f"HFModel: hf_model must be a loaded transformers model "
                            f"(*ForCausalLM), got {type(hf_model).__name__}")
        _bi.refuse_tp("HFModel", batch_invariant, tp)
        #: See the class docstring (fixed at construction).
        self.batch_invariant = batch_invariant
        register_attention()
        _uninstall_cpu_kernels(hf_model)  # wrapped before: start from the modules' own code
        config = hf_model.config
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        if getattr(config, "is_encoder_decoder", False):
            raise _refuse(hf_model, "it is an encoder-decoder model; verispec runs decoder-only "
                                    "causal LMs")
        layer_types = set(getattr(text, "layer_types", None) or [])
        if getattr(text, "attention_chunk_size", None) or "chunked_attention" in layer_types:
            raise _refuse(hf_model, "chunked attention (attention_chunk_size) is applied by "
                                    "transformers' mask, not passed to the attention function")
        other = sorted(t for t in layer_types if t not in _ATTENTION_LAYER_TYPES)
        if other:
            raise _refuse(hf_model, f"a hybrid: its layer types {other} are not plain "
                                    f"attention over the KV cache; they keep state of their own "
                                    f"(recurrent, convolution, or a sparse-attention indexer's "
                                    f"keys) outside verispec's pools, which would need its own "
                                    f"cache and rollback on rejected drafts")
        params = [p for p in hf_model.parameters() if p.is_floating_point()]
        if not params:
            raise TypeError(f"HFModel: {type(hf_model).__name__} has no floating-point weights")
        dtype, device = params[0].dtype, params[0].device
        previous = getattr(config, "_attn_implementation", None)
        was_training = hf_model.training
        hf_model.eval()
        try:
            try:
                hf_model.set_attn_implementation(ATTN_IMPLEMENTATION)
            except Exception as e:  # noqa: BLE001 - transformers raises several kinds
                raise _refuse(hf_model, f"transformers would not select the attention function "
                                        f"{ATTN_IMPLEMENTATION!r}: {e}") from e
            if getattr(config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
                raise _refuse(hf_model, "its attention does not go through transformers' "
                                        "AttentionInterface")
            self.model = hf_model
            self._captures = None
            try:
                probe, logits = self._probe(device)
            except Exception as e:  # noqa: BLE001 - whatever the model's own code raises
                # A forward that needs what transformers builds for its own attention (a
                # mask it adds a position bias to, as ALiBi Falcon's) fails here: refused
                # with its error, not raised from deep inside the model's code.
                raise _refuse(hf_model, f"its forward fails with the attention function "
                                        f"{ATTN_IMPLEMENTATION!r} selected (transformers "
                                        f"builds no attention mask for it): "
                                        f"{type(e).__name__}: {e}") from e
            layers = probe.layers
            num_layers = getattr(text, "num_hidden_layers", None)
            if not layers:
                raise _refuse(hf_model, "its layers never called the attention function "
                                        "(attention does not go through transformers' "
                                        "AttentionInterface)")
            if len({id(r.module) for r in layers}) != len(layers):
                raise _refuse(hf_model, "one attention module is called more than once per "
                                        "forward")
            if num_layers is not None and len(layers) < num_layers:
                raise _refuse(hf_model, f"only {len(layers)} of its {num_layers} layers call the "
                                        f"attention function; the others (recurrent, convolution "
                                        f"or custom attention) keep state verispec cannot roll "
                                        f"back")
            if num_layers is not None and len(layers) > num_layers:
                raise _refuse(hf_model, f"{len(layers)} attention modules called the attention "
                                        f"function, but its config has num_hidden_layers = "
                                        f"{num_layers} (a decoder whose layers the config does "
                                        f"not count, as an encoder-decoder family's causal LM)")
            if probe.mask is not None:
                raise _refuse(hf_model, f"its attention layers compute their own attention "
                                        f"mask ({probe.mask}), which verispec's paged "
                                        f"attention does not apply (it masks by position, "
                                        f"sliding window and tree)")
            window = getattr(text, "sliding_window", None)
            limit = (max_context if isinstance(max_context, int)
                     and not isinstance(max_context, bool)
                     else getattr(text, "max_position_embeddings", None))
            if (isinstance(window, int) and not isinstance(window, bool) and window > 0
                    and (not isinstance(limit, int) or window < limit)
                    and "sliding_attention" in (layer_types or {"sliding_attention"})
                    and not any(r.window for r in layers)):
                raise _refuse(hf_model, f"its config sets sliding_window = {window}, which "
                                        f"transformers applies through its attention mask, but "
                                        f"no layer passes a window to the attention function; "
                                        f"pass max_context <= {window} to run it without one")
            if not all(r.causal for r in layers):
                raise _refuse(hf_model, "its attention is bidirectional (an encoder); verispec "
                                        "runs causal LMs")
            if logits.dim() != 3 or logits.shape[:2] != (1, 1):
                raise _refuse(hf_model, f"its forward ignored logits_to_keep (logits "
                                        f"{list(logits.shape)} for one kept row)")
            if tp is not None:
                self._shard(tp, layers, int(logits.shape[-1]), device)
                probe, logits = self._probe(device)  # this rank's heads
                layers = probe.layers
            if batch_invariant:
                _install_batch_invariant(hf_model)
                problems = _batch_invariant_problems(lambda: self._probe(device))
                if problems:
                    _uninstall_cpu_kernels(hf_model)
                    shown = ", ".join(problems[:6]) + (", ..." if len(problems) > 6 else "")
                    raise _refuse(hf_model, f"batch_invariant=True: its forward computes "
                                            f"{shown} outside its nn.Linear layers, row-wise "
                                            f"norms and attention; torch may round such an "
                                            f"op's result for a token by how many tokens share "
                                            f"the pass (a float reduction or product whose "
                                            f"kernel follows the shape, e.g. a mixture-of-"
                                            f"experts router's softmax and top-k)")
        except BaseException:
            hf_model.train(was_training)
            if previous is not None and previous != ATTN_IMPLEMENTATION:
                try:
                    hf_model.set_attn_implementation(previous)
                except Exception:  # noqa: BLE001 - best effort: the refusal is what matters
                    pass
            raise
        if max_context is None:
            max_context = getattr(text, "max_position_embeddings", None)
            if not max_context:
                raise ValueError(f"HFModel: {type(hf_model).__name__}'s config has no "
                                 f"max_position_embeddings; pass max_context")
        if isinstance(max_context, bool) or not isinstance(max_context, int) or max_context < 1:
            raise ValueError(f"HFModel: max_context must be a positive int, got {max_context!r}")
        self.layers = layers
        self.tp = tp
        self._pool_of = {id(r.module): i for i, r in enumerate(layers)}
        shapes = tuple((r.num_kv_heads, r.k_head_dim, r.v_head_dim) for r in layers)
        uniform = len(set(shapes)) == 1 and shapes[0][1] == shapes[0][2]
        self.geometry = ModelGeometry(
            num_layers=len(layers), num_kv_heads=shapes[0][0], head_dim=shapes[0][1],
            vocab_size=int(logits.shape[-1]), max_context=int(max_context), dtype=dtype,
            device=device, layer_kv=None if uniform else shapes)
        self.model_type = getattr(text, "model_type", type(hf_model).__name__)
        from verispec import _C

        #: Layers without softcapping or sinks attend in verispec's paged CPU kernel unless
        #: a forward holds a chain row of more than KERNEL_MAX_QUERIES new tokens (float32
        #: CPU models): a token attends bit for bit the same whatever shares its pass and
        #: however its prompt was chunked. Set False to use the padded torch paths.
        self.native_attention = (device.type == "cpu" and dtype == torch.float32
                                 and not batch_invariant)
        self._kernels: Optional[_CpuKernels] = None
        if cpu_kernels and device.type == "cpu" and dtype == torch.float32 and (
                _C.linear_best_isa() != "scalar") and not batch_invariant:
            self._kernels = _install_cpu_kernels(hf_model, lambda: self._probe(device))
        #: Captured forwards of decode and verify passes (verispec.models.hf_capture);
        #: ``capture=False`` (or tensor parallelism, or the batch-invariant mode, whose
        #: attention steps follow the context lengths) runs every forward eagerly.
        self._captures = (hf_capture.Captures(hf_model) if capture and tp is None
                          and not batch_invariant
                          and getattr(hf_model, "_compiled_call_impl", None) is None else None)
        self.tokenizer_fingerprint: Optional[str] = None
        if tokenizer is not None:
            from verispec.models.tokenizer import vocabulary_fingerprint

            self.tokenizer_fingerprint = vocabulary_fingerprint(tokenizer)

    @property
    def num_layers(self) -> int:
        return self.geometry.num_layers

    @property
    def native_linear(self) -> bool:
        """Whether the model's linear layers run verify passes (2..16 tokens) on
        verispec's CPU kernel (float32 CPU models; set False to compare with torch's)."""
        return self._kernels is not None and self._kernels.linear

    @native_linear.setter
    def native_linear(self, on: bool) -> None:
        if self._kernels is not None:
            self._kernels.linear = bool(on)

    @property
    def native_norm(self) -> bool:
        """Whether the model's plain RMSNorm modules run as one pass of verispec's CPU
        kernel (float32 CPU models; set False to run the modules' own code)."""
        return self._kernels is not None and self._kernels.norm

    @native_norm.setter
    def native_norm(self, on: bool) -> None:
        if self._kernels is not None:
            self._kernels.norm = bool(on)

    @property
    def native_rope(self) -> bool:
        """Whether the model's rotate-half RoPE runs as one call of verispec's CPU kernel
        (float32 CPU models whose modeling module's apply_rotary_pos_emb computes the
        kernel's bits; set False to run the model's own function)."""
        return self._kernels is not None and self._kernels.rope

    @native_rope.setter
    def native_rope(self, on: bool) -> None:
        if self._kernels is not None:
            self._kernels.rope = bool(on) and self._kernels.rope_found

    @property
    def capture(self) -> bool:
        """Whether decode and verify forwards (up to ``hf_capture.MAX_TOKENS`` tokens) run
        as captured programs: each token count's forward recorded once as straight-line
        code over the same ops and checked bit for bit against the eager forward
        (``verispec.models.hf_capture``). Set False to run every forward eagerly."""
        return self._captures is not None and self._captures.enabled

    @capture.setter
    def capture(self, on: bool) -> None:
        if on and self.batch_invariant:
            raise ValueError("HFModel.capture: a batch-invariant model runs eagerly (its "
                             "attention's steps follow the rows' context lengths, which a "
                             "captured program would fix)")
        if on and self._captures is None:
            if self.tp is not None or self.model is None:
                raise ValueError("HFModel.capture: a tensor-parallel shard runs eagerly "
                                 "(its collectives are not torch ops a recording sees)")
            self._captures = hf_capture.Captures(self.model)
        if self._captures is not None:
            self._captures.enabled = bool(on)

    def early_exit(self, num_layers: int) -> "HFModel":
        """The first ``num_layers`` decoder layers + the model's final norm and LM head,
        sharing this model's modules (no copy of any weight): a self-speculation draft
        (``verispec.drafters.EarlyExit``), whose pools are the target's first layers.

        Works where the model keeps its decoder layers in one ``nn.ModuleList`` and runs
        any prefix of it; checked with a recording forward (ValueError otherwise).
        """
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not (
                1 <= num_layers <= self.num_layers):
            raise ValueError(f"early_exit: num_layers must be an int in [1, {self.num_layers}], "
                             f"got {num_layers!r}")
        path = self._layer_list_path()
        clone = _shallow_copy(self.model)
        parent = clone
        for name in path[:-1]:
            child = _shallow_copy(getattr(parent, name))
            setattr(parent, name, child)
            parent = child
        full = getattr(parent, path[-1])
        # in the mode of the list it cuts (a new module starts in train mode)
        setattr(parent, path[-1], torch.nn.ModuleList(list(full)[:num_layers]).train(full.training))
        draft = HFModel.__new__(HFModel)
        draft.model = clone
        draft.layers = self.layers[:num_layers]
        draft._pool_of = {id(r.module): i for i, r in enumerate(draft.layers)}
        layer_kv = self.geometry.layer_kv
        draft.geometry = replace(self.geometry, num_layers=num_layers,
                                 layer_kv=None if layer_kv is None else layer_kv[:num_layers])
        draft.model_type = self.model_type
        draft.tp = self.tp  # the draft runs the shared (cut) modules, collectives included
        draft._kernels = self._kernels
        draft.native_attention = self.native_attention
        draft.batch_invariant = self.batch_invariant
        draft.tokenizer_fingerprint = self.tokenizer_fingerprint
        draft._captures = None
        probe, _ = draft._probe(self.geometry.device)
        if [id(r.module) for r in probe.layers] != [id(r.module) for r in draft.layers]:
            raise ValueError(f"early_exit: {type(self.model).__name__} does not run a prefix of "
                             f"its layers (its forward called {len(probe.layers)} attention "
                             f"layers, expected the first {num_layers})")
        draft._captures = None if self._captures is None else hf_capture.Captures(clone)
        return draft

    def _layer_list_path(self) -> list[str]:
        """Attribute names from the model to the nn.ModuleList holding the decoder layers
        (element i contains layer i's attention module)."""
        attention = [r.module for r in self.layers]
        for name, module in self.model.named_modules():
            if (isinstance(module, torch.nn.ModuleList) and len(module) == len(attention)
                    and all(any(m is a for m in layer.modules())
                            for layer, a in zip(module, attention))):
                return name.split(".")
        raise ValueError(f"early_exit: {type(self.model).__name__} keeps no nn.ModuleList of "
                         f"its {len(attention)} decoder layers")

    def _shard(self, tp: Any, layers: list[_LayerRecord], vocab_size: int,
               device: torch.device) -> None:
        """Cuts the wrapped model to this rank's shard (``hf_tp``) and checks the cut: the
        logits of a few tokens in transformers' eager attention, before and after, must
        agree to rounding on every rank (the ranks decide together, so all refuse or
        none). A refusal here leaves the model cut: load it again."""
        from verispec.models import hf_tp

        plan = hf_tp.plan_shard(self.model, layers, tp.world_size, tp.rank)
        # every refusal that needs no collective is behind us; the check below and the
        # cut model's hooks call these
        missing = [n for n in ("all_reduce", "gather_vocab") if not callable(getattr(tp, n, None))]
        if missing:
            raise TypeError(f"HFModel: tp must be a verispec.distributed.TensorParallel (with "
                            f"all_reduce and gather_vocab), got {type(tp).__name__} without "
                            f"{' and '.join(missing)}")
        ids = (torch.arange(SHARD_CHECK_TOKENS, device=device) * 7 + 1) % vocab_size
        self.model.set_attn_implementation("eager")
        try:
            want = self._eager_logits(ids)
            hf_tp.apply_shard(plan, tp)  # outside inference_mode: the cut weights are
            try:                         # parameters, not inference tensors
                got = self._eager_logits(ids)
            except RuntimeError as e:
                raise _refuse(self.model, f"tensor parallelism: the cut model's forward "
                                          f"failed on rank {tp.rank} (a model that reshapes "
                                          f"by the config's head count cannot run a rank's "
                                          f"heads): {e}") from e
            scale = want.abs().max().double().clamp_min(1e-30)
            err = ((got - want).abs().max().double() / scale).reshape(1)
            tp.all_reduce(err)
        finally:
            self.model.set_attn_implementation(ATTN_IMPLEMENTATION)
        tol = SHARD_CHECK_RTOL.get(want.dtype, SHARD_CHECK_RTOL[None])
        if not float(err) <= tol:
            raise _refuse(self.model, f"tensor parallelism: its base_model_tp_plan does not "
                                      f"reproduce the model: the cut model's logits differ by "
                                      f"{float(err):.3g} of their largest (summed over the "
                                      f"ranks), expected <= {tol:g}")

    def _eager_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """All logits of ``ids`` as one sequence, in the model's own (eager) attention."""
        positions = torch.arange(ids.shape[0], device=ids.device)
        with torch.inference_mode():
            return self.model(input_ids=ids[None], position_ids=positions[None],
                              use_cache=False, return_dict=True).logits[0]

    def _probe(self, device: torch.device) -> tuple[_Probe, torch.Tensor]:
        """One recording forward of 2 tokens keeping the last one's logits: what each
        layer passed to the attention function, and the logits."""
        probe = _Probe()
        logits = self._call(torch.zeros(2, dtype=torch.long, device=device),
                            torch.arange(2, device=device), torch.tensor([1], device=device),
                            probe)
        return probe, logits

    def _call(self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor,
              ctx: Any) -> torch.Tensor:
        if self.model is None:
            raise RuntimeError("HFModel: this wrapper's modules were cut by "
                               "verispec.distributed.shard; use the model shard returned")
        token = _CONTEXT.set(ctx)
        try:
            with torch.inference_mode():
                captures = self._captures
                if (captures is None or type(ctx) is not _Plan
                        or ids.shape[0] > hf_capture.MAX_TOKENS):
                    return self._eager_call(ids, positions, keep)
                k = self._kernels
                key = (ids.shape[0], keep.shape[0], ids.dtype, positions.dtype, keep.dtype,
                       ids.stride(), positions.stride(), keep.stride(), ids.device,
                       None if k is None else (k.linear, k.norm, k.rope),
                       getattr(self.model.config, "_attn_implementation", None))
                calls = ctx.calls

                def redo() -> None:
                    ctx.calls = calls

                return captures.forward(key, self._eager_call, ids, positions, keep, redo)
        finally:
            _CONTEXT.reset(token)

    def _eager_call(self, ids: torch.Tensor, positions: torch.Tensor,
                    keep: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids[None], position_ids=positions[None], use_cache=False,
                          logits_to_keep=keep, return_dict=True).logits

    def __call__(self, batch: PagedBatch) -> torch.Tensor:
        return self.forward(batch)

    def forward(self, batch: PagedBatch) -> torch.Tensor:
        """Logits [R, vocab] (model dtype) of the tokens ``batch.logits_indices``."""
        self._check(batch)
        g = self.geometry
        device = g.device
        plan = _Plan(batch, self._pool_of, device)
        plan.kernels = self._kernels  # read by the RoPE dispatcher (_rope_dispatch)
        if self.batch_invariant:
            plan.prepare_batch_invariant()
        else:
            plan.prepare(self.native_attention)
        if max(plan.ctx_lens) > g.max_context:
            raise ValueError(f"HFModel.forward: context_lens must be <= max_context = "
                             f"{g.max_context}, got {max(plan.ctx_lens)}")
        logits = self._call(batch.input_ids.to(device), batch.positions.to(
            device=device, dtype=torch.long), batch.logits_indices.to(
            device=device, dtype=torch.long), plan)
        if plan.calls != g.num_layers:
            raise RuntimeError(f"HFModel.forward: {plan.calls} of {g.num_layers} layers called "
                               f"verispec's attention function (was the model's attention "
                               f"implementation changed after wrapping?)")
        return logits[0]

    def _check(self, batch: PagedBatch) -> None:
        check_batch(batch, self.geometry, "HFModel.forward")
