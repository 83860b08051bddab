"""The attention both models call, over a forward's ``PagedPlan``: three backends.

- ``"native"``: verispec's paged CPU kernels (float32 CPU models; ``layers.kernels``):
  every row attends in cache order, one rounding for decode, verify, tree, batched rows
  and prefill chunks. LlamaModel runs it through ``LlamaModel.native_layer_ops``,
  HFModel through ``HFModel.native_attention`` (layers without softcap or sinks).
- ``"sdpa"`` (:class:`TorchAttention`): gathers each group's keys from the pools and
  attends in torch (SDPA for long rows, two batched matmuls for few queries or with a
  softcap or sinks); any device and dtype. The fallback everywhere.
- ``"flashinfer"`` (:class:`FlashInferAttention`, the optional ``verispec[gpu]`` extra):
  FlashInfer's paged prefill / decode kernels reading the pools in place through the
  block tables (a page is a block: the pools' [blocks, block_size, KvH, D] is
  FlashInfer's "NHD" layout), chains as bottom-right causal masks, trees and windows
  of trees as custom masks, windows of chains as ``window_left``, softcaps as
  ``logits_soft_cap``. Layers with attention sinks use the SDPA path.

``select_backend`` picks one for a model (``LlamaModel.attention_backend``,
``HFModel.attention_backend``): "auto" is FlashInfer on a CUDA device where ``import
flashinfer`` works, else SDPA (the native kernels, where a model turns them on, come
first). Asking for a backend that cannot run raises ValueError naming it.

Every backend reads the new tokens' K/V from the pools: the caller writes them first
(``plan.write``), except the native ``write_attend``, which writes and attends in one call.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F

from verispec.models.layers.paged import SMALL_ROW_QUERIES, PagedPlan, RowGroup
from verispec.models.staging import upload

__all__ = ["BACKENDS", "FlashInferAttention", "TorchAttention", "attend_long_row",
           "attend_matmul", "flashinfer_available", "select_backend"]

#: The names ``select_backend`` takes ("auto" picks one of the others).
BACKENDS = ("auto", "native", "sdpa", "flashinfer")

_FLASHINFER: list = []  # [module or None], once imported


def flashinfer_available() -> bool:
    """Whether ``import flashinfer`` works (tried once a process)."""
    if not _FLASHINFER:
        try:
            import flashinfer  # noqa: F401 - optional: the verispec[gpu] extra
        except Exception:  # noqa: BLE001 - any failure to load it: not available
            flashinfer = None
        _FLASHINFER.append(flashinfer)
    return _FLASHINFER[0] is not None


def select_backend(name: str, device: torch.device, dtype: torch.dtype, *,
                   who: str = "attention_backend") -> str:
    """The backend ``name`` resolves to for a model on ``device`` in ``dtype``: "auto" ->
    "flashinfer" on CUDA where FlashInfer imports, else "sdpa"; another name as it is,
    once checked that it can run there (ValueError naming it otherwise)."""
    if name not in BACKENDS:
        raise ValueError(f"{who}: must be one of {', '.join(map(repr, BACKENDS))}, "
                         f"got {name!r}")
    device = torch.device(device)
    if name == "auto":
        return "flashinfer" if device.type == "cuda" and flashinfer_available() else "sdpa"
    if name == "native" and not (device.type == "cpu" and dtype == torch.float32):
        raise ValueError(f"{who}: backend 'native' (verispec's paged CPU kernels) needs a "
                         f"float32 model on the CPU, got {dtype} on {device}")
    if name == "flashinfer":
        if device.type != "cuda":
            raise ValueError(f"{who}: backend 'flashinfer' needs a CUDA device, got {device}")
        if not flashinfer_available():
            raise ValueError(f"{who}: backend 'flashinfer' needs the flashinfer package "
                             f"(pip install 'verispec[gpu]'), which does not import here")
    return name


class TorchAttention:
    """The "sdpa" backend: each group's keys gathered from the pools (or a slice of them),
    attended in torch.

    A lone row of few queries whose keys are a slice of the pool (plain decoding, a verify
    pass) takes the lean path: two batched matmuls over views of the pool, the mask and
    scaling fused into the first. Groups of more than SMALL_ROW_QUERIES queries without
    a softcap or sinks call SDPA; the others attend in two batched matmuls rounding as
    transformers' eager attention (``attend_matmul``).

    ``sdpa_groups`` keeps LlamaModel's rounding (as before the plans were merged): a
    single-row batch of few queries takes the lean path whether its keys are sliced or
    gathered, every group of several rows calls SDPA (fresh prefills of one length as
    plain causal attention), and the rows of a tree batch without a softcap or sinks
    attend one by one.
    """

    name = "sdpa"

    def __init__(self, *, sdpa_groups: bool = False):
        self.sdpa_groups = sdpa_groups

    def attend(self, plan: PagedPlan, q: torch.Tensor, k_flat: torch.Tensor,
               v_flat: torch.Tensor, *, scaling: float, window: Optional[int] = None,
               softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None
               ) -> torch.Tensor:
        """q [T, H, Dk] of the batch's new tokens against each row's keys in the flat
        pools k_flat [slots, KvH, Dk], v_flat [slots, KvH, Dv] -> [T, H, Dv]."""
        plain = softcap is None and sinks is None
        groups = plan.groups
        t, h = q.shape[0], q.shape[1]
        if self.sdpa_groups and plan.num_rows == 1 and groups[0].n <= SMALL_ROW_QUERIES and plain:
            return self._attend_lean(groups[0], q, k_flat, v_flat, scaling, window)
        if (not self.sdpa_groups and len(groups) == 1 and groups[0].lean and plain):
            return self._attend_lean(groups[0], q, k_flat, v_flat, scaling, window)
        if self.sdpa_groups and plan.tree is not None and plan.num_rows > 1 and plain:
            return self._attend_tree_rows(plan, q, k_flat, v_flat, scaling, window)
        g0 = groups[0]
        if len(groups) == 1 and g0.tokens is None and g0.lo == 0 and g0.hi == t:
            return self._attend_group(g0, q, k_flat, v_flat, scaling, window, softcap, sinks,
                                      self.sdpa_groups)
        out = q.new_empty(t, h, v_flat.shape[2])
        for g in groups:
            if g.tokens is None:
                out[g.lo:g.hi] = self._attend_group(g, q[g.lo:g.hi], k_flat, v_flat, scaling,
                                                    window, softcap, sinks, self.sdpa_groups)
            else:
                out.index_copy_(0, g.tokens, self._attend_group(
                    g, q.index_select(0, g.tokens), k_flat, v_flat, scaling, window, softcap,
                    sinks, self.sdpa_groups))
        return out

    @staticmethod
    def _attend_lean(g: RowGroup, q, k_flat, v_flat, scaling, window):
        """One row's few queries, q [n, H, Dk], against its keys -> [n, H, Dv] in two
        batched matmuls (bias + q k^T * scaling, softmax in float32, probs v). Query
        head h reads KV head h // (H / KvH), as transformers' repeat_kv does."""
        n, h, dk = q.shape
        kvh, dv = k_flat.shape[1], v_flat.shape[2]
        grp = h // kvh
        k, v = g.keys(k_flat)[0], g.keys(v_flat)[0]                             # [L, KvH, D]
        qg = q.reshape(n, kvh, grp, dk).transpose(0, 1).reshape(kvh, n * grp, dk)  # i * grp + j
        bias, weight = g.bias(window, grp, q.dtype)
        scores = torch.baddbmm(bias, qg, k.permute(1, 2, 0), beta=weight, alpha=scaling)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
        out = torch.bmm(probs, v.transpose(0, 1))                               # [KvH, n*grp, Dv]
        return out.view(kvh, n, grp, dv).transpose(0, 1).reshape(n, h, dv)

    @staticmethod
    def _attend_group(g: RowGroup, q, k_flat, v_flat, scaling, window, softcap, sinks,
                      sdpa_groups=False):
        """q [T_g, H, Dk] of the group's tokens -> [T_g, H, Dv]."""
        h, dk = q.shape[1], q.shape[2]
        kvh, dv = k_flat.shape[1], v_flat.shape[2]
        k, v = g.keys(k_flat), g.keys(v_flat)                                   # [b, L, KvH, D]
        if g.q_index is None:
            qp = q.reshape(g.b, g.n, h, dk)
        else:
            qp = q.new_zeros(g.b * g.n, h, dk)
            qp[g.q_index] = q
            qp = qp.view(g.b, g.n, h, dk)
        if softcap is None and sinks is None and (sdpa_groups or g.n > SMALL_ROW_QUERIES):
            # a fresh prefill that no window cuts is plain causal attention
            causal = ((g.fresh if sdpa_groups else g.is_causal)
                      and (window is None or window <= 0 or window >= g.l))
            mask = None if causal else g.mask(window)
            out = F.scaled_dot_product_attention(
                qp.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                attn_mask=None if mask is None else mask[:, None], is_causal=causal,
                scale=scaling, enable_gqa=h != kvh).transpose(1, 2)           # [b, n, H, Dv]
        else:
            out = attend_matmul(qp, k, v, g.mask(window), scaling, softcap, sinks)
        out = out.reshape(g.b * g.n, h, dv)
        return out if g.q_index is None else out[g.q_index]

    @staticmethod
    def _attend_tree_rows(plan: PagedPlan, q, k_flat, v_flat, scaling, window):
        """A tree batch row by row in SDPA, each row over its own keys with its ancestor
        mask cut by the window (LlamaModel's rounding): q [T, H, Dk] -> [T, H, Dv]."""
        h, kvh = q.shape[1], k_flat.shape[1]
        out = q.new_empty(q.shape[0], h, v_flat.shape[2])
        for g in plan.groups:
            k, v = g.keys(k_flat), g.keys(v_flat)                               # [b, L, KvH, D]
            mask = g.mask(window)
            for i, r in enumerate(g.rows):
                lo, hi, ctx = plan.starts[r], plan.starts[r + 1], plan.ctx_lens[r]
                o = F.scaled_dot_product_attention(
                    q[lo:hi].transpose(0, 1), k[i, :ctx].transpose(0, 1),
                    v[i, :ctx].transpose(0, 1),
                    attn_mask=None if mask is None else mask[i, :hi - lo, :ctx],
                    scale=scaling, enable_gqa=h != kvh)                         # [H, n, Dv]
                out[lo:hi] = o.transpose(0, 1)
        return out


def attend_matmul(q, k, v, mask, scaling, softcap, sinks):
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


def attend_long_row(index: Any, row: int, q: torch.Tensor, k_flat: torch.Tensor,
                    v_flat: torch.Tensor) -> torch.Tensor:
    """The native backend's rows past the paged kernel's KERNEL_MAX_QUERIES (a long
    prompt at once) in SDPA: row ``row``'s n new tokens q [n, H, D] (``index`` a
    ``paged.NativeIndex``), token t seeing keys 0..positions[t] -> [n, H, D]."""
    n, h, _ = q.shape
    ctx, bs = int(index.context_lens[row]), index.block_size
    j = torch.arange(ctx)
    slots = index.tables[row].to(torch.long)[j // bs] * bs + j % bs
    k = k_flat.index_select(0, slots).transpose(0, 1)[None]               # [1, KvH, L, D]
    v = v_flat.index_select(0, slots).transpose(0, 1)[None]
    start = int(index.query_start[row])
    pos = index.positions[start:start + n]
    fresh = n == ctx and bool((pos == j).all())
    mask = None if fresh else j[None, :] <= pos[:, None]                   # [n, L]
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=mask,
                                       is_causal=fresh, enable_gqa=h != k_flat.shape[1])
    return o[0].transpose(0, 1)


# FlashInfer's workspace: one per device, shared by every wrapper (its documented size
# for prefill and decode is 128 MiB).
_WORKSPACE_BYTES = 128 * 1024 * 1024
_WORKSPACES: dict[torch.device, torch.Tensor] = {}


class FlashInferAttention:
    """The "flashinfer" backend: FlashInfer's paged kernels over the pools in place.

    Per forward, the page table of the rows with new tokens in FlashInfer's CSR form
    (``kv_indptr``, ``kv_indices``: each row's first ceil(context / block_size) blocks,
    ``kv_last_page_len``) and the rows' query offsets (``qo_indptr``) are built once from
    the plan; a wrapper is planned once per (scaling, window, softcap) a layer passes and
    run by every layer with those. A batch of one query per row (plain decoding) runs the
    decode wrapper; anything else the prefill wrapper: chain rows causal (bottom-right
    aligned, which is "keys 0..position" for rows whose new tokens end their context),
    trees with the plan's masks as FlashInfer's custom mask. A layer with sinks attends
    through ``fallback`` (SDPA). Runs on CUDA only; not run by this project's CPU tests.
    """

    name = "flashinfer"

    def __init__(self, fallback: Optional[TorchAttention] = None):
        flashinfer_available()
        self.fi = _FLASHINFER[0]
        if self.fi is None:
            raise ValueError("attention_backend: backend 'flashinfer' needs the flashinfer "
                             "package (pip install 'verispec[gpu]'), which does not import here")
        self.fallback = fallback or TorchAttention()
        self._forward: Any = None   # the plan whose page table is built
        self._wrappers: dict[tuple, Any] = {}

    def _page_table(self, plan: PagedPlan) -> dict[str, Any]:
        rows = [r for r in range(plan.num_rows) if plan.q_lens[r] > 0]
        bs = plan.block_size
        pages = [-(-plan.ctx_lens[r] // bs) for r in rows]
        kv_indptr = [0]
        for p in pages:
            kv_indptr.append(kv_indptr[-1] + p)
        tables = plan.block_tables
        indices = torch.cat([tables[r, :p] for r, p in zip(rows, pages)]).to(torch.int32)
        qo_indptr = [0]
        for r in rows:
            qo_indptr.append(qo_indptr[-1] + plan.q_lens[r])
        # FlashInfer plans from host index arrays; the page indices are read on the device
        table = dict(
            rows=rows, decode=plan.tree is None and all(plan.q_lens[r] == 1 for r in rows),
            qo_indptr=torch.tensor(qo_indptr, dtype=torch.int32),
            kv_indptr=torch.tensor(kv_indptr, dtype=torch.int32),
            kv_indices=upload(plan.staging, indices, torch.int32, plan.device),
            last_page_len=torch.tensor([plan.ctx_lens[r] - (p - 1) * bs
                                        for r, p in zip(rows, pages)], dtype=torch.int32),
            # the batch's tokens in row order (rows with no new tokens hold none)
            contiguous=rows == list(range(rows[0], rows[-1] + 1)))
        return table

    def _custom_mask(self, plan: PagedPlan, window: Optional[int]) -> torch.Tensor:
        """Each row's [n, ctx] visibility (ancestors, window) flattened row after row."""
        parts = []
        for g in plan.groups:
            mask = g.mask(window)
            for i, r in enumerate(g.rows):
                n, ctx = plan.q_lens[r], plan.ctx_lens[r]
                parts.append(torch.ones(n * ctx, dtype=torch.bool, device=plan.device)
                             if mask is None else mask[i, :n, :ctx].reshape(-1))
        return torch.cat(parts)

    def _wrapper(self, plan: PagedPlan, table: dict, q: torch.Tensor, k_pool: torch.Tensor,
                 scaling: float, window: Optional[int], softcap: Optional[float]):
        key = (scaling, window, softcap, q.shape[1], k_pool.shape[2], k_pool.shape[3])
        wrapper = self._wrappers.get(key)
        if wrapper is not None:
            return wrapper
        dev = plan.device
        workspace = _WORKSPACES.get(dev)
        if workspace is None:
            workspace = _WORKSPACES[dev] = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8,
                                                       device=dev)
        fi = self.fi
        common = dict(num_qo_heads=q.shape[1], num_kv_heads=k_pool.shape[2],
                      page_size=plan.block_size, sm_scale=scaling, logits_soft_cap=softcap,
                      q_data_type=q.dtype, kv_data_type=k_pool.dtype)
        tree = plan.tree is not None
        window_left = -1 if window is None or window <= 0 or tree else window - 1
        if table["decode"]:
            wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
            wrapper.plan(table["kv_indptr"], table["kv_indices"], table["last_page_len"],
                         head_dim=k_pool.shape[3], window_left=window_left, **common)
        else:
            wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
            wrapper.plan(table["qo_indptr"], table["kv_indptr"], table["kv_indices"],
                         table["last_page_len"], head_dim_qk=k_pool.shape[3],
                         custom_mask=self._custom_mask(plan, window) if tree else None,
                         causal=not tree, window_left=window_left, **common)
        self._wrappers[key] = wrapper
        return wrapper

    def attend(self, plan: PagedPlan, q: torch.Tensor, k_pool: torch.Tensor,
               v_pool: torch.Tensor, *, scaling: float, window: Optional[int] = None,
               softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None
               ) -> torch.Tensor:
        """q [T, H, D] against the pools [blocks, block_size, KvH, D] (the new tokens'
        K/V already written) -> [T, H, D]."""
        if sinks is not None or k_pool.shape[3] != v_pool.shape[3]:
            return self.fallback.attend(plan, q, k_pool.view(-1, *k_pool.shape[2:]),
                                        v_pool.view(-1, *v_pool.shape[2:]), scaling=scaling,
                                        window=window, softcap=softcap, sinks=sinks)
        if self._forward is not plan:  # a new forward: its page table, wrappers re-planned
            self._forward, self._wrappers = plan, {}
            self._table = self._page_table(plan)
        table = self._table
        rows = table["rows"]
        if table["contiguous"]:
            lo, hi = plan.starts[rows[0]], plan.starts[rows[-1] + 1]
            q_rows = q[lo:hi]
        else:
            index = torch.cat([torch.arange(plan.starts[r], plan.starts[r + 1]) for r in rows])
            q_rows = q.index_select(0, index.to(q.device))
        wrapper = self._wrapper(plan, table, q, k_pool, scaling, window, softcap)
        o = wrapper.run(q_rows.contiguous(), (k_pool, v_pool))
        if table["contiguous"] and lo == 0 and hi == q.shape[0]:
            return o
        out = q.new_zeros(q.shape[0], q.shape[1], v_pool.shape[3])
        if table["contiguous"]:
            out[lo:hi] = o
        else:
            out.index_copy_(0, index.to(q.device), o)
        return out
